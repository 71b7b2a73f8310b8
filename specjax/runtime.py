"""Process-wide JAX settings specjax turns on lazily (never at import)."""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

_enabled = False


def _cpuinfo() -> str:
    """The lines of /proc/cpuinfo that name the CPU and its instruction sets ('' elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({line.split(":", 1)[1].strip() for line in text.splitlines()
                              if ":" in line and line.split(":", 1)[0].strip() in keys}))


def host_key() -> str:
    """A short digest of this machine's CPU (architecture, model, instruction-set flags).
    Anything compiled for the host (the -march=native kernels, XLA:CPU executables) is
    kept under it: a cache folder may be shared by machines with other CPUs, where code
    built for this one would not run."""
    return hashlib.sha256(f"{platform.machine()}\n{_cpuinfo()}".encode()).hexdigest()[:12]


def cache_dir() -> Path:
    """Where compiled steps persist: $SPECJAX_CACHE_DIR, else ~/.cache/specjax/jax."""
    env = os.environ.get("SPECJAX_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "specjax" / "jax"


def enable_compilation_cache(path: str | Path | None = None) -> None:
    """Turn on JAX's persistent compilation cache so a second run starts warm, in a
    subfolder of `path` (default `cache_dir()`) for this machine's CPU (`host_key`).

    Set SPECJAX_CACHE_DIR=off to disable it.
    """
    global _enabled
    if _enabled or os.environ.get("SPECJAX_CACHE_DIR") == "off":
        return
    import jax

    target = (Path(path) if path else cache_dir()) / f"cpu-{host_key()}"
    target.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(target))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = True
