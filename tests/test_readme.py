"""Every ```python block of README.md runs, as written, from the repository root.

The blocks share one namespace, in order (the later ones use the first one's `target`);
the serving block's client talks to a server started here on a free port of 127.0.0.1,
serving the shipped model under the name the README uses, so only the port differs.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from conftest import running


ROOT = Path(__file__).resolve().parents[1]
README_URL = "http://127.0.0.1:8000/v1"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)


@contextlib.contextmanager
def served(name: str):
    """tiny-code on a free port (uvicorn in a thread), as `specjax serve` runs it; yields the
    base URL."""
    import specjax
    from specjax.engine import Engine, engine_options
    from specjax.server import create_app

    model = specjax.load(ROOT / "checkpoints" / "tiny-code")
    options, per_request = engine_options(specjax.Adaptive(specjax.NgramProposer(k=15)))
    engine = Engine(model, **options, max_batch=2, max_len=256)
    with running(create_app(engine, name, per_request)) as url:
        yield f"{url}/v1"


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3 and any("specjax.generate" in b for b in blocks) and any(README_URL in b for b in blocks)


def test_every_python_block_runs(monkeypatch):
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the repository root
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(python_blocks()):
        if README_URL in block:
            with served("tiny-code") as url:
                exec(compile(block.replace(README_URL, url), f"README.md python block {i}", "exec"), namespace)
        else:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    assert namespace["fast"].tokens == namespace["plain"].tokens
    assert namespace["out"].choices[0].text
