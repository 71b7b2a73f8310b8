"""`python -m specjax.llamacpp_convert LLAMA_CPP CHECKPOINT TYPE OUTFILE`: llama.cpp's own
converter (LLAMA_CPP/convert_hf_to_gguf.py) run on a Hugging Face Qwen3 folder, writing a
GGUF file of TYPE (`--outtype`: f32, bf16, f16, q8_0). `specjax.llamacpp.convert` runs it in
a subprocess: the converter imports torch and its own gguf-py, none of which specjax needs.

One thing differs from running the script itself. The converter names a BPE tokenizer's
pre-tokenizer by looking up a hash of how it splits a test string in a table of published
tokenizers, and refuses one it does not know, such as the shipped checkpoints' own (trained
by train/). Here an unknown hash is written as "gpt-2": the shipped tokenizer's
pre-tokenizer is GPT-2's byte-level regex (tokenizer.json: `ByteLevel` with `use_regex`),
and the bench feeds token ids to llama.cpp, never text, so llama.cpp's tokenizer is not
used either way. The converter's file belongs to the user's llama.cpp tree and is left as
it is: the lookup is replaced on its class after import.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> None:
    """Convert: argv is [llama.cpp source tree, checkpoint folder, outtype, output file]."""
    source, model, gguf_type, outfile = argv
    sys.path.insert(0, source)  # the script and, in recent trees, its `conversion` package
    script = importlib.import_module("convert_hf_to_gguf")  # puts its own gguf-py first on sys.path
    # the class holding the lookup: in the script in older trees, in conversion/base.py since the split
    text_model = getattr(script, "TextModel", None) or importlib.import_module("conversion.base").TextModel
    known = text_model.get_vocab_base_pre

    def vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # a hash not in the table: see the module docstring
            print("specjax: BPE pre-tokenizer not in the converter's table; written as gpt-2 "
                  "(the bench feeds token ids, so llama.cpp never tokenizes)", file=sys.stderr)
            return "gpt-2"

    text_model.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(Path(source) / "convert_hf_to_gguf.py"), model, "--outtype", gguf_type, "--outfile", outfile]
    script.main()


if __name__ == "__main__":
    main(sys.argv[1:])
