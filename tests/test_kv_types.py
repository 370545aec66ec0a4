"""The one K[/V] cache-type parser (`tqjax.kv.cache.parse_kv`) and the CLI flags built on it."""

from __future__ import annotations

import pytest

from tqjax.cli import cache_spec
from tqjax.commands.generate import parse_args
from tqjax.errors import TqjaxError
from tqjax.kv.cache import BASELINES, STORE_FACTORIES, parse_kv


@pytest.mark.parametrize("text,expected", [
    ("turbo4", ("turbo4", "turbo4")),
    ("turbo4/turbo3", ("turbo4", "turbo3")),
    ("q4_0h", ("q4_0h", "q4_0h")),
    (" f32 / q8_0 ", ("f32", "q8_0")),
    ("turbo4/", ("turbo4", "turbo4")),
])
def test_parse_kv(text, expected):
    assert parse_kv(text) == expected


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
    (["--kv", "q4_0h", "--kv-aids"], "q4_0h", "q4_0h", True),
])
def test_cache_spec_flags(argv, k, v, aids):
    spec = cache_spec(parse_args(argv))
    assert (spec.k, spec.v, spec.baseline_aids) == (k, v, aids)


def test_help_lists_every_cache_type(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse may wrap at a hyphen
    for name in STORE_FACTORIES:
        assert f"{name}," in text or f"{name})" in text, name
    assert "--kv-aids" in text and all(b in text for b in BASELINES)
