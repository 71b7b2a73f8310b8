"""specjax: lossless speculative decoding for Qwen3-family models in JAX.

Public names are imported lazily so `import specjax` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load": "model", "save": "model", "shard": "model", "Model": "model",
    "generate": "loop", "GenerateResult": "results", "Stats": "results",
    "Sampling": "sampling",
    "NgramProposer": "proposers", "DraftProposer": "proposers", "DFlashProposer": "proposers",
    "Adaptive": "adaptive", "LookupProposer": "adaptive",  # LookupProposer: deprecated
    "load_dflash": "dflash", "save_dflash": "dflash", "Drafter": "dflash",
    "Qwen3Config": "config",
    "Engine": "engine", "Request": "engine", "Speculation": "engine", "HostDrafter": "engine",
    "make_mesh": "sharding",
    "SpecjaxError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
