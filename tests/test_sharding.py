"""Tensor-parallel sharding (specjax.sharding) on four simulated CPU devices.

XLA's device count is fixed when jax starts, so the checks run in a child process started
with --xla_force_host_platform_device_count=4 and report back as JSON.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import xla_flags

CHILD = textwrap.dedent("""
    import json, sys, tempfile
    import numpy as np, jax, jax.numpy as jnp
    import specjax
    from specjax import checkpoint, dflash, qwen3, sharding
    from specjax.config import Qwen3Config
    from specjax.model import Model
    from specjax.proposers import DFlashProposer, NgramProposer

    seed = int(sys.argv[1])
    rng = np.random.default_rng(seed)
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    params = checkpoint.unstack(checkpoint.init_params(cfg, jax.random.key(seed), std=0.3))
    model = Model(cfg, params, jnp.float32)
    ids = rng.integers(0, 96, 24)
    # a prompt that repeats itself gives n-gram drafts something to accept
    ids = np.concatenate([ids, ids[:12]])
    tokens, positions = jnp.asarray(ids)[None], jnp.arange(len(ids))[None]
    forward = jax.jit(lambda p: qwen3.forward(p, cfg, tokens, positions)[0])
    want = np.asarray(forward(params))
    drafter = dflash.init(cfg, jax.random.key(seed + 1), num_layers=1, block_size=4, target_layer_ids=(0, 2), std=0.3)
    out = {"devices": len(jax.devices()), "meshes": {}}
    folder = tempfile.mkdtemp()
    checkpoint.save(folder, params, cfg, dtype="float32")
    drafter_folder = tempfile.mkdtemp()
    dflash.save_dflash(drafter, drafter_folder, dtype="float32")
    for n in (2, 4):
        sm = specjax.shard(model, sharding.make_mesh(jax.devices()[:n]))
        placed = {}
        for name, leaf in [("lm_head.weight", sm.params["lm_head.weight"]),
                           ("model.norm.weight", sm.params["model.norm.weight"])] + [
                (k, v) for k, v in sm.params[checkpoint.LAYERS][1].items()]:
            placed[name] = {"spec": [a for a in leaf.sharding.spec], "full": list(leaf.shape),
                            "local": list(leaf.addressable_shards[0].data.shape), "n_shards": len(leaf.addressable_shards)}
        streamed = specjax.load(folder, mesh=sharding.make_mesh(jax.devices()[:n])).params
        differ = [jax.tree_util.keystr(path) for (path, a), b in
                  zip(jax.tree_util.tree_leaves_with_path(sm.params), jax.tree.leaves(streamed))
                  if not (a.sharding == b.sharding and np.array_equal(a, b))]
        got = np.asarray(forward(sm.params))
        placed_drafter = specjax.load_dflash(drafter_folder, sm, mesh=sharding.make_mesh(jax.devices()[:n]))
        drafter_specs = {name: [a for a in leaf.sharding.spec]
                         for name, leaf in placed_drafter.params[dflash.DRAFT_LAYERS][0].items()}
        out["meshes"][n] = {"placed": placed, "streamed_differ": differ, "drafter_specs": drafter_specs,
                            "streamed_leaves": len(jax.tree.leaves(streamed)),
                            "max_logit_diff": float(np.abs(got - want).max()), "logit_scale": float(np.abs(want).max())}
        if n != 2:  # generation on the 2-device mesh only (each run compiles its steps for the placement)
            continue
        # a mesh whose one axis has another name: loading splits over it as shard() is told to
        other = sharding.make_mesh(jax.devices()[:n], axis="x")
        by_name = specjax.shard(model, other, axis="x").params
        out["other_axis_differ"] = [jax.tree_util.keystr(path) for (path, a), b in
                                    zip(jax.tree_util.tree_leaves_with_path(by_name),
                                        jax.tree.leaves(specjax.load(folder, mesh=other).params))
                                    if not (a.sharding == b.sharding and np.array_equal(a, b))]
        out["other_axis_drafter"] = [a for a in specjax.load_dflash(drafter_folder, sm, mesh=other).params[
            dflash.DRAFT_LAYERS][0]["self_attn.qkv_proj.weight"].sharding.spec]
        plain = specjax.generate(sm, ids, max_new_tokens=20).tokens
        runs = {"ngram": specjax.generate(sm, ids, max_new_tokens=20, speculative=NgramProposer(k=4)).tokens,
                "dflash": specjax.generate(sm, ids, max_new_tokens=20, speculative=DFlashProposer(drafter, k=3)).tokens,
                "dflash-on-mesh": specjax.generate(sm, ids, max_new_tokens=20,
                                                   speculative=DFlashProposer(placed_drafter, k=3)).tokens}
        sampling = specjax.Sampling(temperature=0.9, top_k=20)
        prompts = [ids, ids[:10], ids[5:]]
        batch = specjax.generate(sm, prompts, max_new_tokens=[20, 12, 16], sampling=[specjax.Sampling(), sampling,
                                 specjax.Sampling()], seed=[0, 3, 0], speculative=specjax.Adaptive(specjax.NgramProposer(k=4)))
        alone = [specjax.generate(sm, p, max_new_tokens=m, sampling=s, seed=sd).tokens
                 for p, m, s, sd in zip(prompts, [20, 12, 16], [specjax.Sampling(), sampling, specjax.Sampling()],
                                        [0, 3, 0])]
        assert alone[0] == plain
        out["generated"] = {"batch": [list(map(int, r.tokens)) for r in batch],
                            "alone": [list(map(int, a)) for a in alone], "plain": list(map(int, plain)),
                            "spec": {k: list(map(int, v)) for k, v in runs.items()}}
    try:
        specjax.shard(model, sharding.make_mesh(jax.devices()[:3]))
        out["three"] = "no error"
    except sharding.ShardingError as e:
        out["three"] = str(e)
    try:
        specjax.load(folder, mesh=jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b")))
        out["two_axes"] = "no error"
    except sharding.ShardingError as e:
        out["two_axes"] = str(e)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def sharded():
    seed = int.from_bytes(os.urandom(3), "little")
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4")}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(seed)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, f"seed {seed}:\n{proc.stderr[-3000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return seed, json.loads(line[len("RESULT "):])


def test_weights_split_megatron_style(sharded):
    seed, out = sharded
    assert out["devices"] == 4
    for n, mesh in out["meshes"].items():
        n = int(n)
        split = {"self_attn.qkv_proj.weight": 0, "mlp.gate_up_proj.weight": 0, "self_attn.o_proj.weight": 1,
                 "mlp.down_proj.weight": 1, "lm_head.weight": 0}
        for name, p in mesh["placed"].items():
            assert p["n_shards"] == n, (seed, name)
            want = list(p["full"])
            if name in split:
                want[split[name]] //= n
                assert p["spec"][split[name]] == "tp", (seed, name, p)
            else:  # norms: every device holds all of it
                assert not any(p["spec"]), (seed, name, p)
            assert p["local"] == want, (seed, name, p)


def test_loading_onto_a_mesh_places_as_shard_does(sharded):
    """specjax.load(mesh=...) places each weight as it is read; the result is the tree
    shard() makes of the loaded model, leaf for leaf (placement and values)."""
    seed, out = sharded
    for mesh in out["meshes"].values():
        assert mesh["streamed_leaves"] == 3 + 3 * 8, seed  # embed, norm, head; 3 layers of 8 (q/k/v, gate/up fused)
        assert mesh["streamed_differ"] == [], (seed, mesh["streamed_differ"])
        # load_dflash(mesh=) places the drafter's layers by the same rule
        specs = mesh["drafter_specs"]
        assert specs["self_attn.qkv_proj.weight"][0] == "tp" and specs["self_attn.o_proj.weight"][1] == "tp", specs
        assert not any(specs["input_layernorm.weight"]), specs


def test_a_mesh_axis_of_any_name_is_the_one_loading_splits_over(sharded):
    """load(mesh=) over a one-axis mesh named "x" places each weight as shard(..., axis="x")
    does (it failed with KeyError 'tp'); a mesh of two axes, neither "tp", is refused by name."""
    seed, out = sharded
    assert out["other_axis_differ"] == [], (seed, out["other_axis_differ"])
    assert out["other_axis_drafter"][0] == "x", out["other_axis_drafter"]
    assert "mesh axes ('a', 'b'): none is named 'tp'" in out["two_axes"], out["two_axes"]


def test_sharded_logits_match_unsharded(sharded):
    seed, out = sharded
    for mesh in out["meshes"].values():
        assert mesh["max_logit_diff"] <= 1e-5 * max(1.0, mesh["logit_scale"]), (seed, mesh["max_logit_diff"])


def test_speculation_is_exact_on_a_sharded_target(sharded):
    """Within one placement (2 devices): greedy speculative == plain for n-gram and DFlash
    drafts (sampled lookup speculation: the engine test below, its second row)."""
    seed, out = sharded
    run = out["generated"]
    assert len(run["plain"]) == 20
    for name, tokens in run["spec"].items():
        assert tokens == run["plain"], (seed, name)


def test_engine_rows_equal_alone_on_a_sharded_target(sharded):
    """The batched engine on a tensor-parallel target: each row (greedy and sampled, with
    lookup drafts) equals its prompt generated alone, without drafts, on the same placement."""
    seed, out = sharded
    run = out["generated"]
    assert run["batch"] == run["alone"], seed
    assert [len(t) for t in run["batch"]] == [20, 12, 16], seed


def test_uneven_split_is_refused_by_name(sharded):
    _, out = sharded
    assert "does not split evenly over 3 devices" in out["three"]
    assert out["three"].startswith("weight 'model.layers.0.")  # the first weight that cannot split, by name
