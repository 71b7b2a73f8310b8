"""jax.random's threefry functions that specjax draws with, bitwise, in elementwise ops.

`key`, `fold_in`, `uniform` and `gumbel` return exactly what `jax.random.key`,
`jax.random.fold_in`, `jax.random.uniform` and `jax.random.gumbel` (float32, default
mode) return for "threefry2x32" keys (the default implementation, with
`jax_threefry_partitionable` on, jax's default): the keys are ordinary typed jax keys, so
either may be applied to them. The difference is cost. On CPU, jax lowers each
Threefry-2x32 hash as a loop of five trips (to keep compile times down), and XLA:CPU runs
every trip's small kernels and copies one after another: a sampled speculative round
hashes dozens of times (a key per position, a fold per candidate token, the bits of each
draw). Written out here as the 20 rounds of Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3" (SC 2011), each hash is a few dozen elementwise operations that XLA
fuses with their neighbours.
"""

import jax
import jax.numpy as jnp
import numpy as np

IMPL = "threefry2x32"
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)  # Threefry's key schedule constant


def _rotate_left(x: jax.Array, r: int) -> jax.Array:
    return jax.lax.bitwise_or(jax.lax.shift_left(x, np.uint32(r)), jax.lax.shift_right_logical(x, np.uint32(32 - r)))


def hash2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 with 20 rounds of the counter words (x1, x2) under the key (k1, k2),
    all uint32 and broadcast together. In lax primitives: a hash is a hundred operations,
    and jnp's operators would trace each several times slower."""
    k1, k2, x1, x2 = jnp.broadcast_arrays(*(jnp.asarray(a, jnp.uint32) for a in (k1, k2, x1, x2)))
    add, xor = jax.lax.add, jax.lax.bitwise_xor
    ks = (k1, k2, xor(xor(k1, k2), _PARITY))
    x1, x2 = add(x1, ks[0]), add(x2, ks[1])
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x1 = add(x1, x2)
            x2 = xor(_rotate_left(x2, r), x1)
        x1 = add(x1, ks[(i + 1) % 3])
        x2 = add(add(x2, ks[(i + 2) % 3]), np.uint32(i + 1))
    return x1, x2


def key(seed: jax.Array) -> jax.Array:
    """Keys of integer seeds [...] below 2 ** 32 (`jax.random.key`)."""
    seed = jnp.asarray(seed)
    if not jnp.issubdtype(seed.dtype, jnp.integer):
        raise TypeError(f"a seed must be an integer, got {seed.dtype}")
    data = jnp.stack([jnp.zeros(seed.shape, jnp.uint32), seed.astype(jnp.uint32)], axis=-1)
    return jax.random.wrap_key_data(data, impl=IMPL)


def fold_in(keys: jax.Array, data: jax.Array | int) -> jax.Array:
    """Keys [...] with integer data [...] folded in, broadcast together (`jax.random.fold_in`
    of each key and its datum)."""
    raw = jax.random.key_data(keys)
    data = jnp.asarray(data).astype(jnp.uint32)
    y1, y2 = hash2x32(raw[..., 0], raw[..., 1], jnp.zeros_like(data), data)
    return jax.random.wrap_key_data(jnp.stack([y1, y2], axis=-1), impl=IMPL)


def _bits(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """32 random bits [*keys.shape, *shape] per key (jax's partitionable layout: the flat
    index of each element hashed as the counter)."""
    raw = jax.random.key_data(keys)
    if int(np.prod(shape)) >= 2 ** 32:
        raise ValueError(f"{shape}: at most 2 ** 32 values per key")
    at = raw.shape[:-1] + (1,) * len(shape)
    count = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
    y1, y2 = hash2x32(raw[..., 0].reshape(at), raw[..., 1].reshape(at), jnp.zeros_like(count), count)
    return y1 ^ y2


def uniform(keys: jax.Array, shape: tuple[int, ...] = (), minval: float = 0.0, maxval: float = 1.0) -> jax.Array:
    """float32 uniforms in [minval, maxval), [*keys.shape, *shape] (`jax.random.uniform` of
    each key): 23 random mantissa bits under the exponent of 1.0, shifted and scaled."""
    mantissa = (_bits(keys, shape) >> np.uint32(9)) | np.uint32(0x3F800000)
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0)
    lo, hi = jnp.float32(minval), jnp.float32(maxval)
    return jnp.maximum(lo, floats * (hi - lo) + lo)


def gumbel(keys: jax.Array, shape: tuple[int, ...] = ()) -> jax.Array:
    """float32 standard Gumbel noise [*keys.shape, *shape] (`jax.random.gumbel` of each key)."""
    return -jnp.log(-jnp.log(uniform(keys, shape, float(jnp.finfo(jnp.float32).tiny), 1.0)))
