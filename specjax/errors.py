"""`SpecjaxError`: the one base of every error specjax raises on bad input, and the type
tests its argument checks share.

Each concept keeps its own subclass (`ConfigError`, `CheckpointError`, `ProposerError`,
...), so a caller may catch one kind; `except specjax.SpecjaxError` catches them all, as the
command line does. It is a `ValueError`, so code that caught `ValueError` still does.
"""

from __future__ import annotations

import numbers
from typing import Any


class SpecjaxError(ValueError):
    """Bad input to specjax: a file, tensor, parameter or request it cannot serve exactly;
    the message names which."""


class PromptError(SpecjaxError):
    """Prompts that cannot be read or built: a prompt file, folder or line (the message
    names it), or benchmark prompts of a length the held-out files cannot give."""


def is_integer(value: Any) -> bool:
    """An int or NumPy integer, not a bool: what every integer argument takes."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """An int, float or NumPy number, not a bool: what every real-valued argument takes."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
