"""DFlash training data: the target's own responses to training-corpus prompts.

The drafter must learn what the target says, not what the corpus says (the DFlash paper,
arXiv:2602.06036, regenerates its training replies with the target), so every sequence
is a prompt from the training split followed by the target's reply (greedy, or sampled
with ``--sample``), decoded ``gen_batch`` prompts at a time by :func:`replies`. Prompts
are ``prompt_len`` tokens: random windows of the training token shard, and for a share
``edit_share`` of them a window followed by a rename-edit prompt cut from a training
file (the copy-heavy workload). Replies stop at an eos id and are padded with it to
``response_len``.

Layout of a data folder::

    meta.json           the plan (lengths, sampling, target); a mismatch refuses to mix
    prompts.npy         int32 [n, prompt_len], drawn once
    seqs-00000.npy ...  int32 [shard_size, prompt_len + response_len] prompt + reply

Shards are written whole (rename into place), so an interrupted run loses at most one
shard and a restart continues with the next missing one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import specjax
from specjax import cpu_kernels
from specjax import kv as kvlib
from specjax import qwen3
from specjax import sampling as smp
from specjax.checkpoint import Params
from specjax.config import Qwen3Config
from specjax.sampling import Sampling
from specjax import edits
from train import corpus


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Training sequences: prompt + reply tokens and how much of each is real."""

    tokens: np.ndarray   # [n, S] int32, S = prompt_len + response_len
    lengths: np.ndarray  # [n] int32: valid tokens (through the reply's eos)
    prompt_len: int


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to generate; flags of ``python -m train.dflash``."""

    prompts: int = 2048
    prompt_len: int = 256
    response_len: int = 256
    edit_share: float = 0.5
    sample: bool = False
    temperature: float = 0.6
    top_k: int = 20
    top_p: float = 0.95
    gen_batch: int = 16      # prompts decoded together over one cache (the CPU kernels take 16 rows)
    shard_size: int = 64
    data_seed: int = 0

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p) if self.sample else Sampling()

    def plan(self, target: specjax.Model) -> dict[str, Any]:
        """Everything the stored sequences depend on, the target included (shard_size and
        gen_batch change only how they are made)."""
        d = dataclasses.asdict(self)
        d.pop("shard_size")
        d.pop("gen_batch")
        if not self.sample:
            for key in ("temperature", "top_k", "top_p"):
                d.pop(key)
        embed = cpu_kernels.unpack_tree(target.params["model.embed_tokens.weight"]).astype(np.float32)
        # a retrained target changes its embedding; 5 digits survive dtype and device changes
        d["target"] = {"config": target.config.to_hf(), "embed_abs_mean": float(f"{float(abs(embed).mean()):.5g}")}
        return d


PAGE = 16


def _edit_tails(tokenizer: Any, rng: random.Random, longest: int, tries: int = 2000) -> Iterator[list[int]]:
    """Endless token lists of rename-edit prompts from training files, at most `longest` long."""
    sources, _ = corpus.read_sources(corpus.split(corpus.stdlib_files())[0])
    examples = edits.edit_examples(sources, rng)
    while True:
        for _ in range(tries):
            ids = tokenizer(next(examples).prompt)["input_ids"]
            if len(ids) <= longest:
                yield ids
                break
        else:
            raise ValueError(f"no rename-edit prompt of {tries} fits in {longest} tokens; "
                             "raise --prompt-len or set --edit-share 0")


def make_prompts(train_tokens: np.ndarray, n: int, prompt_len: int, edit_share: float = 0.0,
                 tokenizer: Any = None, seed: int = 0) -> np.ndarray:
    """n prompts int32 [n, prompt_len] from the training split (see the module docstring).

    Each is a random window of `train_tokens`; with probability `edit_share` its tail is
    replaced by eos + a rename-edit prompt (needs `tokenizer`), the window's start staying
    as preceding context, as documents are packed in training (and in specjax.workloads).
    """
    if edit_share and tokenizer is None:
        raise ValueError("edit prompts need the target's tokenizer")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, train_tokens.size - prompt_len, n)
    out = np.stack([np.asarray(train_tokens[s:s + prompt_len], np.int32) for s in starts])
    is_edit = rng.random(n) < edit_share
    tails = _edit_tails(tokenizer, random.Random(seed), prompt_len - 32) if is_edit.any() else None
    for i in np.flatnonzero(is_edit):
        tail = [tokenizer.eos_token_id] + next(tails)
        out[i, prompt_len - len(tail):] = tail
    return out


def _shard(folder: Path, i: int) -> Path:
    return folder / f"seqs-{i:05d}.npy"


def generate_data(target: specjax.Model, dc: DataConfig, folder: str | Path,
                  train_tokens: np.ndarray | None = None) -> Sequences:
    """Generate (or finish) the data folder; returns every sequence.

    `train_tokens` (the training shard) is read only when prompts.npy is not there yet.
    """
    if not target.eos_ids:
        raise ValueError(f"target {target.path} has no eos_token_id: replies could not stop or be padded")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plan = json.loads(json.dumps(dc.plan(target)))  # as it reads back
    meta = folder / "meta.json"
    if meta.is_file():
        if json.loads(meta.read_text()) != plan:
            raise ValueError(f"{folder}: holds data of another plan or target ({meta}); use a fresh --data folder")
    else:
        meta.write_text(json.dumps(plan, indent=2) + "\n")
    if (folder / "prompts.npy").is_file():
        prompts = np.load(folder / "prompts.npy")
    else:
        if train_tokens is None:
            raise ValueError(f"{folder}: no prompts.npy yet; pass the training token shard")
        prompts = make_prompts(train_tokens, dc.prompts, dc.prompt_len, dc.edit_share, target.tokenizer, dc.data_seed)
        np.save(folder / "prompts.npy", prompts)
    n_shards = -(-dc.prompts // dc.shard_size)
    done = next((i for i in range(n_shards) if not _shard(folder, i).is_file()), n_shards)
    with tqdm(total=dc.prompts, initial=min(done * dc.shard_size, dc.prompts), unit="seq",
              desc="generating replies", mininterval=1 if os.isatty(2) else 60) as bar:
        for i in range(done, n_shards):
            rows = range(i * dc.shard_size, min((i + 1) * dc.shard_size, dc.prompts))
            out = []
            for j in range(rows.start, rows.stop, dc.gen_batch):
                ids = np.arange(j, min(j + dc.gen_batch, rows.stop))
                seeds = dc.data_seed * dc.prompts + ids
                out.append(replies(target, prompts[ids], dc.response_len, dc.sampling, seeds))
                bar.update(len(ids))
            reply = np.concatenate(out)
            # everything after the first eos becomes eos (the padding of a reply that stopped)
            is_eos = np.isin(reply, target.eos_ids)
            after = np.cumsum(is_eos, axis=1) - is_eos > 0
            reply[after] = target.eos_ids[0]
            tmp = folder / f".seqs-{i:05d}.tmp.npy"
            np.save(tmp, np.concatenate([prompts[rows.start:rows.stop], reply], axis=1))
            os.replace(tmp, _shard(folder, i))
    seqs = np.concatenate([np.load(_shard(folder, i)) for i in range(n_shards)])
    return Sequences(seqs, reply_lengths(seqs, dc.prompt_len, target.eos_ids), dc.prompt_len)


def replies(target: specjax.Model, prompts: np.ndarray, n_new: int, sampling: Sampling,
            seeds: np.ndarray) -> np.ndarray:
    """The target's next `n_new` tokens [B, n_new] after each prompt row [B, P], all rows at once.

    Row b draws its tokens with the position keys of `specjax.generate(..., seed=seeds[b])`,
    so it is that call's output (up to float rounding of the prefill, and of the decode
    steps where the CPU kernels do not apply), continued past any eos. Rows of a final
    short batch are padded to a power of two (few compiles).
    """
    b, p = prompts.shape
    width = 1 << (b - 1).bit_length()
    pad = ((0, width - b), (0, 0))
    out = _decode(target.params, target.config, jnp.asarray(np.pad(prompts, pad), jnp.int32),
                  jnp.asarray(np.pad(seeds, pad[0]), jnp.int32), n_new, sampling)
    return np.asarray(out)[:b]


@functools.partial(jax.jit, static_argnames=("cfg", "n_new", "sampling"))
def _decode(params: Params, cfg: Qwen3Config, prompts: jax.Array, seeds: jax.Array, n_new: int,
            sampling: Sampling) -> jax.Array:
    """Prefill each prompt row [B, P], then n_new decode steps of all rows in one scan; tokens [B, n_new].

    Prompts are prefilled row by row (vmapped, each over its own cache); their
    caches are then laid side by side as one B-row cache (kv.init's layout), so each decode
    step is one batched step, where the CPU kernels read the weights once for all rows and
    give each row the bits of its own batch-1 step (measured: 1.6x the tokens/s of vmapped
    batch-1 decode steps at 16 rows).
    """
    b, p = prompts.shape
    capacity = -(-(p + n_new) // PAGE) * PAGE
    dtype = params["model.embed_tokens.weight"].dtype

    def pick(h: jax.Array, position: jax.Array) -> jax.Array:  # tokens [B] at `position` after h [B, D]
        logits = qwen3.unembed(params, cfg, h)
        return jax.vmap(lambda row, seed: smp.target_tokens(row[None], position[None], seed, sampling)[0])(
            logits, seeds)

    def prefill(prompt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        # hidden_states masks keys by position, so the cache needs no lengths here
        kv = kvlib.init(cfg, 1, capacity, dtype, PAGE)
        h, kv, _ = qwen3.hidden_states(params, cfg, prompt[None], jnp.arange(p)[None], kv)
        return h[0, -1], kv.k, kv.v

    h, k, v = jax.vmap(prefill)(prompts)  # pools [B, L, K, pages, Z, E]
    side_by_side = lambda pool: pool.transpose(1, 2, 0, 3, 4, 5).reshape(*pool.shape[1:3], -1, *pool.shape[4:])
    kv = kvlib.init(cfg, b, capacity, dtype, PAGE).replace(k=side_by_side(k), v=side_by_side(v))

    def step(carry, position):
        kv, tokens = carry
        h, kv, _ = qwen3.hidden_states(params, cfg, tokens[:, None], jnp.full((b, 1), position), kv)
        return (kv, pick(h[:, 0], position + 1)), tokens

    _, tokens = jax.lax.scan(step, (kv, pick(h, jnp.int32(p))), p + jnp.arange(n_new))
    return tokens.T


def reply_lengths(seqs: np.ndarray, prompt_len: int, eos_ids: tuple[int, ...]) -> np.ndarray:
    """Valid length of each sequence [n]: through the reply's first eos (kept), else all."""
    reply = np.isin(seqs[:, prompt_len:], eos_ids)
    first = np.where(reply.any(axis=1), reply.argmax(axis=1) + 1, reply.shape[1])
    return (prompt_len + first).astype(np.int32)
