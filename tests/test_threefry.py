"""specjax.threefry against jax.random: the same keys and the same numbers, bit for bit,
for every key shape the samplers use (batched keys broadcast where jax.random vmaps)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import threefry


@pytest.fixture
def seeds(rng):
    # the ends of the range, a sign bit, and random words
    return np.concatenate([[0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1],
                           rng.integers(0, 2 ** 32, 27, dtype=np.uint64)]).astype(np.uint32)


def _data(key):
    return np.asarray(jax.random.key_data(key))


def test_keys_and_folds_equal_jax_random(seeds, rng):
    data = rng.integers(0, 2 ** 31, len(seeds)).astype(np.int32)
    want = jax.vmap(lambda s, d: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), 3), d))(seeds, data)
    got = threefry.fold_in(threefry.fold_in(threefry.key(jnp.asarray(seeds)), 3), jnp.asarray(data))
    np.testing.assert_array_equal(_data(got), _data(want))
    np.testing.assert_array_equal(_data(threefry.key(jnp.asarray(seeds))), _data(jax.vmap(jax.random.key)(seeds)))
    # a key folded with each of several data (keys [N, 1] against data [N, C])
    many = rng.integers(0, 2 ** 31, (len(seeds), 5)).astype(np.int32)
    want = jax.vmap(lambda k, d: jax.vmap(lambda x: jax.random.fold_in(k, x))(d))(want, many)
    got = threefry.fold_in(got[:, None], jnp.asarray(many))
    np.testing.assert_array_equal(_data(got), _data(want))


@pytest.mark.parametrize("shape", [(), (1,), (37,), (4, 9), (8192,)])
def test_uniform_and_gumbel_equal_jax_random(seeds, shape):
    keys = threefry.fold_in(threefry.key(jnp.asarray(seeds)), 11)
    want_u = jax.vmap(lambda k: jax.random.uniform(k, shape))(keys)
    want_g = jax.vmap(lambda k: jax.random.gumbel(k, shape, jnp.float32))(keys)
    u, g = threefry.uniform(keys, shape), threefry.gumbel(keys, shape)
    assert u.shape == g.shape == (len(seeds), *shape) and u.dtype == g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(u).view(np.uint32), np.asarray(want_u).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(want_g).view(np.uint32))
    # scaled uniforms, as jax.random.uniform's minval / maxval
    want = jax.vmap(lambda k: jax.random.uniform(k, shape, minval=-2.0, maxval=3.0))(keys)
    np.testing.assert_array_equal(np.asarray(threefry.uniform(keys, shape, -2.0, 3.0)), np.asarray(want))


def test_hash_matches_the_published_known_answers():
    """Threefry-2x32-20 known-answer vectors of the Random123 distribution (kat_vectors),
    as jax's own tests use them."""
    cases = [((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
             ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
             ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0))]
    for (k1, k2), (x1, x2), want in cases:
        got = threefry.hash2x32(*(jnp.uint32(a) for a in (k1, k2, x1, x2)))
        assert tuple(int(v) for v in got) == want


def test_seeds_must_be_integers():
    with pytest.raises(TypeError, match="integer"):
        threefry.key(jnp.float32(1.0))
