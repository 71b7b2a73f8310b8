"""DFlash training across processes (train.dflash --coordinator/--num-processes/--process-id):
two processes on this machine's CPU backend, 2 simulated devices each, joined by
jax.distributed (gloo collectives), train the same steps as one process on 4 simulated
devices, to the same losses and weights; process 0 alone writes metrics.jsonl, both write
the orbax checkpoint, and process 1 gets the training data from process 0."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import hf_tiny, xla_flags

ROOT = Path(__file__).resolve().parents[1]

# argv: target folder, run folder, then either "single" or "<coordinator> <process id>".
WORKER = """
import json, sys
import jax
from train import dflash as trainer

folder, out = sys.argv[1], sys.argv[2]
if sys.argv[3] != "single":
    trainer.init_distributed(sys.argv[3], 2, int(sys.argv[4]))
assert jax.device_count() == 4, jax.devices()
import numpy as np
import specjax
from specjax import dflash
from train.dflash_data import Sequences

target = specjax.load(folder)
if jax.process_index() == 0:
    rng = np.random.default_rng(0)
    starts = rng.integers(4, 12, 16).astype(np.int32)
    data = Sequences(rng.integers(1, 101, (16, 40)).astype(np.int32),
                     (starts + rng.integers(6, 29, 16)).astype(np.int32), starts)
if jax.process_count() > 1:
    data = trainer.share_data(data if jax.process_index() == 0 else None)
cfg = dflash.config_for(target.config, num_layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=100)
tc = trainer.DFlashTrainConfig(steps=3, batch=8, anchors=4, lr=1e-2, warmup_ratio=0.3, log_every=1,
                               save_every_minutes=0)  # a (collective) checkpoint after every step
state = trainer.train(target, cfg, tc, data, out, mesh=trainer.data_mesh())
params = {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
np.savez(f"{out}/params-{jax.process_index()}.npz", **params)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={devices}"),
            "PYTHONPATH": str(ROOT), "SPECJAX_CACHE_DIR": "off"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The run folders of WORKER on one process of 4 devices ("single") and on two
    processes of 2 devices ("multi")."""
    folder = tmp_path_factory.mktemp("target")
    hf_tiny(folder, seed=2, eos_token_id=0)
    root = tmp_path_factory.mktemp("runs")
    single = subprocess.run([sys.executable, "-c", WORKER, str(folder), str(root / "single"), "single"],
                            cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(folder), str(root / "multi"), coordinator, str(i)],
                              cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
    assert "in 2 process(es)" in outs[0][0] and "drafter:" not in outs[1][0], outs  # process 0 prints
    return root / "single", root / "multi"


def _losses(run: Path) -> np.ndarray:
    return np.array([json.loads(line)["train_loss"] for line in open(run / "metrics.jsonl")])


def test_two_processes_give_one_processes_losses(runs):
    single, multi = runs
    one, two = _losses(single), _losses(multi)
    assert len(one) == 3 and one[-1] < one[0]  # the steps train
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=0)  # 3 rows: process 1 wrote none


def test_both_processes_end_with_the_single_processes_weights(runs):
    single, multi = runs
    want = dict(np.load(single / "params-0.npz"))
    for i in range(2):
        got = dict(np.load(multi / f"params-{i}.npz"))
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=f"process {i} {key}")


def test_the_checkpoint_is_written_once_per_step(runs):
    _, multi = runs
    steps = sorted(int(p.name) for p in (multi / "orbax").iterdir() if p.name.isdigit())
    assert steps == [2, 3]  # the last 2 kept
