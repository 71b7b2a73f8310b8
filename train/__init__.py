"""Training pipelines for the shipped models: corpus, tokenizer, causal-LM training."""

from __future__ import annotations

import sys
from collections.abc import Callable


def run(main: Callable[[], None], prog: str) -> None:
    """A stage's command-line entry: bad input (a missing folder or file, a checkpoint or
    config that does not load: any `SpecjaxError`) ends with one line naming it and exit
    code 2, as argparse's own errors do, instead of a traceback."""
    from specjax.errors import SpecjaxError

    try:
        main()
    except (SpecjaxError, FileNotFoundError, NotADirectoryError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
