"""The shared TurboQuant core: rotations, Lloyd–Max codebooks, bit packing and the quantizers."""

from tqjax.quant.codebook import Codebook, coordinate_density, lloyd_max
from tqjax.quant.packing import pack_bits, packed_size, unpack_bits
from tqjax.quant.rotation import Rotation, hadamard_transform, make_rotation, rotate, unrotate
from tqjax.quant.turboquant import (
    ProdQuantizer,
    SplitQuantizer,
    TurboQuantizer,
    bits_per_value,
    dequantize,
    dequantize_prod,
    dequantize_rotated,
    distortion,
    make_prod_quantizer,
    make_quantizer,
    make_split_quantizer,
    quantize,
    quantize_prod,
    reconstruct,
)

__all__ = [
    "Codebook",
    "ProdQuantizer",
    "Rotation",
    "SplitQuantizer",
    "TurboQuantizer",
    "bits_per_value",
    "coordinate_density",
    "dequantize",
    "dequantize_prod",
    "dequantize_rotated",
    "distortion",
    "hadamard_transform",
    "lloyd_max",
    "make_prod_quantizer",
    "make_quantizer",
    "make_rotation",
    "make_split_quantizer",
    "pack_bits",
    "packed_size",
    "quantize",
    "quantize_prod",
    "reconstruct",
    "rotate",
    "unpack_bits",
    "unrotate",
]
