"""Causal-LM training loop shared by ``train.target`` and ``train.draft``.

Next-token cross-entropy on random windows of a token shard (:mod:`train.data`; with
``--reply-weight R --rename-weight W`` the tokens of rename replies count R times in the
training loss, and those that write the new name W times: :func:`train.data.token_marks`), optax AdamW (b2 0.95, weight decay 0.1 on matrices
only) after global-norm clipping 1.0, with a warmup + cosine schedule down to 10 % of the
peak. One jitted step donates params and optimizer state.

Resume: an orbax ``CheckpointManager`` (last 2 kept, indexed by step) under
``<ckpt-dir>/orbax`` holds params, optimizer state and a JSON record (best held-out loss,
model config), saved every ``--save-every-minutes``, on Ctrl-C or ``kill`` (SIGTERM) and
at the end; a restarted run continues from the latest one, so ``kill -9`` loses at most
one interval. The batch of step ``s`` is drawn from ``np.random.default_rng((seed, s))``:
the step number is the whole data RNG state, and a resumed run sees exactly the batches
an uninterrupted one would.

Held-out loss on fixed windows is evaluated every ``--eval-every`` steps and appended to
``<ckpt-dir>/metrics.jsonl``; whenever it improves, the model is exported (bf16, HF
layout, with tokenizer files and ``generation_config.json``) to ``--export``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from tqdm import tqdm

from specjax import checkpoint, qwen3
from specjax.checkpoint import CheckpointError
from specjax.config import Qwen3Config
from specjax.model import remove_tokenizer
from specjax.errors import SpecjaxError
from specjax.runtime import enable_compilation_cache
from train.data import MARKS_FILE, PLAIN, RENAMED, REPLY, load_shard, random_batches

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping settings (the model's are a :class:`Qwen3Config`)."""

    steps: int = 4000
    batch: int = 8
    seq: int = 512
    lr: float = 1e-3
    warmup: int = 200
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 200
    eval_batches: int = 16
    save_every_minutes: float = 5.0
    seed: int = 0
    reply_weight: float = 1.0   # loss weight of rename replies' copied tokens (train.data.REPLY)
    rename_weight: float = 1.0  # and of their new-name tokens (train.data.RENAMED)

    def resume_key(self) -> dict[str, Any]:
        """The settings a resumed run must share with its checkpoint's (recorded with it): all
        but the bookkeeping ones, so that it goes on as an uninterrupted run would (steps
        too: the learning-rate schedule spans them)."""
        d = dataclasses.asdict(self)
        for name in ("eval_every", "eval_batches", "save_every_minutes"):
            d.pop(name)
        return d

    def check_flags(self) -> None:
        """FlagError naming the flag of a value out of range (:func:`config_from_args`)."""
        check_ranges(self, positive=("lr", "clip"),
                     non_negative=("warmup", "weight_decay", "save_every_minutes", "reply_weight", "rename_weight",
                                   "seed"))
        if self.warmup >= self.steps:  # optax's cosine decay needs a step after the warmup
            raise FlagError(f"--warmup {self.warmup} must be less than --steps {self.steps} "
                            "(the cosine decay needs a step after the warmup)")


@functools.cache
def make_optimizer(tc: Any) -> optax.GradientTransformation:
    """Clip, then AdamW with warmup-cosine schedule; no decay on norm weights and biases.

    `tc` is any frozen config with steps, lr, warmup, weight_decay and clip (TrainConfig,
    train.dflash.DFlashTrainConfig)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.steps, end_value=tc.lr * 0.1)

    def decay_mask(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not str(path[-1].key).endswith(("norm.weight", ".bias")), params)

    return optax.chain(
        optax.clip_by_global_norm(tc.clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask),
    )


@functools.partial(jax.jit, static_argnums=1)
def loss_fn(params: Any, cfg: Qwen3Config, windows: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Next-token cross-entropy (nats) of windows [B, T+1]: the mean, or the mean weighted
    by ``weights`` [B, T+1] (aligned with ``windows``; a target's weight is at its place)."""
    tokens, targets = windows[:, :-1], windows[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    # Layers unrolled (the inference layout's loop, not lax.scan): under scan XLA:CPU
    # copies each layer's saved activations into and out of stacked buffers.
    logits, _, _ = qwen3.forward(checkpoint.unstack(params), cfg, tokens, positions)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if weights is None:
        return ce.mean()
    # (all-zero weights, e.g. --reply-weight 0 on a window inside a reply: no loss, not NaN)
    return (ce * weights[:, 1:]).sum() / jnp.maximum(weights[:, 1:].sum(), 1e-6)


@functools.cache
def make_train_step(cfg: Qwen3Config, tc: TrainConfig) -> Callable:
    """Jitted ``(params, opt_state, (windows, weights)) -> (params, opt_state, loss)``
    (weights None or [B, T+1], :func:`batch_at`); donates state. Cached per (cfg, tc), so
    a resumed run in the same process does not recompile."""
    optimizer = make_optimizer(tc)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, cfg, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def eval_windows(tokens: np.ndarray, tc: TrainConfig) -> np.ndarray:
    """Fixed held-out windows [n, B, T+1]: non-overlapping, evenly spaced over the shard."""
    chunks = np.asarray(tokens[: tokens.size // (tc.seq + 1) * (tc.seq + 1)], np.int32).reshape(-1, tc.seq + 1)
    n = min(tc.eval_batches, len(chunks) // tc.batch)
    if n == 0:
        raise FlagError(f"--batch {tc.batch} x --seq {tc.seq}: the held-out shard of {tokens.size} tokens has no "
                        f"batch of {tc.batch} windows of {tc.seq + 1} tokens; lower --seq or --batch")
    pick = np.linspace(0, len(chunks) - 1, n * tc.batch).astype(int)
    return chunks[pick].reshape(n, tc.batch, tc.seq + 1)


def check_train_shard(tokens: np.ndarray, tc: TrainConfig) -> None:
    """A training shard must hold a window of --seq + 1 tokens (batches are random ones)."""
    if tokens.size <= tc.seq:
        raise FlagError(f"--seq {tc.seq}: the training shard has {tokens.size} tokens, no window of {tc.seq + 1}; "
                        "lower --seq or build a larger shard")


@functools.partial(jax.jit, static_argnums=(0, 1))
def initial_state(cfg: Qwen3Config, tc: TrainConfig) -> dict:
    """Fresh {"params", "opt_state"} (one compiled program, cached per config)."""
    params = checkpoint.init_params(cfg, jax.random.key(tc.seed))
    return {"params": params, "opt_state": make_optimizer(tc).init(params)}


def state_from_folder(folder: Path, cfg: Qwen3Config, tc: TrainConfig) -> dict:
    """{"params", "opt_state"} starting from a saved model (float32, training layout)."""
    saved = Qwen3Config.from_file(folder / "config.json")
    have, want = saved.to_hf(), cfg.to_hf()
    differ = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
    if differ:
        fields = ", ".join(f"{k} {have.get(k)!r} (the run's: {want.get(k)!r})" for k in differ)
        hint = (f"; the run's max_position_embeddings is --seq, so pass --seq {saved.max_position_embeddings}"
                if "max_position_embeddings" in differ else "")
        raise FlagError(f"{folder / 'config.json'}: the --init model differs from the --config model in {fields}"
                        f"{hint}")
    params = checkpoint.stack(checkpoint.load_params(folder, cfg, jnp.float32))
    print(f"initialised from {folder}")
    return {"params": params, "opt_state": make_optimizer(tc).init(params)}


def batch_at(tokens: np.ndarray, tc: TrainConfig, step: int,
             marks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The training batch of ``step`` (a pure function of seed and step): windows, and
    their loss weights when the shard's ``marks`` are given (1 on ``PLAIN`` tokens,
    ``tc.reply_weight`` on ``REPLY``, ``tc.rename_weight`` on ``RENAMED``)."""
    windows, window_marks = random_batches(tokens, tc.batch, tc.seq, np.random.default_rng((tc.seed, step)), marks)
    if window_marks is None:
        return windows, None
    table = np.zeros(3, np.float32)
    table[[PLAIN, REPLY, RENAMED]] = 1.0, tc.reply_weight, tc.rename_weight
    return windows, table[window_marks]


class Checkpoints:
    """Orbax manager (last 2 kept) of {params, opt_state} plus a JSON record, by step."""

    def __init__(self, directory: Path):
        options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(Path(directory).resolve() / "orbax", options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, record: dict) -> None:
        if self.manager.latest_step() != step:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)))

    def record(self) -> dict:
        """The latest checkpoint's JSON record alone (read before the state, whose shape it may decide)."""
        return self._restore(record=ocp.args.JsonRestore()).record

    def restore(self, abstract_state: dict) -> tuple[dict, dict]:
        out = self._restore(state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore())
        return out.state, out.record

    def _restore(self, **items: Any) -> Any:
        """The latest step's `items`; a step folder that lacks one (a save cut off, files
        removed) is a CheckpointError naming it."""
        step = self.manager.latest_step()
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except KeyError as e:
            raise CheckpointError(f"{self.manager.directory / str(step)}: the checkpoint of step {step} lacks {e}; "
                                  "remove that step's folder to resume from the one before") from None

    def close(self) -> None:
        self.manager.close()


def export(out: Path, params: Any, cfg: Qwen3Config, tokenizer_dir: Path | None) -> None:
    """A complete HF model folder: config, bf16 weights, tokenizer, generation config."""
    checkpoint.save(out, params, cfg, dtype="bfloat16")
    if tokenizer_dir and Path(tokenizer_dir).resolve() != Path(out).resolve():
        remove_tokenizer(Path(out))  # another model's files (a chat template, added tokens) would take effect
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        src = Path(tokenizer_dir) / name
        if src.is_file() and src.resolve() != (Path(out) / name).resolve():
            shutil.copyfile(src, Path(out) / name)
    generation = {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.eos_token_id}
    (Path(out) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def train(cfg: Qwen3Config, tc: TrainConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray,
          ckpt_dir: Path, export_dir: Path | None = None, tokenizer_dir: Path | None = None,
          heldout_bytes_per_token: float | None = None, init: Path | None = None,
          train_marks: np.ndarray | None = None) -> dict:
    """Train (or resume) until ``tc.steps``; returns the final {"params", "opt_state", "step"}.

    A fresh run starts from random weights, or from the HF folder `init` (fine-tuning:
    a new optimiser state and schedule; the folder's config must be `cfg`'s model).
    With ``train_marks`` (the shard's token marks) the training loss weighs rename replies
    by ``tc.reply_weight`` and ``tc.rename_weight``; held-out loss stays the plain mean.

    Saves a checkpoint every ``tc.save_every_minutes`` (0: every step), on Ctrl-C and at
    the end; any other exception propagates without a final save (like a crash)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    train_step = make_train_step(cfg, tc)
    check_train_shard(train_tokens, tc)
    heldout = eval_windows(heldout_tokens, tc)
    model_record = cfg.to_hf()

    ckpts = Checkpoints(ckpt_dir)
    step = ckpts.latest_step() or 0
    record = {"best_heldout_loss": None, "model": model_record, "train": tc.resume_key()}
    if step == 0:
        state = initial_state(cfg, tc) if init is None else state_from_folder(Path(init), cfg, tc)
    else:
        check_resume(ckpt_dir, step, ckpts.record(), record, "model", "--ckpt-dir", init)
        state, record = ckpts.restore(jax.eval_shape(initial_state, cfg, tc))
        print(f"resumed from {ckpt_dir} at step {step}")
    params, opt_state = state["params"], state["opt_state"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tokens_per_step = tc.batch * tc.seq
    print(f"{n_params / 1e6:.2f}M parameters; {tc.steps} steps of {tokens_per_step} tokens")

    def save(step: int) -> None:
        ckpts.save(step, {"params": params, "opt_state": opt_state}, record)

    def evaluate(step: int) -> None:
        loss = float(np.mean([loss_fn(params, cfg, w) for w in heldout]))
        row = {"step": step, "tokens": step * tokens_per_step, "heldout_loss": loss, "time": time.time()}
        if heldout_bytes_per_token:
            row["heldout_bits_per_byte"] = loss / math.log(2) / heldout_bytes_per_token
        if record["best_heldout_loss"] is None or loss < record["best_heldout_loss"]:
            record["best_heldout_loss"] = loss
            if export_dir:
                export(export_dir, params, cfg, tokenizer_dir)
                row["exported"] = str(export_dir)
        append_metrics(ckpt_dir, row)
        tqdm.write(f"step {step}: held-out loss {loss:.4f}" + (" (exported)" if "exported" in row else ""))

    def advance(step: int) -> dict:
        nonlocal params, opt_state
        params, opt_state, loss = train_step(params, opt_state, batch_at(train_tokens, tc, step, train_marks))
        return {"loss": loss}

    try:
        step = run_steps(tc, step, advance, evaluate, save, tokens_per_step)
    finally:
        ckpts.close()
    return {"params": params, "opt_state": opt_state, "step": step}


def check_resume(run_dir: Path, step: int, saved: dict, asked: dict, model: str, fresh: str,
                 init: Path | None = None) -> None:
    """Refuse (FlagError) to resume the checkpoint record `saved` at `step` with the model
    config (`saved[model]`) or training settings (`saved["train"]`) of `asked` where they
    differ, naming the fields and flags (a mix would train on silently), and with `init`,
    which starts a fresh run and would be ignored. `fresh`: the flag of a fresh run folder.
    Records of runs from before the settings were kept lack "train"; their settings pass."""
    if init is not None:
        raise FlagError(f"--init {init}: {run_dir} holds a run at step {step}, which resumes; --init starts a "
                        f"fresh run: drop it, or use a fresh {fresh} folder")
    if model not in saved:
        raise FlagError(f"{run_dir}: holds checkpoints of another kind of run (no {model} config); use a fresh "
                        f"{fresh} folder")
    fields = differences(saved[model], asked[model])
    if fields:
        raise FlagError(f"{run_dir}: checkpoint is of another {model} config ({fields}); resume with the same "
                        f"flags or use a fresh {fresh} folder")
    before = saved.get("train", asked["train"])
    changed = [k for k in asked["train"] if before.get(k) != asked["train"][k]]
    if changed:
        flags = ", ".join(f"{flag_name(k)} {before.get(k)} -> {asked['train'][k]}" for k in changed)
        raise FlagError(f"{run_dir}: checkpoint was trained with other settings ({flags}); resume with the same "
                        f"flags or use a fresh {fresh} folder")


def differences(before: dict, after: dict, skip: Sequence[str] = ()) -> str:
    """The fields of two config dicts that differ, as "name old -> new, ..." ("" if none)."""
    return ", ".join(f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in sorted({*before, *after})
                     if k not in skip and before.get(k) != after.get(k))


def append_metrics(directory: Path, row: dict) -> None:
    """Append one JSON row to ``<directory>/metrics.jsonl``."""
    with open(Path(directory) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def run_steps(tc: Any, step: int, advance: Callable[[int], dict], evaluate: Callable[[int], None],
              save: Callable[[int], None], tokens_per_step: int, show: bool = True,
              evaluate_first: bool = False) -> int:
    """Drive a training loop from ``step`` to ``tc.steps``; returns the last step done.

    ``advance(s)`` runs step s and returns its metrics ({"loss": ...} at least, shown on a
    tqdm bar over tokens); ``evaluate(s)`` runs every ``tc.eval_every`` steps, at the end,
    and first of all with ``evaluate_first``; ``save(s)`` every ``tc.save_every_minutes``
    (0: every step) and at the end. Ctrl-C or SIGTERM stops the loop after the step it
    arrived in, which is saved first (:func:`stop_requests`; a second one stops at once,
    unsaved). A non-finite loss raises without saving. In a multi-process run every
    process saves together (orbax's saves are collective), when process 0's clock says so,
    and a stop asked of any process stops all after the same step. `show`: the bar.
    """
    bar = tqdm(total=tc.steps * tokens_per_step, initial=step * tokens_per_step, unit="tok",
               unit_scale=True, mininterval=1 if sys.stderr.isatty() else 60, disable=not show)
    first, last_save = step, time.monotonic()
    with stop_requests() as asked:
        try:
            if evaluate_first:
                evaluate(step)
            stop = _agree(False, bool(asked))[1]
            while step < tc.steps and not stop:
                metrics = {k: float(v) for k, v in advance(step).items()}
                step += 1
                if not math.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"training loss is {metrics['loss']} at step {step}")
                bar.update(tokens_per_step)
                bar.set_postfix(step=step, **{k: f"{v:.3f}" for k, v in metrics.items()}, refresh=False)
                if step % tc.eval_every == 0 or step == tc.steps:
                    evaluate(step)
                due, stop = _agree(time.monotonic() - last_save >= tc.save_every_minutes * 60, bool(asked))
                if due and not stop:
                    save(step)
                    last_save = time.monotonic()
            if stop and step == first:
                tqdm.write(f"interrupted at step {step}, before any step: nothing new to save")
            else:
                if stop:
                    tqdm.write(f"interrupted: saving step {step}")
                save(step)
        finally:
            bar.close()
    return step


@contextlib.contextmanager
def stop_requests() -> Iterator[list[int]]:
    """Within: Ctrl-C and SIGTERM append their signal number to the yielded list instead
    of raising, for a training loop to stop at its next step boundary. A jitted step
    donates the params and optimizer state it is given, so an exception raised inside one
    leaves arrays consumed and not yet replaced, and one raised between the step and the
    loop's count of it would save the new state under the old step. A second signal raises
    KeyboardInterrupt at once (stop without saving). Outside the main thread, where Python
    cannot install handlers, signals keep their handlers."""
    asked: list[int] = []

    def request(signum: int, frame: Any) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)
        tqdm.write(f"{signal.Signals(signum).name}: stopping when the current step ends, saving it first "
                   "(again to stop at once, unsaved)")

    if threading.current_thread() is not threading.main_thread():
        yield asked
        return
    before = {s: signal.signal(s, request) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield asked
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _agree(due: bool, stop: bool) -> tuple[bool, bool]:
    """(save now, stop now) for every process alike: process 0's `due` (its clock), and
    `stop` where any process was asked to stop. One process: as given."""
    if jax.process_count() == 1:
        return due, stop
    flags = np.asarray(multihost_utils.process_allgather(np.array([due, stop])))
    return bool(flags[0, 0]), bool(flags[:, 1].any())


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# config fields that count something and must be at least 1 (0 steps would fail deep in
# optax's schedule; 0 in the others divides by zero, never evaluates or generates nothing)
COUNT_FIELDS = frozenset({"steps", "batch", "seq", "accum", "anchors", "log_every", "eval_every", "eval_batches",
                          "eval_tokens", "prompts", "prompt_len", "response_len", "gen_batch", "shard_size"})


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, got {text}")
    return value


class FlagError(SpecjaxError):
    """A training flag's value out of its range; the message names the flag."""


def flag_name(field: str) -> str:
    """The command-line flag of a config field: ``--flag-name``."""
    return "--" + field.replace("_", "-")


def check_ranges(config: Any, positive: Sequence[str] = (), non_negative: Sequence[str] = (),
                 fractions: Sequence[str] = ()) -> None:
    """FlagError naming the first flag of `config` (a flag dataclass) out of range: every
    float field must be finite (argparse's float() reads "nan" and "inf"), `positive` ones
    > 0, `non_negative` ones >= 0 and `fractions` in [0, 1]."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise FlagError(f"{flag_name(f.name)} must be a finite number, got {value}")
    for names, ok, bound in ((positive, lambda v: v > 0, "> 0"), (non_negative, lambda v: v >= 0, ">= 0"),
                             (fractions, lambda v: 0 <= v <= 1, "in [0, 1]")):
        for name in names:
            if not ok(getattr(config, name)):
                raise FlagError(f"{flag_name(name)} must be {bound}, got {getattr(config, name)}")


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag-name`` per field of the dataclass ``cls`` (bool fields: store_true;
    COUNT_FIELDS: at least 1)."""
    d = cls()
    for f in dataclasses.fields(cls):
        default = getattr(d, f.name)
        flag = flag_name(f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=default)
        else:
            kind = positive_int if f.name in COUNT_FIELDS else type(default)
            parser.add_argument(flag, type=kind, default=default)


def config_from_args(args: argparse.Namespace, cls: type, parser: argparse.ArgumentParser | None = None) -> Any:
    """The ``cls`` instance of the flags added by :func:`add_config_flags` (a flag left None,
    e.g. by ``parser.set_defaults``, takes the field's default), checked by its
    ``check_flags()``: a value out of range is ``parser.error`` naming the flag (a FlagError
    without `parser`). Call it before any costly work."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    config = cls(**{name: value for name, value in given.items() if value is not None})
    try:
        config.check_flags()
    except FlagError as e:
        if parser is None:
            raise
        parser.error(str(e))
    return config


def main(presets: dict[str, Qwen3Config], default: str, argv: Sequence[str] | None, prog: str,
         description: str) -> None:
    """CLI shared by ``train.target`` and ``train.draft``: flags mirror :class:`TrainConfig`."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", choices=sorted(presets), default=default, help="model preset")
    p.add_argument("--data", type=Path, default=Path("runs/data"), help="shard dir (python -m train.tokenizer --shards)")
    p.add_argument("--tokenizer", type=Path, default=Path("checkpoints/tiny-code"), help="tokenizer dir copied into exports")
    p.add_argument("--ckpt-dir", type=Path, help="orbax checkpoints and metrics.jsonl (default runs/<config>)")
    p.add_argument("--export", type=Path, help="HF model folder written whenever held-out loss improves")
    p.add_argument("--init", type=Path, help="start a fresh run from this HF model folder (fine-tuning)")
    add_config_flags(p, TrainConfig)
    args = p.parse_args(argv)
    tc = config_from_args(args, TrainConfig, p)  # bad values refused before any data is read
    enable_compilation_cache()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` saves like Ctrl-C
    meta = json.loads((args.data / "meta.json").read_text())
    marks = None
    if (tc.reply_weight, tc.rename_weight) != (1.0, 1.0):
        if not (args.data / MARKS_FILE).is_file():
            p.error(f"--reply-weight / --rename-weight need {args.data / MARKS_FILE}: "
                    "rebuild the shards with python -m train.data")
        marks = load_shard(args.data / MARKS_FILE)
    train_tokens = load_shard(args.data / "train.npy")
    if marks is not None and marks.shape != train_tokens.shape:
        p.error(f"{args.data / MARKS_FILE} has {marks.size} marks for {train_tokens.size} tokens of "
                f"{args.data / 'train.npy'}: rebuild the shards with python -m train.data")
    cfg = dataclasses.replace(presets[args.config], max_position_embeddings=tc.seq, eos_token_id=meta["eos_id"])
    done = train(cfg, tc, train_tokens, load_shard(args.data / "heldout.npy"),
                 args.ckpt_dir or Path("runs") / args.config, args.export, args.tokenizer,
                 meta["heldout"]["bytes"] / meta["heldout"]["tokens"], args.init, marks)
    if done["step"] < tc.steps:  # stopped by Ctrl-C / SIGTERM, saved: exit 130, as a shell reports Ctrl-C
        sys.exit(130)
