"""DFlash training over devices and micro-batches (train.dflash --devices, --accum): the
losses of the same steps on 1 and on 4 simulated CPU devices, and with a batch split into
two accumulated halves, agree with one full batch on one device."""

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
losses = {}
for devices, batch, accum in ((1, 8, 1), (4, 8, 1), (1, 4, 2)):
    tc = trainer.DFlashTrainConfig(steps=3, batch=batch, accum=accum, anchors=4, lr=1e-2, warmup_ratio=0.3,
                                   log_every=1, save_every_minutes=100)
    run = f"{out}/run-{devices}-{batch}-{accum}"
    trainer.train(target, cfg, tc, data, run, mesh=trainer.data_mesh(devices))
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    losses[f"{devices},{batch},{accum}"] = [r["train_loss"] for r in rows]
print("LOSSES " + json.dumps(losses))
"""


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    hf_tiny(folder, seed=2, eos_token_id=0)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONPATH": str(ROOT),
           "SPECJAX_CACHE_DIR": "off"}
    done = subprocess.run([sys.executable, "-c", WORKER, str(folder), str(tmp_path_factory.mktemp("runs"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("LOSSES "))
    return {k: np.array(v) for k, v in json.loads(line.removeprefix("LOSSES ")).items()}


def test_four_devices_give_one_devices_losses(losses):
    one, four = losses["1,8,1"], losses["4,8,1"]
    assert len(one) == 3 and one[-1] < one[0]  # the steps train
    np.testing.assert_allclose(four, one, rtol=1e-5, atol=0)


def test_two_accumulated_halves_are_one_full_batch(losses):
    np.testing.assert_allclose(losses["1,4,2"], losses["1,8,1"], rtol=1e-5, atol=0)
