"""The run rule of the fused decode dots (`tqjax.quant.tiling.run_edges`)."""

import pytest

from tqjax.quant import tiling


def _runs(edges: list[int]) -> list[int]:
    return [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]


@pytest.mark.parametrize("pieces,piece_bytes", [(76, 32), (19, 144), (19, 210), (140, 32),
                                                (4864, 1), (35, 256), (3, 5000), (1, 1)])
def test_runs_are_the_fewest_under_the_byte_limit(pieces, piece_bytes):
    edges = tiling.run_edges(pieces, piece_bytes)
    runs = _runs(edges)
    assert edges[0] == 0 and edges[-1] == pieces and all(r > 0 for r in runs)
    per = max(1, (tiling.FUSED_BYTES - 1) // piece_bytes)
    assert max(runs) <= per  # each run under FUSED_BYTES (or one piece over it)
    assert max(runs) * piece_bytes < tiling.FUSED_BYTES or max(runs) == 1
    assert len(runs) == -(-pieces // per)  # no more runs than the limit needs
    assert max(runs) - min(runs) <= 1  # even


def test_a_row_under_the_limit_is_one_run():
    # Qwen2.5-Coder-0.5B's tq4 down projection: 4864 inputs, 76 groups of 32 bytes
    assert tiling.run_edges(76, 32) == [0, 76]
    # the same row in int8 (4864 bytes) needs two runs
    assert tiling.run_edges(4864, 1) == [0, 2432, 4864]


def test_a_value_limit_caps_the_runs_too():
    # Q4_K, 19 blocks of 256 values (144 bytes): 2736 bytes fit one run, 2048 values do not
    edges = tiling.run_edges(19, 144, 256, 2048)
    assert len(edges) - 1 == 3 and max(_runs(edges)) * 256 <= 2048
