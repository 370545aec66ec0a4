"""Bit packing of small integer codes into bytes, pure jnp (runs under jit on any backend).

Layout: the codes along the last axis form one little-endian bit stream: bit j of code i is stream
bit i·bits + j, and byte k holds stream bits 8k..8k+7 with the lowest in its least significant bit.
So for bits in {1, 2, 4, 8} a byte holds 8/bits codes, code i in the lowest bits first; for
bits = 3, each group of 8 codes fills 3 bytes. Any bits in 1..8 works the same way.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

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
    """Inverse of `pack_bits`: packed uint8 [..., n·bits/8] → codes uint8 [..., n]
    (shifts and masks, see `_unpack`)."""
    if packed.dtype != jnp.uint8:
        raise TqjaxError(f"unpack_bits needs uint8 bytes, got {packed.dtype}")
    size = packed_size(n, bits)
    if packed.shape[-1] != size:
        raise TqjaxError(f"{n} codes of {bits} bits take {size} bytes, got shape {packed.shape}")
    return _unpack(packed, bits, packed.ndim - 1)


def _unpack(packed: jax.Array, bits: int, axis: int) -> jax.Array:
    """Codes from the bytes along `axis`: uint8 [..., n·bits/8, ...] → uint8 [..., n, ...].

    Pure broadcasts, shifts and masks (no transpose, gather or bit-stream temporary), so XLA
    fuses it into the consumer. For bits dividing 8 each byte is shifted by every code offset;
    otherwise each group of 8 codes (`bits` bytes) is read as one or two 32-bit words.
    """
    shape, mask = packed.shape, (1 << bits) - 1
    lead, rest = shape[:axis], shape[axis + 1:]
    trail = (1,) * len(rest)  # a vector of offsets broadcast along a new axis at axis + 1

    if 8 % bits == 0:
        shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8).reshape(-1, *trail)
        return ((jnp.expand_dims(packed, axis + 1) >> shifts) & mask).reshape(*lead, -1, *rest)
    if shape[axis] % bits:
        raise TqjaxError(f"{shape[axis]} bytes of {bits}-bit codes are not whole groups of 8")
    p = packed.reshape(*lead, -1, bits, *rest).astype(jnp.uint32)  # [..., n/8, bits, ...]

    def word(first: int, last: int) -> jax.Array:  # bytes first..last-1 as one little-endian word
        return functools.reduce(jnp.bitwise_or, [
            jax.lax.index_in_dim(p, i, axis + 1, keepdims=False) << (8 * (i - first))
            for i in range(first, last)])

    def codes(w: jax.Array, shift: int, count: int) -> jax.Array:  # [..., n/8, count, ...]
        shifts = jnp.arange(shift, shift + count * bits, bits, dtype=jnp.uint32).reshape(-1, *trail)
        return ((jnp.expand_dims(w, axis + 1) >> shifts) & mask).astype(jnp.uint8)

    if bits <= 4:  # the 8 codes fit one 32-bit word
        out = codes(word(0, bits), 0, 8)
    else:  # codes 0..3 and 4..7 from two words (4·bits + 7 <= 32 bits each)
        first, shift = divmod(4 * bits, 8)
        out = jnp.concatenate([codes(word(0, min(4, bits)), 0, 4),
                               codes(word(first, bits), shift, 4)], axis=axis + 1)
    return out.reshape(*lead, -1, *rest)


def unit(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte run of `bits`-bit codes: (2, 1) for 4 bits,
    (8, 3) for 3 bits, (1, 1) for 8."""
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def planar_order(n: int, bits: int) -> np.ndarray:
    """int [n]: the code index at each position of `unpack_planes`' planes concatenated (code j
    of unit u is code u·c + j, c = `unit(bits)`[0])."""
    c, _ = unit(bits)
    return np.arange(n).reshape(n // c, c).T.reshape(-1)


def unpack_planes(packed: jax.Array, bits: int, n: int) -> list[jax.Array]:
    """The codes of `unpack_bits` as planes: plane j holds code j of every whole-byte unit
    (`unit`), uint8 [..., n / c] each; concatenated they are unpack_bits(packed, bits,
    n)[..., planar_order(n, bits)].

    A consumer of one plane reads its bytes in order (one shift and mask); `unpack_bits`'
    interleaved output makes XLA:CPU compute a byte and shift per element (SmolLM2's turbo4
    decode step at 8000 slots, dequantized per plane by `tqjax.kv.quantized`: 150 -> 105 ms;
    concatenating the planes again cost more than it saved; issue 22, stop 39)."""
    size = packed_size(n, bits)
    if packed.shape[-1] != size:
        raise TqjaxError(f"{n} codes of {bits} bits take {size} bytes, got shape {packed.shape}")
    c, ub = unit(bits)
    mask = (1 << bits) - 1
    if ub == 1:  # bits dividing 8: plane j is each byte shifted by j·bits
        return [(packed >> (j * bits)) & mask for j in range(c)]
    p = packed.reshape(*packed.shape[:-1], n // c, ub)

    def plane(j: int) -> jax.Array:  # code j of every unit, uint8 [..., n / c]
        lo, shift = divmod(j * bits, 8)
        hi = (j * bits + bits - 1) // 8
        if hi == lo:
            return (p[..., lo] >> shift) & mask
        word = p[..., lo].astype(jnp.uint16) | (p[..., hi].astype(jnp.uint16) << 8)
        return ((word >> shift) & mask).astype(jnp.uint8)  # the code continues in the next byte

    return [plane(j) for j in range(c)]


def lookup(table: jax.Array, codes: jax.Array) -> jax.Array:
    """table[codes] for a table [2^b] (b <= 8) and integer codes [...] in range. Up to 32
    entries: a tree of b levels of selects on the code bits (exact). XLA:CPU vectorises selects
    but runs a gather element by element: 4-bit codes [1, 3, 8192, 64] took 0.6-0.9 ms against
    3.9-4.4 ms for `jnp.take(..., mode="clip")` (issue 22, stop 37). Larger tables (6-8 bit
    codes, which no cache type uses) are gathered."""
    n = table.shape[0]
    if n & (n - 1) or not 2 <= n <= 256:
        raise TqjaxError(f"lookup tables hold 2..256 (a power of two) entries, got {n}")
    if n > 32:  # a select tree of 64+ leaves would be a larger program than the gather
        return jnp.take(table, codes.astype(jnp.int32), mode="clip")
    vals = [table[i] for i in range(n)]
    bit = 0
    while len(vals) > 1:
        on = (codes >> bit) & 1 != 0
        vals = [jnp.where(on, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
        bit += 1
    return jnp.broadcast_to(vals[0], codes.shape)
