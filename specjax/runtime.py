"""Process-wide JAX settings specjax turns on lazily (never at import)."""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

_enabled = False


def _cpuinfo() -> tuple[list[str], frozenset[str]]:
    """The lines of /proc/cpuinfo that name the CPU, and its instruction-set flags (x86's
    `flags`, ARM's `Features`); empty where there is no /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return [], frozenset()
    names, flags = set(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features"):
            flags.update(value.split())
        elif key in ("model name", "CPU implementer", "CPU part"):
            names.add(value.strip())
    return sorted(names), frozenset(flags)


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo names them (empty if unknown), or
    the space-separated ones $SPECJAX_CPU_FLAGS gives (to see what another CPU would get)."""
    override = os.environ.get("SPECJAX_CPU_FLAGS")
    return frozenset(override.split()) if override is not None else _cpuinfo()[1]


def host_key() -> str:
    """A short digest of this machine's CPU (architecture, model, instruction-set flags).
    Anything compiled for the host (the -march=native kernels, XLA:CPU executables) is
    kept under it: a cache folder may be shared by machines with other CPUs, where code
    built for this one would not run."""
    names, _ = _cpuinfo()
    text = "\n".join([platform.machine(), *names, " ".join(sorted(cpu_flags()))])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


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
