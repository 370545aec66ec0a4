"""Bit packing of small integer codes into bytes, pure jnp (runs under jit on any backend).

Layout: the codes along the last axis form one little-endian bit stream: bit j of code i is stream
bit i·bits + j, and byte k holds stream bits 8k..8k+7 with the lowest in its least significant bit.
So for bits in {1, 2, 4, 8} a byte holds 8/bits codes, code i in the lowest bits first; for
bits = 3, each group of 8 codes fills 3 bytes. Any bits in 1..8 works the same way.
"""

import functools

import jax
import jax.numpy as jnp

from tqjax.errors import TqjaxError


def packed_size(n: int, bits: int) -> int:
    """Bytes holding n codes of `bits` bits each; n·bits must be a multiple of 8."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise TqjaxError(f"packing bits must be an integer in 1..8, got {bits!r}")
    if n * bits % 8:
        raise TqjaxError(f"{n} codes of {bits} bits do not fill whole bytes (n·bits % 8 != 0)")
    return n * bits // 8


def _bit_weights(count: int) -> jax.Array:
    return jnp.left_shift(jnp.uint8(1), jnp.arange(count, dtype=jnp.uint8))


@functools.partial(jax.jit, static_argnames=("bits",))
def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Pack codes uint8 [..., n] (each < 2^bits) into uint8 [..., n·bits/8].

    Bits of a code at or above `bits` are dropped. Raises TqjaxError unless n·bits % 8 == 0.
    """
    if codes.dtype != jnp.uint8:
        raise TqjaxError(f"pack_bits needs uint8 codes, got {codes.dtype}")
    size = packed_size(codes.shape[-1], bits)
    stream = (codes[..., None] & _bit_weights(bits)) != 0  # [..., n, bits] bool
    stream = stream.reshape(*codes.shape[:-1], size, 8).astype(jnp.uint8)
    return jnp.sum(stream * _bit_weights(8), axis=-1, dtype=jnp.uint8)


@functools.partial(jax.jit, static_argnames=("bits", "n"))
def unpack_bits(packed: jax.Array, bits: int, n: int) -> jax.Array:
    """Inverse of `pack_bits`: packed uint8 [..., n·bits/8] → codes uint8 [..., n]."""
    if packed.dtype != jnp.uint8:
        raise TqjaxError(f"unpack_bits needs uint8 bytes, got {packed.dtype}")
    size = packed_size(n, bits)
    if packed.shape[-1] != size:
        raise TqjaxError(f"{n} codes of {bits} bits take {size} bytes, got shape {packed.shape}")
    stream = (packed[..., None] & _bit_weights(8)) != 0  # [..., size, 8] bool
    stream = stream.reshape(*packed.shape[:-1], n, bits).astype(jnp.uint8)
    return jnp.sum(stream * _bit_weights(bits), axis=-1, dtype=jnp.uint8)
