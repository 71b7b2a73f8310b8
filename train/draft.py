"""Train the draft model: ``python -m train.draft [--export checkpoints/tiny-code-draft]``.

A much smaller Qwen3 on the same tokenizer and data as the target, trained from scratch
by the same loop (:mod:`train.lm`); checkpoints under ``runs/<config>``.
"""

from __future__ import annotations

from collections.abc import Sequence

from specjax.config import Qwen3Config
from train import lm

PRESETS = {
    # ~1.44M parameters (1.05M of them the tied 8192 x 128 embedding).
    "tiny-code-draft": Qwen3Config(
        vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}


def main(argv: Sequence[str] | None = None) -> None:
    lm.main(PRESETS, "tiny-code-draft", argv, prog="python -m train.draft", description=__doc__)


if __name__ == "__main__":
    from train import run

    run(main, "python -m train.draft")
