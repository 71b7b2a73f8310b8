"""`SpecjaxError`: the one base of every error specjax raises on bad input.

Each concept keeps its own subclass (`ConfigError`, `CheckpointError`, `ProposerError`,
...), so a caller may catch one kind; `except specjax.SpecjaxError` catches them all, as the
command line does. It is a `ValueError`, so code that caught `ValueError` still does.
"""

from __future__ import annotations


class SpecjaxError(ValueError):
    """Bad input to specjax: a file, tensor, parameter or request it cannot serve exactly;
    the message names which."""
