"""Train a DFlash drafter for a Qwen3 target: ``python -m train.dflash --target DIR --out DIR``.

The DFlash paper's recipe (arXiv:2602.06036), sized by flags:

1. Data (:mod:`train.dflash_data`): the target's replies to the user's prompts
   (``--prompt-file FILE`` / ``--prompt-dir DIR``, :mod:`train.prompts`: deduplicated,
   a ``--heldout-share`` of them held out) or to training-corpus prompts (``--shards``),
   generated once by the batched engine into ``--data`` (resumable token shards).
2. Each step takes ``batch`` sequences and computes the frozen target's residual stream
   at ``target_layer_ids`` online (``qwen3.hidden_states``; no feature cache). Per
   sequence ``anchors`` random reply positions a each start a block [token a, mask x
   (B-1)] at positions a .. a+B-1 that sees the context strictly before a and its own
   block only (``dflash.block_logits``: one packed pass per sequence). Block row k
   predicts token a+k; cross-entropy weighted exp(-(k-1)/gamma), normalised by the
   weight sum; embedding and head are the target's and stay frozen. AdamW with warmup +
   cosine and clipping 1.0 (``train.lm.make_optimizer``). With ``--markov-rank R`` a
   Markov head of rank R (:func:`specjax.dflash.markov_bias`) trains beside the drafter
   on the block logits with their gradient stopped, teacher-forced, under an optimizer
   of its own: the drafter's weights are those of the same run without it. With
   ``--accum K`` a step is K micro-batches of ``batch`` sequences (the gradient of all
   of them), and each micro-batch is split over ``--devices`` local devices (:func:`data_mesh`); with
   ``--tp K`` the frozen target is split tensor-parallel over groups of K of them
   (:mod:`specjax.sharding`) and the batch over the devices / K groups. The
   forward runs in bfloat16 on accelerators and float32 on CPU (``--precision``,
   :func:`compute_dtype`); weights, gradients and AdamW state are float32 always. The
   progress bar shows loss, train tau, tokens/s and the time left.
3. Every ``eval_every`` steps (and at step 0) real DFlash speculative generation on
   held-out prompts (the user's, or edit and completion prompts of
   :mod:`specjax.workloads`) measures tau (mean
   accepted drafts + 1 per verify step) and acceptance by draft position, appended to
   ``<run>/metrics.jsonl``; whenever tau improves the drafter is exported to ``--out``
   in the public format (``specjax.load_dflash`` reads it).

The mask token: the tokenizer's own, else the id right after every token it has (special
and added ones included) as a new ``<|MASK|>``, which must be one of the embedding's spare
rows (z-lab's Qwen3 drafters: 151669); ``--mask-token-id`` overrides. The drafter's
config.json records it (``dflash_config.mask_token_id``).

Many hosts: ``--coordinator HOST:PORT --num-processes N --process-id I`` on every host
(:func:`init_distributed`, i.e. ``jax.distributed.initialize``) makes the mesh span every
process's devices; each process feeds its rows of each global batch, process 0 alone
generates the training data (sent to the others, :func:`share_data`), evaluates, exports,
writes metrics.jsonl and shows the bar; ``--run`` must be a folder every host sees (orbax
writes one checkpoint from all of them). ``--data-only`` makes the data and stops (a long
generation is best done so beforehand: the other processes would wait for it in a collective).

Resume: orbax checkpoints in ``<run>/orbax`` (``train.lm.Checkpoints``), saved every
``save_every_minutes``, on Ctrl-C / ``kill`` and at the end; the batch of step s is a
pure function of (seed, s), so a resumed run continues exactly as an uninterrupted one.
A checkpoint records its drafter config and training settings (:func:`train.lm.check_resume`):
resuming it with other flags (bookkeeping ones aside) is refused, naming them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import specjax
from specjax import checkpoint, cpu_kernels, dflash, qwen3, sharding
from specjax.checkpoint import Params
from specjax.config import Qwen3Config
from specjax.dflash import DFlashConfig
from specjax.errors import PromptError
from specjax.results import Stats
from specjax.workloads import completion_prompts, edit_prompts
from train import lm, prompts
from train.data import load_shard
from train.dflash_data import DataConfig, Sequences, generate_data

GAMMAS = {8: 4.0, 10: 5.0, 16: 7.0}  # loss decay per block size (the DFlash paper, arXiv:2602.06036)


def default_gamma(block_size: int) -> float:
    """The paper's gamma for `block_size`: linear between its three values, clamped outside."""
    sizes = sorted(GAMMAS)
    return float(np.interp(block_size, sizes, [GAMMAS[b] for b in sizes]))


@dataclasses.dataclass(frozen=True)
class DFlashTrainConfig:
    """Optimisation and bookkeeping settings (flags of ``python -m train.dflash``)."""

    steps: int = 2000
    batch: int = 8             # sequences per micro-batch (split over the devices)
    accum: int = 1             # micro-batches per step: a step's gradient is that of batch * accum sequences
    anchors: int = 16          # blocks per sequence
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float = 0.0         # 0: default_gamma(block_size)
    log_every: int = 20        # training loss rows in metrics.jsonl
    markov_rank: int = 0       # a Markov head of this rank trained beside the drafter (0: none)
    eval_every: int = 200
    eval_tokens: int = 96      # new tokens per evaluation prompt
    save_every_minutes: float = 5.0
    seed: int = 0

    def resume_key(self) -> dict[str, Any]:
        """The settings a resumed run must share with the checkpoint's (recorded with it): all
        but the bookkeeping ones, so that it continues exactly as an uninterrupted run would
        (steps too: the learning-rate schedule spans them)."""
        d = dataclasses.asdict(self)
        for name in ("log_every", "eval_every", "eval_tokens", "save_every_minutes"):
            d.pop(name)
        return d

    def check_flags(self) -> None:
        """FlagError naming the flag of a value out of range (``lm.config_from_args``); --gamma 0
        is the default gamma. (Programmatic configs are not checked: a test may train at lr 0.)"""
        lm.check_ranges(self, positive=("lr", "clip"), fractions=("warmup_ratio",),
                        non_negative=("weight_decay", "gamma", "markov_rank", "save_every_minutes", "seed"))

    @property
    def warmup(self) -> int:
        """Warmup steps: at least one, but fewer than `steps` (the cosine decay needs a step
        after the warmup; a one-step run has no warmup)."""
        return min(max(1, round(self.warmup_ratio * self.steps)), self.steps - 1)


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """The drafter's shape, the evaluation prompts and the devices: the flags of ``python -m
    train.dflash`` outside DFlashTrainConfig and DataConfig (declared in :func:`main` with
    their help; a flag not given is None, its field's default here), checked with them by
    ``lm.config_from_args`` before the target is loaded."""

    layers: int = 2
    block_size: int = 16
    eval_prompts: int = 4       # corpus mode: held-out prompts per workload
    eval_prompt_len: int = 300  # corpus mode
    devices: int | None = None  # default: all
    tp: int = 1
    mask_token_id: int | None = None
    heldout_share: float = 0.05  # the user's prompts

    def check_flags(self) -> None:
        """FlagError naming the flag of a value out of range: counts of at least 1 (no eval
        prompts would never export the drafter), a block of the anchor and at least one
        draft, a mask id that is a token id, a held-out share strictly between 0 and 1."""
        lm.check_ranges(self, positive=("layers", "eval_prompts", "eval_prompt_len", "tp"),
                        non_negative=() if self.mask_token_id is None else ("mask_token_id",))
        if self.devices is not None and self.devices < 1:
            raise lm.FlagError(f"--devices must be > 0, got {self.devices}")
        if self.block_size < 2:
            raise lm.FlagError(f"--block-size must be >= 2 (the anchor and at least one draft), got {self.block_size}")
        if not 0 < self.heldout_share < 1:
            raise lm.FlagError(f"--heldout-share must be in (0, 1), got {self.heldout_share}")


# ------------------------------------------------------------------------------ loss

def block_tokens(tokens: jax.Array, anchors: jax.Array, block_size: int, mask_id: int) -> jax.Array:
    """Block inputs [N, B]: the anchor's token, then mask tokens (tokens [S], anchors [N])."""
    ids = jnp.full((anchors.shape[0], block_size), mask_id, jnp.int32)
    return ids.at[:, 0].set(tokens[anchors])


def block_targets(tokens: jax.Array, anchors: jax.Array, valid: jax.Array, length: jax.Array,
                  block_size: int, gamma: float) -> tuple[jax.Array, jax.Array]:
    """Labels and loss weights [N, B-1] of block rows k = 1 .. B-1: the token at anchor + k,
    weighted exp(-(k-1)/gamma) if that position is before `length` and the block is valid."""
    k = jnp.arange(1, block_size)
    pos = anchors[:, None] + k  # [N, B-1]
    labels = tokens[jnp.minimum(pos, tokens.shape[0] - 1)]
    weights = jnp.exp(-(k - 1) / gamma) * ((pos < length) & valid[:, None])
    return labels, weights


def loss_fn(params: Params, cfg: DFlashConfig, target_params: Params, target_cfg: Qwen3Config, gamma: float,
            batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(weighted cross-entropy, train tau) of a batch: tokens [Bt, S], lengths [Bt],
    anchors and valid [Bt, N]. Train tau is 1 + the mean leading run of right argmax
    predictions per valid block (what greedy verification would accept)."""
    return loss_and_tau(loss_sums(params, cfg, target_params, target_cfg, gamma, batch))


def loss_sums(params: Params, cfg: DFlashConfig, target_params: Params, target_cfg: Qwen3Config, gamma: float,
              batch: dict[str, jax.Array]) -> jax.Array:
    """block_sums() of a batch (as loss_fn): sums add over micro-batches and devices.

    With a Markov head (params[dflash.MARKOV]) two more: its weighted cross-entropy and
    leading right predictions, of the block logits plus its bias from each row's previous
    token (teacher-forced: the true token before the row's label), over the block logits
    with their gradient stopped. The head learns to correct the block pass and the
    layers train exactly as without it, so the drafter without its head is as good as one
    trained alone."""
    tokens, anchors, valid = batch["tokens"], batch["anchors"], batch["valid"]
    bt, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), tokens.shape)
    _, _, taps = qwen3.hidden_states(target_params, target_cfg, tokens, positions, taps=cfg.target_layer_ids)
    features = jax.lax.stop_gradient(taps.transpose(1, 2, 0, 3).reshape(bt, s, -1))  # [Bt, S, n*D]
    ids = jax.vmap(lambda t, a: block_tokens(t, a, cfg.block_size, cfg.mask_token_id))(tokens, anchors)
    logits = jax.vmap(lambda f, i, a: dflash.block_logits(params, cfg, target_params, target_cfg, f, i, a))(
        features, ids, anchors)  # [Bt, N, B-1, V]
    labels, weights = jax.vmap(lambda t, a, v, n: block_targets(t, a, v, n, cfg.block_size, gamma))(
        tokens, anchors, valid, batch["lengths"])
    sums = block_sums(logits, labels, weights, valid)
    if dflash.MARKOV not in params:
        return sums
    chained = jax.vmap(lambda lg, t, a: dflash.block_markov_logits(params[dflash.MARKOV], lg, t, a))(
        jax.lax.stop_gradient(logits), tokens, anchors)
    return jnp.concatenate([sums, block_sums(chained, labels, weights, valid)[jnp.array([0, 2])]])


def block_sums(logits: jax.Array, labels: jax.Array, weights: jax.Array, valid: jax.Array) -> jax.Array:
    """[4]: sum of weighted cross-entropies, sum of weights, sum of leading right argmax
    predictions per valid block, valid blocks; of block logits [..., N, B-1, V], labels
    and weights [..., N, B-1] and valid blocks [..., N]. The softmax is taken in float32
    whatever the logits' dtype (bf16 logits of a bf16 forward)."""
    logits = logits.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    right = (jnp.argmax(logits, axis=-1) == labels) & (weights > 0)
    run = jnp.cumprod(right, axis=-1).sum(axis=-1)  # [..., N] leading right predictions
    return jnp.stack([(weights * ce).sum(), weights.sum(), (run * valid).sum(), valid.sum()]).astype(jnp.float32)


def loss_and_tau(sums: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weighted cross-entropy, train tau) of block_sums()."""
    return sums[0] / jnp.maximum(sums[1], 1e-9), 1.0 + sums[2] / jnp.maximum(sums[3], 1)


def markov_loss_and_tau(sums: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weighted cross-entropy, train tau) with the Markov head, of loss_sums()' six sums."""
    return loss_and_tau(sums[jnp.array([4, 1, 5, 3])])


def block_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array, valid: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted cross-entropies / sum of weights, train tau) of block logits
    (block_sums' arguments)."""
    return loss_and_tau(block_sums(logits, labels, weights, valid))


PRECISIONS = ("auto", "float32", "bfloat16")


def compute_dtype(precision: str, platform: str) -> np.dtype:
    """The dtype of the training forward for ``--precision`` on devices of `platform`
    ("cpu", "gpu", "tpu", ...): "auto" is bfloat16 on accelerators, whose matrix units
    run it several times faster than float32, and float32 on CPU, where bf16 buys no
    speed. Master weights and optimizer state are float32 either way."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        precision = "float32" if platform == "cpu" else "bfloat16"
    return jnp.dtype(precision)


def cast_floats(tree: Any, dtype: Any) -> Any:
    """`tree` with its floating-point leaves in `dtype` (integer leaves as they are)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def make_optimizer(tc: DFlashTrainConfig) -> optax.GradientTransformation:
    """`train.lm.make_optimizer`; with a Markov head one for the drafter and one for the
    head (same settings), so the head's gradient never scales the drafter's step through
    the global-norm clip: the drafter trains as it would without the head."""
    if not tc.markov_rank:
        return lm.make_optimizer(tc)

    def labels(params: Params) -> Params:
        return {k: jax.tree.map(lambda _, k=k: "markov" if k == dflash.MARKOV else "drafter", v)
                for k, v in params.items()}

    return optax.multi_transform({"drafter": lm.make_optimizer(tc), "markov": lm.make_optimizer(tc)}, labels)


@functools.cache
def make_train_step(cfg: DFlashConfig, target_cfg: Qwen3Config, tc: DFlashTrainConfig,
                    compute: np.dtype = np.dtype(np.float32)) -> Callable:
    """Jitted ``(params, opt_state, target_params, batch) -> (params, opt_state, sums)``
    over a batch of ``tc.accum`` micro-batches (leaves [accum, batch, ...], :func:`batch_at`);
    `sums` are `loss_sums`' over the whole batch (read by `loss_and_tau`, and with a Markov
    head by `markov_loss_and_tau`). Donates the drafter state; the target's params are only
    read.

    The forward runs in `compute` (:func:`compute_dtype`): the float32 master params are
    cast to it inside the differentiated function, so their gradients, the accumulated sums
    and the AdamW update stay float32; `target_params` are expected in `compute` already.

    Each micro-batch adds the gradient of its weighted cross-entropy sum; the total is
    divided by the weight of all of them, so a step is exactly one over the whole batch
    (up to float summation order), however it is split. Sharded over devices along the
    batch axis, XLA's partitioner inserts the reductions of these sums."""
    optimizer = make_optimizer(tc)
    gamma = tc.gamma or default_gamma(cfg.block_size)
    n_sums = 6 if tc.markov_rank else 4

    def weighted_ce(params, target_params, batch):  # (the sum to differentiate, loss_sums)
        sums = loss_sums(cast_floats(params, compute), cfg, target_params, target_cfg, gamma, batch)
        return sums[0] + (sums[4] if tc.markov_rank else 0.0), sums

    def micro(params, target_params, carry, batch):
        grads, sums = carry
        g, s = jax.grad(weighted_ce, has_aux=True)(params, target_params, batch)
        return (jax.tree.map(jnp.add, grads, g), sums + s), None

    def step(params, opt_state, target_params, batch):
        zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(n_sums, jnp.float32))
        (grads, sums), _ = jax.lax.scan(functools.partial(micro, params, target_params), zeros, batch)
        grads = jax.tree.map(lambda g: g / jnp.maximum(sums[1], 1e-9), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, sums

    return jax.jit(step, donate_argnums=(0, 1))


def initial_state(cfg: DFlashConfig, tc: DFlashTrainConfig) -> dict:
    """Fresh {"params", "opt_state"} of a drafter (float32 master weights), with a fresh
    Markov head when tc.markov_rank asks for one."""
    key = jax.random.key(tc.seed)
    params = dflash.init_params(cfg, key)
    if tc.markov_rank:
        params[dflash.MARKOV] = dflash.init_markov(cfg.vocab_size, tc.markov_rank, jax.random.fold_in(key, 1))
    return {"params": params, "opt_state": make_optimizer(tc).init(params)}


def state_from_drafter(folder: Path, cfg: DFlashConfig, tc: DFlashTrainConfig, target: specjax.Model) -> dict:
    """{"params", "opt_state"} starting from a saved drafter (e.g. to follow a retrained target,
    or at another block size); its Markov head where it has one of tc.markov_rank, a fresh one where it has none."""
    saved = dflash.load_dflash(folder, target, jnp.float32, markov=tc.markov_rank > 0)
    # no weight depends on the block size, so a drafter may continue at another one
    if dataclasses.replace(saved.config, block_size=cfg.block_size) != cfg:
        differ = lm.differences(saved.config.to_hf(), cfg.to_hf(), skip=("block_size",))
        raise lm.FlagError(f"--init {folder}: the drafter differs from the one asked for ({differ})")
    params = checkpoint.stack(saved.params, dflash.DRAFT_LAYERS)
    if tc.markov_rank:
        if dflash.MARKOV not in params:
            params[dflash.MARKOV] = initial_state(cfg, tc)["params"][dflash.MARKOV]
        elif params[dflash.MARKOV]["w1"].shape[1] != tc.markov_rank:
            raise lm.FlagError(f"--init {folder}: its Markov head has rank {params[dflash.MARKOV]['w1'].shape[1]}, "
                               f"--markov-rank asks for {tc.markov_rank}")
    if jax.process_index() == 0:
        print(f"initialised from {folder}")
    return {"params": params, "opt_state": make_optimizer(tc).init(params)}


def sample_anchors(lengths: np.ndarray, starts: np.ndarray, n: int, rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray]:
    """n distinct sorted reply positions per sequence (its reply from starts[i] to
    lengths[i]) with a real token after them: (anchors [Bt, n] int32, valid [Bt, n]);
    short replies pad with invalid blocks."""
    anchors = np.repeat(np.asarray(starts, np.int32)[:, None], n, axis=1)
    valid = np.zeros((len(lengths), n), bool)
    for i, (start, length) in enumerate(zip(starts, lengths)):
        candidates = np.arange(start, length - 1)
        pick = np.sort(rng.choice(candidates, min(n, candidates.size), replace=False))
        anchors[i, :pick.size] = pick
        valid[i, :pick.size] = True
    return anchors, valid


def batch_at(data: Sequences, tc: DFlashTrainConfig, step: int) -> dict[str, np.ndarray]:
    """The training batch of `step` (a pure function of seed, step, batch * accum and the
    data), leaves [accum, batch, ...]: the same sequences and anchors whichever way
    batch * accum is split."""
    rng = np.random.default_rng((tc.seed, step))
    n = tc.batch * tc.accum
    rows = rng.choice(len(data.tokens), n, replace=len(data.tokens) < n)
    anchors, valid = sample_anchors(data.lengths[rows], data.starts[rows], tc.anchors, rng)
    flat = {"tokens": data.tokens[rows], "lengths": data.lengths[rows], "anchors": anchors, "valid": valid}
    return {k: v.reshape(tc.accum, tc.batch, *v.shape[1:]) for k, v in flat.items()}


# ------------------------------------------------------------------------ evaluation

def acceptance(stats: Sequence[Stats]) -> dict[str, Any]:
    """Pooled over generations: tau (mean accepted + 1 per verify step) and P(draft i
    accepted | judged) by position."""
    steps = sum(s.steps for s in stats)
    width = max((len(s.reached) for s in stats), default=0)
    reached, accepted_at = np.zeros(width), np.zeros(width)
    for s in stats:
        reached[:len(s.reached)] += s.reached
        accepted_at[:len(s.accepted_at)] += s.accepted_at
    return {"tau": 1.0 + sum(s.accepted for s in stats) / max(steps, 1), "steps": steps,
            "acceptance_by_position": (accepted_at / np.maximum(reached, 1)).round(4).tolist()}


def evaluate_tau(target: specjax.Model, drafter: dflash.Drafter, prompts: Sequence[tuple[str, Sequence[int]]],
                 max_new_tokens: int) -> dict[str, Any]:
    """Greedy DFlash speculative generation on (kind, ids) prompts: acceptance() over all
    prompts, plus one per kind under "by_kind"."""
    runs: dict[str, list[Stats]] = {}
    proposer = specjax.DFlashProposer(drafter)
    for kind, ids in prompts:
        res = specjax.generate(target, ids, max_new_tokens=max_new_tokens, stop_ids=target.eos_ids,
                               speculative=proposer)
        runs.setdefault(kind, []).append(res.stats)
    out = acceptance([s for group in runs.values() for s in group])
    out["by_kind"] = {kind: acceptance(group) for kind, group in runs.items()}
    return out


def heldout_prompts(tokenizer: Any, n: int, prompt_len: int) -> list[tuple[str, list[int]]]:
    """n held-out edit and n completion prompts (specjax.workloads) as (kind, ids)."""
    made = edit_prompts(tokenizer, n, prompt_len) + completion_prompts(tokenizer, n, prompt_len)
    return [(p.kind, p.ids) for p in made]


# ---------------------------------------------------------------------------- loop

def train(target: specjax.Model, cfg: DFlashConfig, tc: DFlashTrainConfig, data: Sequences, run_dir: Path,
          out_dir: Path | None = None, eval_prompts: Sequence[tuple[str, Sequence[int]]] = (),
          init: Path | None = None, mesh: Mesh | None = None, compute: Any = jnp.float32) -> dict:
    """Train (or resume) a drafter until ``tc.steps``; returns {"params", "opt_state", "step"}.

    A fresh run starts from random weights, or from the drafter folder `init`. Over a
    `mesh` (:func:`data_mesh`; default one device) the drafter and its optimizer state are
    replicated and each micro-batch is split along its rows over the "data" axis (data
    parallel). The frozen target is replicated too (unpacked weights, which XLA partitions
    like any dot), or, where the mesh has a "tp" axis of more than one device, split
    tensor-parallel over it by :func:`specjax.sharding.shard_params` (replicated over
    "data"), for a target too large for one device; evaluation then runs on that placement.
    The loss is computed in `compute` (:func:`compute_dtype`; the target cast to it once),
    the params and optimizer state stay float32.

    metrics.jsonl gets a row of mean training loss and train tau every ``tc.log_every``
    steps, and with `eval_prompts` a row of evaluate_tau() at step 0 of a fresh run and
    every ``tc.eval_every`` steps (rows with "tau").
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dflash.check_fits(cfg, target.config, "train.dflash")
    compute = jnp.dtype(compute)
    train_step = make_train_step(cfg, target.config, tc, compute)
    lead = jax.process_index() == 0  # the one process that prints, evaluates and writes files
    ckpts = lm.Checkpoints(run_dir)
    step = ckpts.latest_step() or 0
    record = {"best_tau": None, "drafter": cfg.to_hf(), "train": tc.resume_key()}
    mesh = mesh or data_mesh(1)
    groups, tp = mesh.shape["data"], mesh.shape.get(sharding.AXIS, 1)
    if tc.batch % groups:
        raise dflash.DFlashError(f"--batch {tc.batch} is not a multiple of the {groups} data-parallel groups")
    if tp > 1 and jax.process_count() > 1:
        raise dflash.DFlashError("--tp: a tensor-parallel target runs in one process (its evaluation and "
                                 "loading are process 0's alone)")
    replicated, by_row = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "data"))
    fresh = functools.partial(initial_state, cfg, tc)
    if step == 0:
        state = state_from_drafter(init, cfg, tc, target) if init else jax.jit(fresh, out_shardings=replicated)()
    else:  # restored straight onto the mesh, replicated like a fresh state
        lm.check_resume(run_dir, step, ckpts.record(), record, "drafter", "--run", init)
        state, record = ckpts.restore(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), jax.eval_shape(fresh)))
        if lead:
            print(f"resumed from {run_dir} at step {step}")
    params, opt_state = global_put((state["params"], state["opt_state"]), replicated)
    target_params = target.params
    if tp > 1:  # split over "tp" (a no-op for weights loaded so); the eval runs on this placement
        target = dataclasses.replace(target, params=sharding.shard_params(target.params, mesh, sharding.AXIS))
        target_params = cast_floats(target.params, compute)
    elif mesh.size > 1 or compute != jnp.float32:  # plain arrays, which XLA partitions and casts
        target_params = cpu_kernels.unpack_tree(target_params)
        if compute != jnp.float32:
            target_params = cast_floats(target_params, compute)
        target_params = global_put(target_params, replicated)
    tokens_per_step = tc.batch * tc.accum * data.tokens.shape[1]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    if lead:
        print(f"drafter: {n_params / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers, block {cfg.block_size}; "
              f"{len(data.tokens)} sequences of {data.tokens.shape[1]}; {tc.steps} steps of {tokens_per_step} "
              f"tokens; {compute} compute; {mesh.size} devices ({groups} data x {tp} tp) in "
              f"{jax.process_count()} process(es)")
    window: list[list[float]] = []  # (loss, train tau[, Markov loss, Markov tau]) of the steps since the last log row
    names = ("train_loss", "train_tau") + (("markov_loss", "markov_tau") if tc.markov_rank else ())

    def advance(step: int) -> dict:
        nonlocal params, opt_state
        batch = global_put(batch_at(data, tc, step), by_row)
        params, opt_state, sums = train_step(params, opt_state, target_params, batch)
        sums = np.asarray(sums)
        row = [float(x) for x in loss_and_tau(sums) + (markov_loss_and_tau(sums) if tc.markov_rank else ())]
        window.append(row)
        if lead and ((step + 1) % tc.log_every == 0 or step + 1 == tc.steps):
            means = np.mean(window, axis=0)
            lm.append_metrics(run_dir, {"step": step + 1, "tokens": (step + 1) * tokens_per_step, "time": time.time(),
                                        **{n: float(v) for n, v in zip(names, means)}})
            window.clear()
        return dict(zip(("loss", "train_tau", "markov_loss", "markov_tau"), row))

    def evaluate(step: int) -> None:
        if not (lead and eval_prompts):
            return
        # the drafter where the target is: a local copy of it (replicated), or all of it on the --tp mesh
        local = params if tp > 1 else jax.tree.map(lambda x: x.addressable_shards[0].data, params)
        drafter = dflash.Drafter(local, cfg, jnp.float32)  # the target's
        row = {"step": step, "tokens": step * tokens_per_step, "time": time.time(),
               **evaluate_tau(target, drafter, eval_prompts, tc.eval_tokens)}
        if record["best_tau"] is None or row["tau"] > record["best_tau"]:
            record["best_tau"] = row["tau"]
            if out_dir:
                if (Path(out_dir) / dflash.VOCAB_FILE).is_file():  # the export describes this drafter, which has none
                    tqdm.write(f"{out_dir}: {dflash.VOCAB_FILE} removed by the export (a vocabulary of another "
                               "drafter); run python -m train.draft_vocab again once training ends")
                dflash.save_dflash(drafter, out_dir, dtype="bfloat16")  # the published format
                row["exported"] = str(out_dir)
        lm.append_metrics(run_dir, row)
        tqdm.write(f"step {step}: tau {row['tau']:.3f} " + " ".join(
            f"{k} {v['tau']:.3f}" for k, v in row["by_kind"].items()) + (" (exported)" if "exported" in row else ""))

    def save(step: int) -> None:
        ckpts.save(step, {"params": params, "opt_state": opt_state}, record)

    try:
        step = lm.run_steps(tc, step, advance, evaluate, save, tokens_per_step, show=lead, evaluate_first=step == 0)
    finally:
        ckpts.close()
    return {"params": params, "opt_state": opt_state, "step": step}


def data_mesh(devices: int | None = None, tp: int = 1) -> Mesh:
    """A ("data", "tp") mesh of shape (devices / tp, tp) over the first `devices` local
    devices (default: all): batches split over "data", the target over "tp" (``--tp``;
    consecutive devices form a group, the neighbours on a host's interconnect). In a
    multi-process run (:func:`init_distributed`) over every process's devices, which
    `devices` must then count if given."""
    if jax.process_count() > 1:
        if devices not in (None, jax.device_count()):
            raise dflash.DFlashError(f"--devices {devices}: a run of {jax.process_count()} processes uses all "
                                     f"{jax.device_count()} devices")
        chosen = jax.devices()
    else:
        local = jax.local_devices()
        devices = devices or len(local)
        if not 1 <= devices <= len(local):
            raise dflash.DFlashError(f"--devices {devices}: this process has {len(local)} local device(s)")
        chosen = local[:devices]
    if tp < 1 or len(chosen) % tp:
        raise dflash.DFlashError(f"--tp {tp}: does not divide the {len(chosen)} devices")
    return Mesh(np.array(chosen).reshape(-1, tp), ("data", sharding.AXIS))


def global_put(tree: Any, sharding: NamedSharding) -> Any:
    """`tree` (host or local arrays, the same value in every process) as global arrays of
    `sharding`: each process places only the slices its own devices hold, so this also
    serves a mesh across processes (where ``jax.device_put`` cannot reach other hosts'
    devices); a batch's rows land on the devices that own them."""
    def put(x: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree.map(put, tree)


def init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """``jax.distributed.initialize`` for a run over several processes (one per host):
    `coordinator` is process 0's HOST:PORT, reachable from every host. Must come before
    anything touches a device. Without all three, JAX's cluster auto-detection fills the
    rest (Cloud TPU, SLURM, ...). On CPU the collectives are gloo's (JAX's default)."""
    jax.distributed.initialize(coordinator, num_processes, process_id)


def share_data(data: Sequences | None) -> Sequences:
    """Process 0's `data` in every process (the others pass None): a broadcast over the
    processes' devices, so no host needs the data folder but process 0's."""
    lead = jax.process_index() == 0
    shape = multihost_utils.broadcast_one_to_all(np.array(data.tokens.shape if lead else (0, 0), np.int64))
    n, s = (int(v) for v in shape)
    empty = Sequences(np.zeros((n, s), np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32))
    got = multihost_utils.broadcast_one_to_all(dataclasses.astuple(data if lead else empty))
    return Sequences(*(np.asarray(x, np.int32) for x in got))


def mask_token_id(tokenizer: Any, embedding_rows: int, given: int | None = None) -> int:
    """The drafter's mask id: `given` (``--mask-token-id``), else the tokenizer's mask token,
    else a new ``<|MASK|>`` right after its ``len(tokenizer)`` tokens (special and added
    ones included), as z-lab's Qwen3 drafters take 151669. It must be a row of the
    target's embedding (Qwen3's has spare rows past the tokenizer's)."""
    if given is not None:
        mask, source = given, f"--mask-token-id {given}"
    elif tokenizer.mask_token_id is not None:
        mask = int(tokenizer.mask_token_id)
        source = f"the tokenizer's mask token {tokenizer.mask_token!r} (id {mask})"
    else:
        mask, source = len(tokenizer), (f"a new <|MASK|> id {len(tokenizer)} after the tokenizer's {len(tokenizer)} "
                                        "tokens (it has no mask token)")
    if not 0 <= mask < embedding_rows:
        raise dflash.DFlashError(f"{source} is outside the target's embedding of {embedding_rows} rows "
                                 f"[0, {embedding_rows}); pass --mask-token-id N with 0 <= N < {embedding_rows}")
    return mask


def _user_data(args: argparse.Namespace, target: specjax.Model, dc: DataConfig, data_dir: Path,
               heldout_share: float) -> tuple[Sequences, list[tuple[str, list[int]]]]:
    """(training sequences, held-out prompts) of --prompt-file / --prompt-dir."""
    source = args.prompt_file or args.prompt_dir
    read = prompts.read_prompt_file if args.prompt_file else prompts.read_prompt_dir
    given = read(source, target.tokenizer, args.chat)
    unique = prompts.dedupe(given)
    try:
        train_part, heldout = prompts.split(unique, heldout_share, dc.data_seed)
    except PromptError as e:
        raise PromptError(f"{source}: {e}") from None
    print(f"{source}: {len(given)} prompts, {len(given) - len(unique)} duplicates dropped; "
          f"{len(train_part)} to train on, {len(heldout)} held out")
    padded = prompts.pad(train_part, dc.prompt_len)
    prompts.pad(heldout, dc.prompt_len)  # held-out prompts within --prompt-len too, before the data are made
    data = generate_data(target, dc, data_dir, prompts=padded)
    return data, [("heldout", list(p.ids)) for p in heldout]


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p")


def _sampling_flags(args: argparse.Namespace, target: specjax.Model) -> None:
    """Fill the sampling flags not given from the target's generation_config.json when it
    samples, else from DataConfig's defaults (Qwen3's recommended 0.6 / 20 / 0.95)."""
    folder = target.generation_defaults
    samples = folder is not None and not folder.greedy
    base = folder if samples else dataclasses.replace(DataConfig(), sample=True).sampling
    for name in SAMPLING_FLAGS:
        if getattr(args, name) is None:
            setattr(args, name, getattr(base, name))


def _layer_ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.dflash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="Qwen3 model folder (with tokenizer)")
    p.add_argument("--out", type=Path, required=True, help="drafter folder, written whenever eval tau improves")
    p.add_argument("--run", type=Path, help="orbax checkpoints and metrics.jsonl (default runs/<out name>)")
    p.add_argument("--data", type=Path, help="generated sequences (default <run>/data)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt-file", type=Path, help="the user's prompts: JSONL ({\"prompt\": ...} or "
                        "{\"messages\": [...]} per line) or plain text (one per line)")
    source.add_argument("--prompt-dir", type=Path, help="the user's prompts: one text file each")
    source.add_argument("--shards", type=Path, help="corpus shards (train.npy) to draw prompts from "
                        "(the default, runs/data, without --prompt-file / --prompt-dir)")
    p.add_argument("--chat", action="store_true",
                   help="format plain prompts as a user message with the chat template (messages always are)")
    p.add_argument("--heldout-share", type=float,
                   help="share of the user's prompts held out for tau (at least one; "
                        f"default {RunFlags.heldout_share})")
    p.add_argument("--mask-token-id", type=int,
                   help="the drafter's mask id (default: the tokenizer's mask token, else len(tokenizer))")
    p.add_argument("--layers", type=int, help=f"drafter layers (default {RunFlags.layers})")
    p.add_argument("--block-size", type=int, help=f"the anchor and its drafts (default {RunFlags.block_size})")
    p.add_argument("--target-layer-ids", type=_layer_ids, help="comma-separated taps (default: z-lab's spread)")
    p.add_argument("--init", type=Path, help="start a fresh run from this drafter folder (same config; "
                                                "the block size may differ)")
    p.add_argument("--eval-prompts", type=int,
                   help=f"corpus mode: held-out prompts per workload (edit, complete; default {RunFlags.eval_prompts})")
    p.add_argument("--eval-prompt-len", type=int,
                   help=f"corpus mode: their length in tokens (default {RunFlags.eval_prompt_len})")
    p.add_argument("--devices", type=int, help="local devices to split each batch over (default: all; "
                   "a multi-process run uses every process's devices)")
    p.add_argument("--tp", type=int,
                   help="split the frozen target tensor-parallel over groups of this many devices (for a target "
                        f"too large for one device; one process only; default {RunFlags.tp}); batches are split "
                        "over the groups")
    p.add_argument("--data-only", action="store_true",
                   help="generate (or complete) the training data in --data and stop, e.g. on one host before "
                        "a multi-host run, whose other processes would otherwise wait for it")
    hosts = p.add_argument_group("many hosts (jax.distributed.initialize; the same flags on every host)")
    hosts.add_argument("--coordinator", help="HOST:PORT of process 0, reachable from every host")
    hosts.add_argument("--num-processes", type=int, help="processes in the run (one per host)")
    hosts.add_argument("--process-id", type=int, help="this process's index, 0 .. N-1 (0 writes the files)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="dtype of the training forward (auto: bfloat16 on accelerators, float32 on CPU); "
                        "weights and optimizer state stay float32")
    lm.add_config_flags(p, DataConfig)
    p.set_defaults(**dict.fromkeys(SAMPLING_FLAGS))  # not given: the target's generation_config.json
    lm.add_config_flags(p, DFlashTrainConfig)
    args = p.parse_args(argv)
    # bad values refused before anything is loaded; sampling flags not given are checked once they
    # are filled from the target's generation_config.json (_sampling_flags)
    tc = lm.config_from_args(args, DFlashTrainConfig, p)
    lm.config_from_args(args, DataConfig, p)
    rf = lm.config_from_args(args, RunFlags, p)
    user = args.prompt_file is not None or args.prompt_dir is not None
    for flag, given, needs in (("--heldout-share", args.heldout_share is not None, user),
                               ("--chat", args.chat, user),
                               ("--eval-prompts", args.eval_prompts is not None, not user),
                               ("--eval-prompt-len", args.eval_prompt_len is not None, not user)):
        if given and not needs:
            p.error(f"{flag} applies to " + ("the user's prompts (--prompt-file / --prompt-dir)" if not user
                                             else "corpus prompts, not to --prompt-file / --prompt-dir (whose "
                                                  "held-out share is --heldout-share)"))
    if args.coordinator or args.num_processes or args.process_id is not None:
        init_distributed(args.coordinator, args.num_processes, args.process_id)  # before any device is touched
    signal.signal(signal.SIGTERM, lm._interrupt)  # `kill` saves like Ctrl-C
    try:
        mesh = data_mesh(rf.devices, rf.tp)
    except dflash.DFlashError as e:
        p.error(str(e))
    if rf.tp > 1 and jax.process_count() > 1:
        p.error("--tp: a tensor-parallel target runs in one process")
    # over "tp" each weight is placed as it is read, so the target need never fit one device
    target = specjax.load(args.target, mesh=mesh if rf.tp > 1 else None)
    tok = target.tokenizer
    if tok is None:
        p.error(f"{args.target}: no tokenizer files (needed for prompts)")
    _sampling_flags(args, target)
    dc = lm.config_from_args(args, DataConfig, p)
    mask = mask_token_id(tok, target.config.vocab_size, rf.mask_token_id)
    if tc.batch % mesh.shape["data"]:
        p.error(f"--batch {tc.batch} is not a multiple of the {mesh.shape['data']} data-parallel groups "
                f"(--devices / --tp)")
    compute = compute_dtype(args.precision, mesh.devices.flat[0].platform)
    cfg = dflash.config_for(target.config, rf.layers, rf.block_size, args.target_layer_ids, mask)
    run = args.run or Path("runs") / args.out.name
    data_dir = args.data or run / "data"
    for flag, folder in (("--out", args.out), ("--run", run), ("--data", data_dir)):
        if folder.exists() and not folder.is_dir():
            p.error(f"{flag} {folder}: exists and is not a folder")
    _check_out(p, args.out, args.target)
    try:
        if jax.process_index() > 0:  # process 0 generates the data and evaluates
            data, eval_prompts = share_data(None), []
        elif args.prompt_file or args.prompt_dir:
            data, eval_prompts = _user_data(args, target, dc, data_dir, rf.heldout_share)
        else:
            shard = (args.shards or Path("runs/data")) / "train.npy"
            if not (data_dir / "prompts.npy").is_file() and not shard.is_file():
                p.error(f"{shard}: not found (build it with python -m train.tokenizer --shards, pass --shards, "
                        "or give your own prompts with --prompt-file / --prompt-dir)")
            try:  # before the data: a length no held-out file can give is refused first
                eval_prompts = heldout_prompts(tok, rf.eval_prompts, rf.eval_prompt_len)
            except PromptError as e:
                p.error(f"--eval-prompts {rf.eval_prompts} / --eval-prompt-len {rf.eval_prompt_len}: {e}")
            data = generate_data(target, dc, data_dir, load_shard(shard) if shard.is_file() else None)
        if jax.process_index() == 0 and jax.process_count() > 1:
            data = share_data(data)
    except KeyboardInterrupt:  # exit 130, as the shell reports Ctrl-C: `train.dflash ... && next` stops here
        print("interrupted: finished shards are kept; rerun to continue", file=sys.stderr)
        sys.exit(130)
    if args.data_only:
        print(f"{data_dir}: {len(data.tokens)} sequences of {data.tokens.shape[1]} tokens")
        return
    done = train(target, cfg, tc, data, run, args.out, eval_prompts, args.init, mesh, compute)
    if done["step"] < tc.steps:  # stopped by Ctrl-C / SIGTERM, saved: rerun to continue
        sys.exit(130)


def _check_out(p: argparse.ArgumentParser, out: Path, target: Path) -> None:
    """--out receives the drafter's files whenever tau improves, replacing the weights and
    config.json there: refused where that folder is the target or holds another model."""
    if out.resolve() == target.resolve():
        p.error(f"--out {out} is the --target folder: the drafter's export would replace the target's weights "
                "and config.json; give the drafter a folder of its own")
    config = out / "config.json"
    if config.is_file():
        try:
            kinds = json.loads(config.read_text()).get("architectures")
        except (ValueError, AttributeError):  # not JSON, or not an object
            kinds = None
        if kinds != [dflash.ARCHITECTURE]:
            p.error(f"--out {out} holds a model that is not a DFlash drafter ({config}: architectures {kinds!r}), "
                    "which the export would overwrite; give the drafter a folder of its own")


if __name__ == "__main__":
    from train import run

    run(main, "python -m train.dflash")
