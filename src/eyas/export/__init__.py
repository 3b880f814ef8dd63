"""Export eyas drafters in the layouts vLLM and SGLang load, and import drafters trained
elsewhere (official EAGLE-3, SpecForge, speculators) as eyas checkpoints."""

from eyas.export.exporter import export_drafter, serve_command
from eyas.export.importer import import_drafter
from eyas.export.layouts import LAYOUTS

__all__ = ["LAYOUTS", "export_drafter", "import_drafter", "serve_command"]
