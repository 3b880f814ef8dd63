"""Export eyas drafters in the layouts vLLM and SGLang load, and import drafters trained
elsewhere (official EAGLE-3, SpecForge, speculators) as eyas checkpoints."""

from eyas.lazy import lazy_exports

__all__ = ["LAYOUTS", "export_drafter", "import_drafter", "serve_command"]
__getattr__ = lazy_exports(__name__, {
    "eyas.export.exporter": ("export_drafter", "serve_command"),
    "eyas.export.importer": ("import_drafter",),
    "eyas.export.layouts": ("LAYOUTS",),
})
