"""One command for the whole pipeline: a recipe file's stages, each resumable from its output."""

from eyas.lazy import lazy_exports

__all__ = ["run_recipe"]
__getattr__ = lazy_exports(__name__, {"eyas.recipe.run": ("run_recipe",)})
