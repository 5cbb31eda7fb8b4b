"""The one error a recipe that cannot run raises (the CLI: exit status 2, nothing written)."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the key, the value and what was expected."""
