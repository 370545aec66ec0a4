"""The one K[/V] cache-type parser (`tqjax.kv.cache.parse_kv`) and the CLI flags built on it."""

from __future__ import annotations

import runpy

import pytest

from tqjax.cli import cache_spec
from tqjax.commands.generate import parse_args
from tqjax.errors import TqjaxError
from tqjax.kv.cache import (
    NAIVE,
    STORE_FACTORIES,
    CacheSpec,
    as_cache_spec,
    check_spec,
    parse_kv,
)

from .conftest import ROOT


@pytest.mark.parametrize("text,expected", [
    ("turbo4", ("turbo4", "turbo4")),
    ("turbo4/turbo3", ("turbo4", "turbo3")),
    ("q4_0h", ("q4_0h", "q4_0h")),
    (" f32 / q8_0 ", ("f32", "q8_0")),
    ("turbo4/", ("turbo4", "turbo4")),
])
def test_parse_kv(text, expected):
    assert parse_kv(text) == expected
    # a CacheSpec of the key type alone reads the same ("turbo4" alone was turbo4 keys and
    # f32 values, the README's Session example among its users)
    assert CacheSpec(*expected) == as_cache_spec(text)
    if expected[0] == expected[1]:
        assert CacheSpec(expected[0]) == CacheSpec(k=expected[0]) == as_cache_spec(text)


@pytest.mark.parametrize("text,needle", [
    ("", "expected K or K/V"), ("/turbo3", "expected K or K/V"),
    ("turbo4/turbo3/q8", "expected K or K/V"), ("turbo9", "unknown cache type 'turbo9'"),
    ("turbo4/q5", "unknown cache type 'q5'"),
])
def test_parse_kv_errors(text, needle):
    with pytest.raises(TqjaxError, match=needle):
        parse_kv(text)


@pytest.mark.parametrize("argv,k,v,aids", [
    ([], "f32", "f32", False),
    (["--kv"], "turbo4", "turbo4", False),
    (["--kv", "turbo4/turbo3"], "turbo4", "turbo3", False),
    (["--kv", "turbo4", "--cache-type-v", "q8"], "turbo4", "q8", False),
    (["--cache-type-k", "q8_0"], "q8_0", "q8_0", False),
    (["--cache-type-v", "q4_0"], "q4_0", "q4_0", False),
    (["--kv", "q4_0h"], "q4_0h", "q4_0h", False),
])
def test_cache_spec_flags(argv, k, v, aids):
    spec = cache_spec(parse_args(argv))
    assert (spec.k, spec.v, spec.baseline_aids) == (k, v, aids)


@pytest.mark.parametrize("flag", ["--kv-naive", "--kv-aids"])
def test_study_switches_are_not_user_options(flag, capsys):
    """The ablations (robustness off, aids for the baselines) are kv_table.py's `:naive` and
    `:aids`, not options of the programs users run."""
    with pytest.raises(SystemExit) as e:
        parse_args(["--kv", "turbo4", flag])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_kv_table_flags_are_the_study_switches():
    parse_type = runpy.run_path(str(ROOT / "scripts" / "kv_table.py"))["parse_type"]
    assert parse_type("q4_0h:aids") == ("q4_0h:aids", {"k": "q4_0h", "v": "q4_0h",
                                                        "baseline_aids": True})
    label, kwargs = parse_type("turbo4/turbo3:naive")
    assert kwargs == {"k": "turbo4", "v": "turbo3", **NAIVE}
    spec = CacheSpec(**kwargs)
    assert (spec.recent_tokens, spec.sink_tokens, spec.center_keys, spec.balance_keys) == (
        0, 0, False, False)
    with pytest.raises(TqjaxError, match="unknown flag 'aid'"):
        parse_type("q4_0:aid")


def test_help_lists_every_cache_type(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse may wrap at a hyphen
    for name in STORE_FACTORIES:
        assert f"{name}," in text or f"{name})" in text, name
    assert "--kv-recent" in text and "--kv-boundary-layers" in text
    assert "--kv-naive" not in text and "--kv-aids" not in text


@pytest.mark.parametrize("fields,needle", [
    (dict(seed=-1), "rotation seed must be >= 0"),  # (numpy's generator failed inside make_cache)
    (dict(recent_tokens=2.5), "recent tokens must be an integer"),
    (dict(sink_tokens="4"), "sink tokens must be an integer"),
    (dict(boundary_layers=None), "boundary layers must be an integer"),
])
def test_cache_spec_fields_are_checked(fields, needle):
    with pytest.raises(TqjaxError, match=needle):
        check_spec(CacheSpec("turbo4", **fields))


def test_a_turbo_type_that_cannot_pack_the_head_dim_says_so():
    """head_dim 8 (qwen2_gqa7) with turbo2.5 / 3.5 / 4.5: the packing's own words ("4 codes
    of 3 bits do not fill whole bytes") named neither the cache type nor the head dim."""
    from tqjax.kv.cache import StoreShape

    for name in ("turbo2.5", "turbo3.5", "turbo4.5"):
        with pytest.raises(TqjaxError, match=rf"{name} cache cannot pack a head dim of 8 "):
            STORE_FACTORIES[name](StoreShape(batch=1, kv_heads=1, slots=4, head_dim=8,
                                             layer=0))
        STORE_FACTORIES[name](StoreShape(batch=1, kv_heads=1, slots=4, head_dim=16, layer=0))
