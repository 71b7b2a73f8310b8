"""`specjax` command line: generate (streaming), bench and serve (an OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from .errors import SpecjaxError

if TYPE_CHECKING:  # the command line imports the library's modules only as a command needs them
    from .config import Qwen3Config
    from .sampling import Sampling

WARMUP_TOKENS = 256  # a warm-up as long as the run (up to this) touches every shape the run will
DEFAULT_NEW_TOKENS = 128  # `generate`'s length where neither --max-new-tokens nor the model folder gives one


class UsageError(SpecjaxError):
    """A command-line request that cannot be served."""


DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-code"


def default_model() -> Path:
    """$SPECJAX_MODEL, else the shipped checkpoints/tiny-code."""
    return Path(os.environ.get("SPECJAX_MODEL", DEFAULT_MODEL))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object of chat template variables (`specjax.chat`)."""
    from .chat import ChatError, template_kwargs

    try:
        return template_kwargs(json.loads(text), "a chat template's variables")
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    except ChatError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: '*', '' or origins as browsers send them (no path, no trailing /)."""
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    if origins == ("*",):
        return origins
    for o in origins:
        scheme, sep, rest = o.partition("://")
        if o == "*":
            raise argparse.ArgumentTypeError("'*' allows every origin: give it alone")
        if not (sep and scheme in ("http", "https") and rest and "/" not in rest):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin: scheme://host[:port] (http or https), "
                                             "no path or trailing '/', as browsers send it")
    return origins


def _k_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else _positive(text)


def _nodes_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a node count or auto, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a node count >= 0 or auto, got {value}")
    return value


def _sibling(model: Path, suffix: str) -> Path | None:
    """checkpoints/<name>-<suffix> next to a model folder, if it is there."""
    path = model.parent / f"{model.name}-{suffix}"
    return path if path.is_dir() else None


def _add_speculation(p) -> None:
    """The proposer flags of generate and serve."""
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculate", type=_k_or_auto, metavar="K|auto",
                      help="n-gram (prompt lookup) drafts of up to K tokens (auto: 15), k chosen per step")
    spec.add_argument("--draft", type=Path, metavar="DIR", help="draft model folder (same vocabulary)")
    spec.add_argument("--draft-k", type=_k_or_auto, default=None, metavar="K|auto",
                      help="draft model tokens per step (default 4); auto: adaptive k")
    spec.add_argument("--dflash", type=Path, metavar="DIR", help="DFlash drafter folder for this target")
    spec.add_argument("--dflash-k", type=_k_or_auto, default=None, metavar="K|auto",
                      help="DFlash drafts per step (default: block_size - 1, at most 15); auto: adaptive k")
    spec.add_argument("--sample-drafts", action="store_true",
                      help="sample draft-model / DFlash tokens (general acceptance rule)")
    spec.add_argument("--tree", type=_nodes_or_auto, default=0, metavar="N|auto",
                      help="draft trees of up to N nodes, verified in one step (0: chains): prompt lookup where "
                           "earlier matches continue differently, a draft model's and a DFlash drafter's "
                           "best nodes (sampled drafts: the chain plus second children); auto: up to 15 nodes, "
                           "the tree or the chain each round, whichever has held more")


KV_DTYPES = ("float32", "bfloat16")


def _add_kv_dtype(p) -> None:
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="what the KV cache holds (default: the compute dtype, float32 on CPU); bfloat16 halves "
                        "its memory and what attention reads, rounding each key and value as it is stored")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, streaming it as it is produced")
    p.add_argument("--model", type=Path, default=None,
                   help="HF Qwen3 folder (default: $SPECJAX_MODEL, else checkpoints/tiny-code)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    src.add_argument("--prompt-ids", type=_ids_arg, metavar="I,J,...",
                     help="the prompt as comma-separated token ids (for folders without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--chat-template-kwargs", type=_template_kwargs, default=None, metavar="JSON",
                   help="variables for the chat template, as vLLM's chat_template_kwargs "
                        "(e.g. '{\"enable_thinking\": false}' turns Qwen3's thinking off)")
    p.add_argument("--batch", action="store_true",
                   help="--prompt-file holds many prompts (one per line, or JSONL lines {\"prompt\": ...} or "
                        "{\"messages\": [...]}), generated together by the batched engine")
    p.add_argument("--max-new-tokens", type=_positive, default=None, metavar="N",
                   help=f"(default: the model folder's generation_config.json max_new_tokens, else "
                        f"{DEFAULT_NEW_TOKENS})")
    samp = p.add_argument_group("sampling (each flag not given: the model folder's generation_config.json; "
                                "greedy without one)")
    samp.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    samp.add_argument("--top-k", type=int, default=None, help="0 = off")
    samp.add_argument("--top-p", type=float, default=None, help="1 = off")
    samp.add_argument("--min-p", type=float, default=None, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    _add_speculation(p)
    _add_kv_dtype(p)
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the short warm-up generation that compiles the steps before the timed run")
    p.add_argument("--devices", type=_positive, default=1, metavar="N",
                   help="split the target's weights tensor-parallel over the first N local devices")
    p.add_argument("--no-speculate", action="store_true",
                   help="plain decoding (default without proposer flags: prompt lookup with k chosen per "
                        "step, and off CPU also the model's shipped -draft / -dflash siblings)")


def _add_bench(sub) -> None:
    from .bench import TREE_PROPOSERS
    from .llamacpp import GGUF_TYPES
    from .workloads import WORKLOADS

    p = sub.add_parser("bench", help="speedup per proposer and k, side by side with transformers")
    p.add_argument("--model", type=Path, default=None,
                   help="target folder (default: $SPECJAX_MODEL, else checkpoints/tiny-code)")
    p.add_argument("--draft", type=Path, default=None, help="draft model (default: checkpoints/tiny-code-draft if present)")
    p.add_argument("--dflash", type=Path, default=None, help="DFlash drafter (default: checkpoints/tiny-code-dflash if present)")
    p.add_argument("--quick", action="store_true",
                   help="one prompt, one repetition, fewer k (about ten minutes on two cores)")
    p.add_argument("--prompts", type=_positive, help="prompts per workload")
    p.add_argument("--reps", type=_positive, help="timed repetitions per prompt (after one warm-up)")
    p.add_argument("--new-tokens", type=_positive, help="tokens generated per run")
    p.add_argument("--prompt-tokens", type=_positive, help="approximate prompt length")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument("--trees", nargs="*", choices=TREE_PROPOSERS, default=None, metavar="PROPOSER",
                   help="proposers timed with draft trees and with --tree auto next to their chains (default: "
                        f"{' '.join(TREE_PROPOSERS)}; none: --trees alone)")
    _add_kv_dtype(p)
    p.add_argument("--no-profile", action="store_true",
                   help="skip the step profiles after the cells (this model's and the S config's; minutes on CPU)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="JSON, markdown and PNG output folder")
    lc = p.add_argument_group("llama.cpp in the same run (needs llama-cpp-python; README: \"llama.cpp in the benchmark\")")
    lc.add_argument("--llamacpp", type=Path, metavar="DIR",
                    help="a llama.cpp source tree (holding convert_hf_to_gguf.py and gguf-py/): convert the model "
                         "with its converter and time llama.cpp's plain and prompt-lookup decoding next to ours")
    lc.add_argument("--llamacpp-types", nargs="+", choices=GGUF_TYPES, metavar="TYPE",
                    help="GGUF weight types to convert to and time (default: f32 bf16 q8_0; f32 runs the greedy check)")
    lc.add_argument("--llamacpp-threads", type=_positive, metavar="N",
                    help="llama.cpp's threads (default: as many as specjax's kernels use, one per CPU)")
    lc.add_argument("--gguf-cache", type=Path, metavar="DIR",
                    help="where converted files are kept, by checkpoint content and type (default: ~/.cache/specjax/gguf)")
    p.add_argument("--concurrency", type=_levels, metavar="C,C,...",
                   help="instead: the batched engine with C concurrent requests (e.g. 1,2,4,8,16): aggregate and "
                        "per-request tokens/s, time to first token, inter-token latency")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the batched engine")
    p.add_argument("--model", type=Path, default=None,
                   help="HF Qwen3 folder (default: $SPECJAX_MODEL, else checkpoints/tiny-code)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: the model folder's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="0: any free port (the address is printed)")
    p.add_argument("--max-batch", type=_positive, default=8, metavar="N", help="rows (requests) decoding at once")
    p.add_argument("--max-len", type=_positive, default=None, metavar="N",
                   help="tokens of one sequence, prompt and completion (default: the model's context, "
                        "at most 4096)")
    p.add_argument("--rounds", type=_positive, default=None, metavar="R",
                   help="speculative rounds per device call (default 16); requests join between calls, so "
                        "fewer rounds shorten the time to first token at some cost in throughput")
    _add_speculation(p)
    _add_kv_dtype(p)
    p.add_argument("--no-speculate", action="store_true",
                   help="plain decoding (default: what generate does: prompt lookup, and off CPU also the "
                        "model's shipped -draft / -dflash siblings)")
    p.add_argument("--no-warmup", action="store_true",
                   help="start without compiling every step first (the first requests compile them)")
    p.add_argument("--allowed-origins", type=_origins, default=("*",), metavar="ORIGINS",
                   help="comma-separated web origins (scheme://host[:port]) whose pages may call the API from a "
                        "browser (CORS), '*' any (the default, as vLLM and llama.cpp's server), '' none")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="S",
                   help="on SIGTERM / SIGINT, seconds running requests may take to finish before they are "
                        "cancelled (each answered with a 503 error)")
    p.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto: the sampling fields (and chat's max_tokens) a request leaves out take what the "
                        "model folder's generation_config.json sets, as in vLLM; vllm: vLLM's own defaults "
                        "(temperature 1, no top-k / top-p / min-p)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Lossless speculative decoding for Qwen3 in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    _add_serve(sub)
    return parser


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text!r}")
    if len(set(levels)) < len(levels):
        raise argparse.ArgumentTypeError(f"concurrency levels must differ, got {text!r}")
    return levels


def _bench_concurrency(args) -> int:
    from .bench_batch import ConcurrencyConfig, run

    kw: dict = dict(model=args.model or default_model(), levels=args.concurrency, hf=not args.no_hf, out=args.out,
                    kv_dtype=args.kv_dtype)
    for ours, theirs in (("reps", "reps"), ("new_tokens", "new_tokens"), ("prompt_tokens", "prompt_tokens")):
        if getattr(args, theirs) is not None:
            kw[ours] = getattr(args, theirs)
    if args.workloads:
        kw["workloads"] = tuple(dict.fromkeys(args.workloads))
    if args.quick:
        kw.setdefault("reps", 1)
        kw.setdefault("new_tokens", 48)
        kw.setdefault("prompt_tokens", 256)
        kw["fixed_ks"], kw["samplings"] = (4,), ("greedy",)
    cfg = ConcurrencyConfig(**kw)
    run(cfg, log=lambda line: print(line, flush=True))
    print(f"wrote {cfg.out}/concurrency.json, concurrency.md")
    return 0


def _bench(args) -> int:
    from .bench import BenchConfig, run

    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a folder")
    if args.concurrency:
        single = [flag for flag, given in (
            ("--llamacpp", args.llamacpp is not None), ("--llamacpp-types", args.llamacpp_types is not None),
            ("--llamacpp-threads", args.llamacpp_threads is not None), ("--gguf-cache", args.gguf_cache is not None),
            ("--prompts", args.prompts is not None), ("--draft", args.draft is not None),
            ("--dflash", args.dflash is not None), ("--trees", args.trees is not None),
            ("--no-profile", args.no_profile)) if given]
        if single:  # (the concurrency run draws max(C) prompts and times prompt lookup alone, no profiles)
            raise UsageError(f"--concurrency does not use {', '.join(single)} (flags of the single-request "
                             "benchmark); drop them or --concurrency")
        return _bench_concurrency(args)
    model = args.model or default_model()
    kw = dict(model=model, draft=args.draft or _sibling(model, "draft"), dflash=args.dflash or _sibling(model, "dflash"),
              hf=not args.no_hf, profile=not args.no_profile, out=args.out, kv_dtype=args.kv_dtype)
    for name in ("prompts", "reps", "new_tokens", "prompt_tokens"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.workloads:
        kw["workloads"] = tuple(dict.fromkeys(args.workloads))
    if args.trees is not None:
        kw["trees"] = tuple(dict.fromkeys(args.trees))
        for name, flag in (("draft", "--draft"), ("dflash", "--dflash")):
            if name in kw["trees"] and kw[name] is None:
                raise UsageError(f"--trees {name}: there is no {name} model to draft trees with (give {flag} DIR; "
                                 f"{model.parent / (model.name + '-' + name)} is not there)")
    if args.llamacpp is not None:
        kw.update(llamacpp=args.llamacpp, gguf_cache=args.gguf_cache, llamacpp_threads=args.llamacpp_threads)
        if args.llamacpp_types:
            kw["gguf_types"] = tuple(dict.fromkeys(args.llamacpp_types))
    elif args.llamacpp_types or args.gguf_cache or args.llamacpp_threads:
        raise UsageError("--llamacpp-types, --llamacpp-threads and --gguf-cache go with --llamacpp DIR")
    cfg = BenchConfig.quick(**kw) if args.quick else BenchConfig(**kw)
    run(cfg, log=lambda line: print(line, flush=True))
    print(f"wrote {cfg.out}/results.json, results.md, speedup_vs_k.png, acceptance_by_position.png")
    return 0


def _ids_arg(text: str) -> list[int]:
    """--prompt-ids: ASCII decimal integers, spaces around them allowed; what int() would also
    take (1_000, other scripts' digits) is refused rather than read as some id."""
    parts = [t.strip() for t in text.split(",")]
    if not all(t.removeprefix("-").isascii() and t.removeprefix("-").isdigit() for t in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [int(t) for t in parts]


def _checked(ids: list[int], config: Qwen3Config, max_new_tokens: int, where: str) -> list[int]:
    """`ids` if the model takes them as a prompt with --max-new-tokens after it
    (`results.check_prompt`), else a UsageError naming `where` (the flag or file line that
    gave them): the engine's own error could not say which."""
    import numpy as np

    from .results import GenerationError, check_prompt

    try:  # Python ints as they are: an id past int64 is one outside the vocabulary, not an overflow
        check_prompt(config, np.asarray(ids, object), max_new_tokens)
    except GenerationError as e:
        raise UsageError(f"{where}: {e}") from None
    return ids


def _prompt_ids(args, tokenizer, folder: Path, config: Qwen3Config) -> list[int]:
    """The prompt the flags give, as token ids the model takes (`_checked`)."""
    from .chat import ChatError, render
    from .prompt_files import read_text

    if args.chat_template_kwargs is not None and not args.chat:
        raise UsageError("--chat-template-kwargs sets variables of the chat template: it needs --chat")
    if args.prompt_ids is not None:
        if args.chat:
            raise UsageError("--chat needs a text prompt (--prompt or --prompt-file), not --prompt-ids")
        return _checked(args.prompt_ids, config, args.max_new_tokens, f"--prompt-ids (model {folder})")
    if tokenizer is None:
        raise UsageError(f"{folder}: no tokenizer files (tokenizer.json / tokenizer_config.json); "
                         "give the prompt as --prompt-ids")
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise UsageError(f"--prompt-file {args.prompt_file}: no such file")
        text = read_text(args.prompt_file)
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise UsageError("give --prompt TEXT, --prompt-file F or --prompt-ids I,J,...")
    source = f"--prompt-file {args.prompt_file}" if args.prompt_file else "--prompt"
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("--chat: this model's tokenizer has no chat template")
        if not text.strip():  # the template's tokens alone are no prompt (as --batch refuses blank messages)
            raise UsageError(f"{source}: the prompt is empty (--chat needs a message)")
        try:
            ids = render(tokenizer, [{"role": "user", "content": text}], args.chat_template_kwargs)
        except ChatError as e:
            raise UsageError(f"{source}: {e}") from None
    else:
        ids = tokenizer(text)["input_ids"]
        if not ids:
            raise UsageError(f"{source}: the prompt is empty (it tokenizes to no tokens)")
    return _checked(ids, config, args.max_new_tokens, source)


def _check_no_speculate(args) -> None:
    """--no-speculate with a flag that asks for speculation is a contradiction, not a choice to
    make silently for the user."""
    if not args.no_speculate:
        return
    given = [flag for flag, on in (("--speculate", args.speculate is not None), ("--draft", args.draft is not None),
                                   ("--dflash", args.dflash is not None), ("--tree", args.tree != 0),
                                   ("--sample-drafts", args.sample_drafts)) if on]
    if given:
        raise UsageError(f"--no-speculate turns speculation off; it does not go with {', '.join(given)}")


def _check_drafter_flags(args) -> None:
    """--draft-k, --dflash-k and --sample-drafts tune the drafter --draft / --dflash names (not
    the default's siblings); without it they would change nothing, so they are refused."""
    drafter = args.draft is not None or args.dflash is not None
    for flag, given, ok, needs in (("--draft-k", args.draft_k is not None, args.draft is not None, "--draft DIR"),
                                   ("--dflash-k", args.dflash_k is not None, args.dflash is not None, "--dflash DIR"),
                                   ("--sample-drafts", args.sample_drafts, drafter, "--draft DIR or --dflash DIR")):
        if given and not ok:
            raise UsageError(f"{flag} tunes the drafter of {needs}; without one it would change nothing")


def _proposer(args, target):
    """The proposer the flags ask for; every one drafts inside the engine's device round.
    Prompt lookup (--speculate K, any K) and several proposers, or any k of `auto`, make an
    Adaptive one, chosen among per row and round (up to each one's k); a model proposer
    alone with a fixed k drafts that k every round."""
    import jax

    from .adaptive import Adaptive
    from .dflash import load_dflash
    from .model import load
    from .proposers import DFlashProposer, DraftProposer, NgramProposer

    _check_no_speculate(args)
    _check_drafter_flags(args)
    if args.no_speculate:
        return None
    chosen = []
    if args.speculate is not None:
        chosen.append((NgramProposer(k=15 if args.speculate == "auto" else args.speculate, tree=args.tree), "auto"))
    if args.draft is not None:
        k = {"auto": 7, None: 4}.get(args.draft_k, args.draft_k)
        chosen.append((DraftProposer(load(args.draft, target.dtype), k=k, sample=args.sample_drafts, tree=args.tree),
                       args.draft_k))
    if args.dflash is not None:
        k = None if args.dflash_k in (None, "auto") else args.dflash_k
        chosen.append((DFlashProposer(load_dflash(args.dflash, target), k=k, sample=args.sample_drafts, tree=args.tree),
                       args.dflash_k))
    # default: adaptive prompt lookup, plus the shipped sibling drafters off CPU. Measured
    # (docs/performance.md, section 4): on CPU a DFlash round costs ~2.9 plain rounds, so
    # the shipped drafter (tau ~2) loses to plain decoding and to lookup alone.
    if not chosen:
        chosen = [(NgramProposer(k=15, tree=args.tree), "auto")]
        model_dir = args.model or default_model()
        if jax.default_backend() != "cpu":
            if (draft := _sibling(model_dir, "draft")) is not None:
                chosen.append((DraftProposer(load(draft, target.dtype), k=7, tree=args.tree), "auto"))
            if (dflash := _sibling(model_dir, "dflash")) is not None:
                chosen.append((DFlashProposer(load_dflash(dflash, target), tree=args.tree), "auto"))
    if len(chosen) > 1 or chosen[0][1] == "auto":  # (prompt lookup's is always "auto")
        return Adaptive(*(p for p, _ in chosen))
    return chosen[0][0]


class _Streamer:
    """Prints a run's text as its tokens arrive: the text the server's completions give
    (`textstream.TextStream`: the stop ids and special tokens left out, an incomplete UTF-8
    sequence held back until the next tokens), or the token ids themselves when the model
    has no tokenizer."""

    def __init__(self, tokenizer, stop_ids: Iterable[int] = (), out=None):
        from .textstream import TextStream

        self.out = out or sys.stdout
        self.text = None if tokenizer is None else TextStream(tokenizer, stop_ids=stop_ids)

    def __call__(self, new: list[int]) -> None:
        self._write("".join(f"{t}," for t in new) if self.text is None else self.text.add(new))

    def close(self) -> None:
        """Print what is still held back: the text of a last chunk that ends inside a UTF-8
        sequence (cut there by --max-new-tokens), as the tokenizer decodes it (U+FFFD)."""
        if self.text is not None:
            self._write(self.text.add([], final=True))

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def _batch_prompts(args, tokenizer, folder: Path, config: Qwen3Config) -> list[list[int]]:
    """The prompts of a --batch file (`specjax.prompt_files`: JSONL records or one per line),
    each one the model takes (`_checked`, naming its line)."""
    from .prompt_files import read_prompt_file

    if args.prompt_file is None:
        raise UsageError("--batch reads its prompts from --prompt-file")
    if tokenizer is None:
        raise UsageError(f"{folder}: no tokenizer files (tokenizer.json / tokenizer_config.json) for --batch")
    prompts = read_prompt_file(args.prompt_file, tokenizer, chat=args.chat,
                               template_kwargs=args.chat_template_kwargs)
    return [_checked(list(p.ids), config, args.max_new_tokens, p.where) for p in prompts]


def _generate_batch(args, model, sampling) -> int:
    import numpy as np

    from .engine import Speculation, generate_batch

    folder = args.model or default_model()
    _check_no_speculate(args)
    _check_drafter_flags(args)
    if args.draft is not None or args.dflash is not None:
        raise UsageError("--batch drafts by prompt lookup (--speculate K) or not at all (--no-speculate)")
    prompts = _batch_prompts(args, model.tokenizer, folder, model.config)
    spec = None if args.no_speculate else Speculation(k=15 if args.speculate in (None, "auto") else args.speculate,
                                                      tree=args.tree)
    kw = dict(sampling=sampling, seed=args.seed, stop_ids=model.eos_ids, speculative=spec)
    t0 = time.perf_counter()
    if not args.no_warmup:
        generate_batch(model, prompts, max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens), **kw)
    warm_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    results = generate_batch(model, prompts, max_new_tokens=args.max_new_tokens, **kw)
    wall = time.perf_counter() - t1
    for i, res in enumerate(results):
        print(f"=== {i} ===")
        stream = _Streamer(model.tokenizer, model.eos_ids)
        stream(res.tokens)
        stream.close()
        print()
    total = sum(r.stats.new_tokens for r in results)
    per = [r.stats.tokens_per_s for r in results]
    steps = sum(r.stats.steps for r in results)
    line = (f"[{len(results)} requests, {total} tokens in {wall:.2f} s: {total / wall:.1f} tok/s aggregate, "
            f"per request {np.median(per):.1f} tok/s median ({min(per):.1f}-{max(per):.1f}), "
            f"time to first token {np.median([r.stats.prefill_s for r in results]) * 1e3:.0f} ms median, "
            f"warm-up {warm_s:.1f} s")
    if spec is not None and steps:
        line += f", {(total - len(results)) / steps:.2f} tokens/step"
    print(line + "]", file=sys.stderr)
    return 0


def _sampling(args, model) -> "Sampling":
    """The flags' sampling: each one given overrides that field of the model folder's
    generation_config.json defaults (greedy without the file), as a vLLM request's fields
    override its generation config. Prints the settings used on stderr."""
    import dataclasses

    from .sampling import Sampling

    base = model.generation_defaults or Sampling()
    given = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p")
             if getattr(args, name) is not None}
    sampling = dataclasses.replace(base, **given)
    source = ("flags" if len(given) == 4 else "generation_config.json" if model.generation_defaults is not None
              else "greedy: no generation_config.json")
    if given and len(given) < 4:
        source = f"flags {', '.join('--' + n.replace('_', '-') for n in given)}, the rest from " + (
            "generation_config.json" if model.generation_defaults is not None else "the greedy default")
    shown = ("greedy" if sampling.greedy else
             f"temperature {sampling.temperature:g}, top_k {sampling.top_k}, top_p {sampling.top_p:g}, "
             f"min_p {sampling.min_p:g}")
    print(f"[sampling: {shown} ({source})]", file=sys.stderr)
    return sampling


def _generate(args) -> int:
    from .loop import generate
    from .results import capacity_for
    from .model import load, request_defaults

    folder = args.model or default_model()
    mesh = None
    if args.devices > 1:
        import jax

        from .sharding import make_mesh
        devices = jax.local_devices()
        if args.devices > len(devices):
            raise UsageError(f"--devices {args.devices}: only {len(devices)} local device(s)")
        mesh = make_mesh(devices[:args.devices])
    model = load(folder, mesh=mesh, kv_dtype=args.kv_dtype)
    if args.max_new_tokens is None:  # as vLLM takes the file's length for a request without one
        args.max_new_tokens = request_defaults(folder).get("max_tokens", DEFAULT_NEW_TOKENS)
    sampling = _sampling(args, model)
    if args.batch:
        return _generate_batch(args, model, sampling)
    ids = _prompt_ids(args, model.tokenizer, folder, model.config)
    proposer = _proposer(args, model)
    stream = _Streamer(model.tokenizer, model.eos_ids)
    kw = dict(sampling=sampling, seed=args.seed, stop_ids=model.eos_ids, speculative=proposer,
              capacity=capacity_for(len(ids) + args.max_new_tokens))
    t0 = time.perf_counter()
    if not args.no_warmup:  # compile (or load from the persistent cache) the steps this run will use
        generate(model, ids, max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens), **kw)
    warm_s = time.perf_counter() - t0
    res = generate(model, ids, max_new_tokens=args.max_new_tokens, on_tokens=stream, **kw)
    stream.close()
    s = res.stats
    line = (f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, prefill {s.prefill_s * 1e3:.0f} ms "
            f"({s.prompt_tokens} prompt tokens), warm-up {warm_s:.1f} s")
    if proposer is not None:
        acc = s.accepted / s.drafted if s.drafted else 0.0
        line += f", {s.tokens_per_step:.2f} tokens/step, {acc:.0%} of drafts accepted"
    print(line + "]", file=sys.stderr)
    return 0


def _serve(args) -> int:
    """Load the model, build the engine the flags ask for and serve it (specjax.server)."""
    from .engine import Engine, engine_options
    from .model import load

    folder = args.model or default_model()
    try:
        from . import server
    except ImportError as e:  # starlette, uvicorn or prometheus_client missing
        raise UsageError(f"serve needs the server's packages: pip install 'specjax[serve]' ({e})") from None
    try:
        sock = server.bind(args.host, args.port)
    except OSError as e:
        raise UsageError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})") from None
    with sock:
        model = load(folder, kv_dtype=args.kv_dtype)
        if model.tokenizer is None:
            raise UsageError(f"{folder}: no tokenizer files (tokenizer.json / tokenizer_config.json); serving needs "
                             "one")
        options, per_request = engine_options(_proposer(args, model))
        if args.rounds is not None:
            options["rounds"] = args.rounds
        engine = Engine(model, **options, max_batch=args.max_batch, max_len=args.max_len)
        server.serve(engine, args.served_model_name or folder.resolve().name, sock, per_request,
                     warmup=not args.no_warmup, shutdown_timeout=args.shutdown_timeout,
                     allowed_origins=args.allowed_origins, generation_config=args.generation_config)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "serve":
            return _serve(args)
    except SpecjaxError as e:  # bad input, whichever part of specjax found it
        parser.exit(2, f"specjax: error: {e}\n")
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
