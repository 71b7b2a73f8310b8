"""DFlash training over devices and micro-batches (train.dflash --devices, --tp, --accum):
the losses of the same steps on 1 and on 4 simulated CPU devices (data parallel, and with
the target tensor-parallel over 2 and 4 of them), and with a batch split into two
accumulated halves, agree with one full batch on one device; a 4-device run killed
mid-way and resumed from its checkpoint ends bit-identical to the uninterrupted one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import hf_tiny, xla_flags

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh process: the simulated device count is fixed when JAX starts.
WORKER = """
import json, sys
import jax
import numpy as np
import specjax
from specjax import dflash
from train import dflash as trainer
from train.dflash_data import Sequences

folder, out = sys.argv[1], sys.argv[2]
assert jax.device_count() == 4, jax.devices()
target = specjax.load(folder)
rng = np.random.default_rng(0)
starts = rng.integers(4, 12, 16).astype(np.int32)
data = Sequences(rng.integers(1, 101, (16, 40)).astype(np.int32),
                 (starts + rng.integers(6, 29, 16)).astype(np.int32), starts)
cfg = dflash.config_for(target.config, num_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=100)
losses, states, qkv = {}, {}, {}
real_step = trainer.make_train_step

def recording_step(*args):  # records where the 4-device steps find the target's first qkv weight
    step = real_step(*args)

    def recorded(params, opt_state, target_params, batch):
        w = target_params["model.layers"][0]["self_attn.qkv_proj.weight"]
        if current in ("4,8,1", "tp2", "tp4"):  # (one device: CPU-kernel packed weights, no placement)
            qkv[current] = {"spec": [str(a) for a in w.sharding.spec], "full": list(w.shape),
                            "local": [list(s.data.shape) for s in w.addressable_shards]}
        return step(params, opt_state, target_params, batch)
    return recorded

trainer.make_train_step = recording_step

def run(name, devices, batch, accum, tp=1):
    global current
    current = name
    tc = trainer.DFlashTrainConfig(steps=3, batch=batch, accum=accum, anchors=4, lr=1e-2, warmup_ratio=0.3,
                                   log_every=1, save_every_minutes=0)  # a checkpoint after every step
    states[name] = trainer.train(target, cfg, tc, data, f"{out}/{name}", mesh=trainer.data_mesh(devices, tp))
    losses[name] = [json.loads(line)["train_loss"] for line in open(f"{out}/{name}/metrics.jsonl")]

for devices, batch, accum in ((1, 8, 1), (4, 8, 1), (1, 4, 2)):
    run(f"{devices},{batch},{accum}", devices, batch, accum)
for tp in (2, 4):
    run(f"tp{tp}", 4, 8, 1, tp)

# kill -9 while step 1 runs (no save after step 1's checkpoint), then resume on 4 devices
real = trainer.batch_at

def killed(data, tc, step):
    if step == 1:
        raise RuntimeError("killed")
    return real(data, tc, step)

trainer.batch_at = killed
try:
    run("resumed", 4, 8, 1)
    raise AssertionError("the run was not killed")
except RuntimeError as e:
    assert str(e) == "killed", e
trainer.batch_at = real
run("resumed", 4, 8, 1)
np.savez(f"{out}/states.npz", **{f"{name}:{jax.tree_util.keystr(path)}": np.asarray(leaf)
                                 for name in ("4,8,1", "resumed")
                                 for path, leaf in jax.tree_util.tree_flatten_with_path(states[name])[0]})
print("LOSSES " + json.dumps(losses))
print("QKV " + json.dumps(qkv))
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(train_loss rows by run, final {"params", "opt_state"} leaves of the 4-device runs
    by "run:path", the target's first qkv weight as the 4-device steps got it) of WORKER's runs."""
    folder = tmp_path_factory.mktemp("target")
    hf_tiny(folder, seed=2, eos_token_id=0, vocab_size=104)  # every split weight divides over 4 (--tp 4)
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4"), "PYTHONPATH": str(ROOT),
           "SPECJAX_CACHE_DIR": "off"}
    runs = tmp_path_factory.mktemp("runs")
    done = subprocess.run([sys.executable, "-c", WORKER, str(folder), str(runs)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and done.stdout.count("at step 1") == 1, done.stdout[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("LOSSES "))
    states = dict(np.load(runs / "states.npz"))
    qkv = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("QKV ")).removeprefix("QKV "))
    return {k: np.array(v) for k, v in json.loads(line.removeprefix("LOSSES ")).items()}, states, qkv


def test_four_devices_give_one_devices_losses(worker):
    losses = worker[0]
    one, four = losses["1,8,1"], losses["4,8,1"]
    assert len(one) == 3 and one[-1] < one[0]  # the steps train
    np.testing.assert_allclose(four, one, rtol=1e-5, atol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_target_gives_one_devices_losses(worker, tp):
    """--tp over 4 devices ((4 / tp) data x tp): the steps get the target's qkv weight split
    by rows over "tp" (each device a 1 / tp slice; data parallel alone, a whole copy each),
    and the losses are the 1-device run's."""
    losses, _, qkv = worker
    assert qkv["4,8,1"]["local"] == [qkv["4,8,1"]["full"]] * 4
    split = qkv[f"tp{tp}"]
    rows, cols = split["full"]
    assert split["spec"][0] == "tp" and split["local"] == [[rows // tp, cols]] * 4, split
    np.testing.assert_allclose(losses[f"tp{tp}"], losses["1,8,1"], rtol=1e-5, atol=0)


def test_two_accumulated_halves_are_one_full_batch(worker):
    losses = worker[0]
    np.testing.assert_allclose(losses["1,4,2"], losses["1,8,1"], rtol=1e-5, atol=0)


def test_killed_and_resumed_on_four_devices_continues_identically(worker):
    """The resumed run's state (Adam moments, step count, weights) and its later losses are
    exactly those of the uninterrupted 4-device run."""
    losses, states, _ = worker
    np.testing.assert_array_equal(losses["resumed"], losses["4,8,1"])  # step 1 by the killed run, 2-3 resumed
    full = {k.removeprefix("4,8,1:"): v for k, v in states.items() if k.startswith("4,8,1:")}
    resumed = {k.removeprefix("resumed:"): v for k, v in states.items() if k.startswith("resumed:")}
    assert full.keys() == resumed.keys() and any("opt_state" in k for k in full)
    for key in full:
        np.testing.assert_array_equal(resumed[key], full[key], err_msg=key)
