"""Train the target model: ``python -m train.target --config tiny-code [--export checkpoints/tiny-code]``.

Resumes from ``runs/<config>`` when a checkpoint is there; see :mod:`train.lm` for the
loop, flags and outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from specjax.config import Qwen3Config
from train import lm

PRESETS = {
    # ~12.6M parameters (3.1M of them the tied 8192 x 384 embedding).
    "tiny-code": Qwen3Config(
        vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
}


def main(argv: Sequence[str] | None = None) -> None:
    lm.main(PRESETS, "tiny-code", argv, prog="python -m train.target", description=__doc__)


if __name__ == "__main__":
    from train import run

    run(main, "python -m train.target")
