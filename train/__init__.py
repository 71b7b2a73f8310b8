"""Training pipelines for the shipped models: corpus, tokenizer, causal-LM training."""

from __future__ import annotations

import sys
from collections.abc import Callable


def run(main: Callable[[], None], prog: str) -> None:
    """A stage's command-line entry: bad input (a missing folder or file, a checkpoint or
    config that does not load: any `SpecjaxError`) ends with one line naming it and exit
    code 2, as argparse's own errors do, instead of a traceback. An interrupt that a stage
    did not turn into a stop of its own ends with one line too, and exit code 130 (as a
    shell reports Ctrl-C)."""
    from specjax.errors import SpecjaxError

    try:
        main()
    except (SpecjaxError, FileNotFoundError, NotADirectoryError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
