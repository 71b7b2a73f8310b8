"""DFlash training over devices and micro-batches (train.dflash --devices, --accum): the
losses of the same steps on 1 and on 4 simulated CPU devices, and with a batch split into
two accumulated halves, agree with one full batch on one device; a 4-device run killed
mid-way and resumed from its checkpoint ends bit-identical to the uninterrupted one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import hf_tiny

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
losses, states = {}, {}

def run(name, devices, batch, accum):
    tc = trainer.DFlashTrainConfig(steps=3, batch=batch, accum=accum, anchors=4, lr=1e-2, warmup_ratio=0.3,
                                   log_every=1, save_every_minutes=0)  # a checkpoint after every step
    states[name] = trainer.train(target, cfg, tc, data, f"{out}/{name}", mesh=trainer.data_mesh(devices))
    losses[name] = [json.loads(line)["train_loss"] for line in open(f"{out}/{name}/metrics.jsonl")]

for devices, batch, accum in ((1, 8, 1), (4, 8, 1), (1, 4, 2)):
    run(f"{devices},{batch},{accum}", devices, batch, accum)

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
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(train_loss rows by run, final {"params", "opt_state"} leaves of the 4-device runs
    by "run:path") of WORKER's runs."""
    folder = tmp_path_factory.mktemp("target")
    hf_tiny(folder, seed=2, eos_token_id=0)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONPATH": str(ROOT),
           "SPECJAX_CACHE_DIR": "off"}
    runs = tmp_path_factory.mktemp("runs")
    done = subprocess.run([sys.executable, "-c", WORKER, str(folder), str(runs)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and done.stdout.count("at step 1") == 1, done.stdout[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("LOSSES "))
    states = dict(np.load(runs / "states.npz"))
    return {k: np.array(v) for k, v in json.loads(line.removeprefix("LOSSES ")).items()}, states


def test_four_devices_give_one_devices_losses(worker):
    losses = worker[0]
    one, four = losses["1,8,1"], losses["4,8,1"]
    assert len(one) == 3 and one[-1] < one[0]  # the steps train
    np.testing.assert_allclose(four, one, rtol=1e-5, atol=0)


def test_two_accumulated_halves_are_one_full_batch(worker):
    losses = worker[0]
    np.testing.assert_allclose(losses["1,4,2"], losses["1,8,1"], rtol=1e-5, atol=0)


def test_killed_and_resumed_on_four_devices_continues_identically(worker):
    """The resumed run's state (Adam moments, step count, weights) and its later losses are
    exactly those of the uninterrupted 4-device run."""
    losses, states = worker
    np.testing.assert_array_equal(losses["resumed"], losses["4,8,1"])  # step 1 by the killed run, 2-3 resumed
    full = {k.removeprefix("4,8,1:"): v for k, v in states.items() if k.startswith("4,8,1:")}
    resumed = {k.removeprefix("resumed:"): v for k, v in states.items() if k.startswith("resumed:")}
    assert full.keys() == resumed.keys() and any("opt_state" in k for k in full)
    for key in full:
        np.testing.assert_array_equal(resumed[key], full[key], err_msg=key)
