"""Pallas (Triton dialect) kernels for the hot paths: `dequant_matmul` (quantized linears) and
`turbo_attention` (decode attention over the packed cache), plus the `backend` switch.

The ground layer beside `tqjax.quant`: nothing here imports `tqjax.kv` or `tqjax.models`.
"""
