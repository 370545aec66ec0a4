"""Every script's bad-input paths end in one line on stderr and exit 2 (no traceback): a model
directory without a tokenizer, a missing report or reference file, an unwritable --out, and
running out of memory (the shared runner, `tqjax.cli.run_main`). One subprocess per case, each
on the tiny golden Llama (no tokenizer.json) or before any model is loaded."""

import os
import shutil
import subprocess
import sys

import pytest

from .conftest import GOLDEN, ROOT
from .test_cli import assert_user_error, run

TINY = GOLDEN / "tiny" / "llama"  # config + weights, no tokenizer


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("notok") / "llama"
    shutil.copytree(TINY, d)
    assert not (d / "tokenizer.json").exists() and not (d / "tokenizer.model").exists()
    return d


@pytest.fixture
def not_a_folder(tmp_path):
    """A path whose 'folder' is a regular file: unwritable for every user, root included."""
    f = tmp_path / "file"
    f.write_text("x")
    return f


@pytest.mark.parametrize("script,args", [
    ("perplexity.py", ["--max-tokens", "64", "--ctx-size", "32"]),
    ("needle.py", ["--caches", "f32", "--depths", "0.5", "--filler-tokens", "64"]),
    ("capture_kv.py", ["--tokens", "16", "--out-prefix", "{tmp}/kv"]),
    ("kv_table.py", ["--texts", "shakespeare:hamlet", "--types", "q8", "--out", "{tmp}/kv.jsonl"]),
    ("weights_table.py", ["--texts", "shakespeare:hamlet", "--runs", "int8", "--kv", "",
                          "--out", "{tmp}/w.json"]),
    ("generate.py", ["--prompt", "hi"]),
])
def test_model_without_a_tokenizer(script, args, no_tokenizer, tmp_path):
    model_flag = "--models" if script in ("kv_table.py", "weights_table.py") else "--model"
    args = [a.format(tmp=tmp_path) for a in args]
    assert_user_error(run(script, model_flag, no_tokenizer, *args), "tokenizer")


def test_gguf_without_a_vocabulary(tmp_path):
    """A GGUF with weights but no `tokenizer.ggml.*` keys loads without a tokenizer (it was a
    KeyError traceback), so text generation ends in the one-line tokenizer error."""
    from .test_loading import write_gguf

    path = tmp_path / "weights_only.gguf"
    write_gguf("llama", path)
    assert_user_error(run("generate.py", "--model", path, "--prompt", "hi",
                          "--max-new-tokens", "2"), "tokenizer")


@pytest.mark.parametrize("script,args,needle", [
    ("weights_table.py", ["--report", "{tmp}/missing.json"], "not a weights_table json"),
    ("kv_table.py", ["--report", "{tmp}/missing.jsonl"], "not a kv_table jsonl"),
    ("kv_table.py", ["--report", "{tmp}/bad.jsonl"], "not a kv_table jsonl"),
    ("golden_report.py", ["--golden", "{tmp}"], "no golden reference data"),
    ("golden_report.py", ["--golden", "{tmp}/golden"], "missing golden reference file"),
    ("plot.py", ["--bench", "{tmp}/missing"], "no bench folder"),
    ("plot.py", ["--bench", "{tmp}", "--weights-json", "{tmp}/missing.json"],
     "no such weights json"),
])
def test_missing_or_foreign_report_file(script, args, needle, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"model": "m"}\n')
    (tmp_path / "golden" / "tiny").mkdir(parents=True)
    shutil.copytree(TINY, tmp_path / "golden" / "tiny" / "llama")  # no real/ references
    args = [a.format(tmp=tmp_path) for a in args]
    assert_user_error(run(script, *args), needle)


@pytest.mark.parametrize("script,args", [
    ("kv_table.py", ["--models", TINY, "--out", "{out}/kv.jsonl"]),
    ("weights_table.py", ["--models", TINY, "--out", "{out}/w.json"]),
    ("plot.py", ["--bench", "{tmp}", "--weights-json", "--out", "{out}/docs"]),
    ("quantize.py", ["--model", TINY, "--weights", "int8", "--calibration", "none",
                     "--out", "{out}/ckpt"]),
])
def test_unwritable_out(script, args, not_a_folder, tmp_path):
    args = [str(a).format(out=not_a_folder, tmp=tmp_path) for a in args]
    proc = run(script, *args)
    assert_user_error(proc, str(not_a_folder).lower())  # "Not a directory" / "File exists"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert_user_error(run("kv_table.py", "--models", TINY, "--out", ro / "kv.jsonl"),
                          "permission denied")
    finally:
        ro.chmod(0o755)


RUNNER = """
import sys
from tqjax.cli import run_main
def main():
    if sys.argv[1] == "host":
        return len(bytearray(1 << 62))  # 4 EiB: malloc fails, Python raises MemoryError
    if sys.argv[1] == "xla":
        import jax.numpy as jnp
        return int(jnp.ones(1 << 42, jnp.float32).sum())  # 16 TiB: RESOURCE_EXHAUSTED
    if sys.argv[1] == "tokenizer":
        import tqjax
        return len(tqjax.load(sys.argv[2]).tokenizer.encode("hi"))
    return {}["a bug"]  # not the user's doing: the traceback stays
run_main(main)
"""


def run_fragment(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", RUNNER, *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("kind,needle", [("host", "out of memory"),
                                         ("xla", "resource_exhausted"),
                                         ("tokenizer", "no tokenizer")])
def test_runner_turns_memory_and_tokenizer_failures_into_one_line(kind, needle):
    assert_user_error(run_fragment(kind, TINY), needle)


def test_runner_keeps_the_traceback_of_a_bug():
    proc = run_fragment("bug")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "KeyError" in proc.stderr
