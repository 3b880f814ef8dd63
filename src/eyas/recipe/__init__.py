"""One command for the whole pipeline: a recipe file's stages, each resumable from its output."""

from eyas.recipe.run import run_recipe

__all__ = ["run_recipe"]
