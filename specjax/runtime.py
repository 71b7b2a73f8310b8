"""Process-wide JAX settings specjax turns on lazily (never at import)."""

from __future__ import annotations

import os
from pathlib import Path

_enabled = False


def cache_dir() -> Path:
    """Where compiled steps persist: $SPECJAX_CACHE_DIR, else ~/.cache/specjax/jax."""
    env = os.environ.get("SPECJAX_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "specjax" / "jax"


def enable_compilation_cache(path: str | Path | None = None) -> None:
    """Turn on JAX's persistent compilation cache so a second run starts warm.

    Set SPECJAX_CACHE_DIR=off to disable it.
    """
    global _enabled
    if _enabled or os.environ.get("SPECJAX_CACHE_DIR") == "off":
        return
    import jax

    target = Path(path) if path else cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(target))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = True
