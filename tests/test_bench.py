"""scripts/bench.py, bench_sweep.py and plot.py: the bytes-per-step and roofline arithmetic
against a hand computation on the tiny Llama, the JSON schema, one-line errors for bad flags,
the sweep's plan and skipping, and the plots. No timing is asserted."""

import json
import runpy
import shutil
import subprocess

import pytest

from .conftest import GOLDEN
from .test_cli import assert_user_error, run

TINY = GOLDEN / "tiny" / "llama"  # untied head, 2 layers, 2 KV heads of 16, vocab 256, d 64
SIZES = ("--prompt-tokens", 8, "--context", 32, "--decode-tokens", 2, "--repeats", 1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from .test_cli import make_byte_tokenizer

    d = tmp_path_factory.mktemp("tiny") / "llama"
    shutil.copytree(TINY, d)
    make_byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def bench_json(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tiny" / "run.json"
    proc = run("bench.py", "--model", tiny_model, *SIZES, "--bandwidth", 10, "--out", out,
               "--peers", "hf", "--label", "context")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = json.loads(out.read_text())
    assert printed == saved
    return saved


def test_bench_bytes_per_step_by_hand(bench_json):
    """Parameter bytes from the safetensors file, the untied embedding counted one row, the f32
    cache's live bytes from the shapes."""
    from safetensors.numpy import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    cfg = json.loads((TINY / "config.json").read_text())
    hd, vocab, d = cfg["head_dim"], cfg["vocab_size"], cfg["hidden_size"]
    params = 4 * sum(t.size for t in tensors.values()) + 4 * hd // 2  # + rope inv_freq, f32
    embed = 4 * vocab * d
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * hd * 4  # K+V, f32
    live_length = 32 + 3 + (2 - 1) / 2  # timed steps at positions 34, 35 read 35, 36 tokens
    t = bench_json["tqjax"]
    assert t["param_bytes"] == params
    assert t["param_read_bytes"] == params - embed + embed // vocab
    assert t["live_length"] == live_length
    assert t["live_cache_bytes"] == round(per_token * live_length)
    assert t["bytes_per_step"] == t["param_read_bytes"] + t["live_cache_bytes"]
    roof_s = t["bytes_per_step"] / 10e9
    assert t["roofline_ms_per_token"] == pytest.approx(1000 * roof_s, abs=1e-3)
    assert t["roofline_fraction"] == pytest.approx(
        roof_s / (t["decode_ms_per_token"] / 1000), rel=1e-3, abs=1e-4)


def test_bench_json_schema(bench_json):
    import jax

    r = bench_json
    assert r["schema"] == "tqjax-bench/1" and r["label"] == "context"
    assert len(r["commit"]) == 40 and isinstance(r["dirty"], bool)
    assert r["jax"] == jax.__version__
    assert r["machine"]["cpu_count"] >= 1 and r["machine"]["cpu"]
    assert r["bandwidth"]["copy_gbps"] == 10
    assert (r["prompt_tokens"], r["context"], r["decode_tokens"]) == (8, 32, 2)
    assert r["slots"] == 32 + 2 + 2
    assert r["kv"] == "f32" and r["weights"] == "none" and r["weights_loaded"] == "dense"
    assert (r["tp"], r["devices"]) == (1, 1)  # (a TP run is told apart from one device)
    t = r["tqjax"]
    for key in ("prefill_tok_s", "decode_tok_s", "decode_ms_per_token", "cache_alloc_bytes",
                "load_s", "roofline_tok_s"):
        assert t[key] > 0, key
    assert t["cache_alloc_bytes"] == r["config"]["layers"] * 2 * 2 * 16 * 4 * r["slots"]
    assert t["peak_rss_bytes"] >= t["rss_after_load_bytes"] > t["rss_start_bytes"] > 0
    assert len(t["decode_tok_s_runs"]) == 1
    assert r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    # HF on a weights-only directory without transformers, or a real run: never a crash
    hf = r["peers"]["hf"]
    assert "decode_tok_s" in hf or "note" in hf or "error" in hf


def test_bench_slots(tiny_model):
    proc = run("bench.py", "--model", tiny_model, *SIZES, "--slots", 200, "--bandwidth", 10)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["slots"] == 200
    assert r["tqjax"]["cache_alloc_bytes"] == 2 * 2 * 2 * 16 * 4 * 200
    assert r["tqjax"]["live_length"] == 32 + 3 + 0.5  # the live context, not the allocation


@pytest.mark.parametrize("args, needle", [
    (("--slots", 10), "--slots 10 is too few"),
    (("--context", 4), "shorter than --prompt-tokens"),
    (("--peers", "hf,vllm"), "unknown peer 'vllm'"),
    (("--bandwidth", 0), "--bandwidth: must be a finite number > 0"),
    (("--bandwidth", "inf"), "--bandwidth: must be a finite number > 0"),  # (a ZeroDivisionError
    (("--bandwidth", "nan"), "--bandwidth: must be a finite number > 0"),  # / NaN in the JSON)
    (("--repeats", 0), "must be >= 1"),
    (("--context", 300), "exceeds the model's 256 positions"),
])
def test_bench_bad_flags(tiny_model, args, needle):
    base = dict(zip(SIZES[::2], SIZES[1::2], strict=True)) | {"--bandwidth": 10}
    base |= dict(zip(args[::2], args[1::2], strict=True))
    proc = run("bench.py", "--model", tiny_model, *[x for kv in base.items() for x in kv])
    assert_user_error(proc, needle.lower())


def test_roofline_arithmetic():
    bench = runpy.run_module("tqjax.commands.bench")
    # 1 GB at 10 GB/s is 0.1 s; measured 0.2 s per step -> half the roofline, 10 tok/s at best
    assert bench["roofline"](1e9, 10.0, 0.2) == {
        "roofline_ms_per_token": 100.0, "roofline_tok_s": 10.0, "roofline_fraction": 0.5}
    assert bench["mean_live_length"](1000, 1) == 1003


def test_bench_counts_a_shared_buffer_once():
    """A quantized format's lut is one buffer shared by every linear of the format: bench's
    param_bytes counted it per linear (6 KB over the planner's exact count for SmolLM2 int8).
    Bench now counts bytes with `accounting.unique_bytes`, as `params_bits` does."""
    import inspect

    import jax.numpy as jnp

    from tqjax.commands import bench
    from tqjax.quant.accounting import unique_bytes

    lut, a, b = jnp.zeros(256, jnp.float32), jnp.zeros((4, 8), jnp.uint8), jnp.zeros(3)
    assert unique_bytes({"a": (a, lut), "b": (b, lut)}) == 32 + 1024 + 12
    assert unique_bytes([a, jnp.zeros((4, 8), jnp.uint8)]) == 64
    source = inspect.getsource(bench)
    assert "tree_bytes" not in source and source.count("unique_bytes(") == 4


def test_missing_peer_is_a_note(monkeypatch):
    monkeypatch.setenv("LLAMA_BENCH", "/nonexistent/llama-bench")  # no binary fallback either
    bench = runpy.run_module("tqjax.commands.bench")
    bench["PEER_MODULES"]["llamacpp"] = ("no_such_module_tqjax",)
    note = bench["run_peer"]("llamacpp", "x.gguf", 8, 8, 1, 1)
    assert set(note) == {"note"} and "no_such_module_tqjax" in note["note"]
    bench["PEER_MODULES"]["llamacpp"] = ("json",)  # installed: the model is checked next
    assert bench["run_peer"]("llamacpp", "/some/dir", 8, 8, 1, 1) == {
        "note": "llama.cpp needs a .gguf model"}


def test_llamacpp_peer_runs_llama_bench_when_the_package_is_missing(tmp_path, monkeypatch):
    """Without llama-cpp-python, the llamacpp peer runs llama.cpp's llama-bench ($LLAMA_BENCH):
    its command line, the JSON rows it prints read back, a failure as a one-line error."""
    rows = [{"n_prompt": 8, "n_gen": 0, "avg_ts": 100.0, "build_commit": "abc",
             "build_number": 7, "type_k": "f16", "type_v": "f16"},
            {"n_prompt": 0, "n_gen": 4, "avg_ts": 40.0, "samples_ts": [39.0, 41.0],
             "build_commit": "abc", "build_number": 7, "type_k": "f16", "type_v": "f16"}]
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncat <<'J'\n{json.dumps(rows)}\nJ\n")
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_BENCH", str(fake))
    bench = runpy.run_module("tqjax.commands.bench")
    bench["PEER_MODULES"]["llamacpp"] = ("no_such_module_tqjax",)
    got = bench["run_peer"]("llamacpp", "m.gguf", 8, 8, 4, 2)
    assert (got["prefill_tok_s"], got["decode_tok_s"], got["decode_ms_per_token"]) == (
        100.0, 40.0, 25.0)
    assert got["decode_tok_s_runs"] == [39.0, 41.0] and "abc" in got["version"]
    args = (tmp_path / "args").read_text().split()
    assert args[:6] == ["-m", "m.gguf", "-p", "8", "-n", "4"] and args[-4:-2] == ["-r", "2"]
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    assert bench["run_peer"]("llamacpp", "m.gguf", 8, 8, 4, 2) == {
        "error": "error: failed to load model"}
    # output that is not llama-bench's JSON rows: an error for the peer, not an exception
    # that loses the whole run's measurement
    for out in ("not json", json.dumps(rows[:1]), json.dumps({"a": 1}), "[1]"):
        fake.write_text(f"#!/bin/sh\ncat <<'J'\n{out}\nJ\n")
        got = bench["run_peer"]("llamacpp", "m.gguf", 8, 8, 4, 2)
        assert set(got) == {"error"} and "not the JSON expected" in got["error"], (out, got)


def test_sweep_plan_and_skip(tmp_path):
    import argparse

    from tqjax.cli import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    choices = next(a.choices for a in p._actions if "--weights" in a.option_strings)
    proc = run("bench_sweep.py", "--preset", "context,slots,weights,peers", "--quick",
               "--models", "smollm2-135m-instruct", "--out", tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    names = [ln.split()[1] for ln in lines]
    assert all(ln.startswith("todo") for ln in lines)
    kvs = {ln.split("--kv ")[1].split()[0] for ln in lines}
    assert kvs == {"f32", "bf16", "turbo4", "turbo4/turbo3"}
    weights = {ln.split("--weights ")[1].split()[0] for ln in lines if "--weights " in ln}
    assert weights and weights <= set(choices)
    assert any("--slots 2048" in ln for ln in lines)
    assert any("--peers hf,llamacpp" in ln for ln in lines)
    assert len(names) == len(set(names))
    # a saved run is skipped only where it was made at this commit, clean, on this CPU
    from tqjax.commands.provenance import git_info, machine_info

    git = git_info()
    here = {"commit": git["commit"], "dirty": False, "machine": {"cpu": machine_info()["cpu"]}}
    made = [here, here | {"commit": "0" * 40}, here | {"dirty": True},
            here | {"machine": {"cpu": "another CPU"}}, {}]
    for name, saved in zip(names, made, strict=False):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(saved))
    (tmp_path / names[len(made)]).write_text("not JSON")
    proc = run("bench_sweep.py", "--preset", "context,slots,weights,peers", "--quick",
               "--models", "smollm2-135m-instruct", "--out", tmp_path, "--dry-run")
    states = [ln.split()[0] for ln in proc.stdout.strip().splitlines()]
    if git["commit"] is None or git["dirty"] is not False:  # no run counts as this code's
        assert states == ["todo"] * len(states)
    else:
        assert states[0] == "saved" and states[1:] == ["todo"] * (len(states) - 1)
        assert "1 already saved" in proc.stderr


def test_sweep_bad_flags_and_overrides(tmp_path):
    assert_user_error(run("bench_sweep.py", "--preset", "context,nope", "--dry-run"),
                      "unknown preset 'nope'")
    assert_user_error(run("bench_sweep.py", "--repeats", "0", "--dry-run"), "must be >= 1")
    for flag, value in (("--timeout", "-5"), ("--timeout", "0"), ("--bandwidth", "inf")):
        assert_user_error(run("bench_sweep.py", flag, value, "--dry-run"),
                          f"{flag}: must be a finite number > 0")
    a_file = tmp_path / "a_file"
    a_file.write_text("")  # refused before the bandwidth is measured and the first run made
    assert_user_error(run("bench_sweep.py", "--preset", "slots", "--out", a_file),
                      f"cannot write --out {a_file}")
    proc = run("bench_sweep.py", "--preset", "slots", "--decode-tokens", 16, "--repeats", 2,
               "--out", tmp_path, "--dry-run")
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4  # f32 and turbo4 in 1k- and 16k-slot caches
    assert all("--decode-tokens 16 --repeats 2" in ln and "_d16_" in ln for ln in lines)


def test_plot(bench_json, tmp_path):
    pytest.importorskip("matplotlib")
    bench = tmp_path / "bench" / "tiny"
    bench.mkdir(parents=True)
    for context, rate in ((32, 100.0), (64, 80.0)):
        run_ = json.loads(json.dumps(bench_json))
        run_["context"], run_["tqjax"]["decode_tok_s"] = context, rate
        run_["slots"] = context + 4
        (bench / f"c{context}.json").write_text(json.dumps(run_))
    (bench / "x.failed.json").write_text(json.dumps({"error": "boom"}))
    rows = [{"model": "tiny", "text": "t", "run": r, "kv": "f32/f32", "bpw": b, "dppl_pct": d}
            for r, b, d in (("f32", 32.0, 0.0), ("tq4", 4.25, 3.0), ("int8", 8.0, 0.2))]
    weights = tmp_path / "w.json"
    weights.write_text(json.dumps({"rows": rows}))
    out = tmp_path / "docs"
    proc = run("plot.py", "--bench", tmp_path / "bench", "--weights-json", weights,
               "--out", out)
    assert proc.returncode == 0, proc.stderr
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert written["runs"] == 2
    names = {p.split("/")[-1] for p in written["written"]}
    assert names == {"bench_decode_vs_context.png", "bench_rss_vs_context.png",
                     "weights_dppl_vs_bits.png"}
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_user_error(run("plot.py", "--bench", tmp_path / "nowhere"), "no bench folder")
    (tmp_path / "empty").mkdir()  # (it drew nothing and exited 0)
    assert_user_error(run("plot.py", "--bench", tmp_path / "empty", "--weights-json",
                          "--out", tmp_path / "png"), "nothing to draw")
    # a truncated or foreign JSON is one line naming the file (it was a traceback)
    weights.write_text('{"rows": 5')
    assert_user_error(run("plot.py", "--bench", tmp_path / "bench", "--weights-json", weights,
                          "--out", out), f"cannot read {weights} (corrupt?)")
    weights.write_text('{"foo": 1}')
    assert_user_error(run("plot.py", "--bench", tmp_path / "bench", "--weights-json", weights,
                          "--out", out), 'has no "rows" list')
    for bad, needle in (('{"schema": "tqjax-be', "(corrupt?)"), ("[1, 2]", "expected a json dict")):
        (bench / "bad.json").write_text(bad)
        assert_user_error(run("plot.py", "--bench", tmp_path / "bench", "--weights-json",
                              "--out", out), needle)


def test_plot_defaults_draw_the_committed_results(tmp_path):
    """`results.py --only plots` runs plot.py with its defaults: every weights table in
    results/current/weights (it once named tables that are not there, and failed)."""
    pytest.importorskip("matplotlib")
    root = GOLDEN.parent
    tables = sorted((root / "results" / "current" / "weights").glob("weights_*.json"))
    proc = run("plot.py", "--bench", root / "results" / "current" / "bench", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    written = {p.split("/")[-1] for p in report["written"]}
    assert ("weights_dppl_vs_bits.png" in written) == bool(tables)
    assert "bench_decode_vs_context.png" in written


def test_bench_serve_reports_a_server_that_completes_nothing(tmp_path):
    """A server whose stream is not JSON events: the run's JSON is strict JSON (null, not NaN,
    for the empty latency summaries), names the error, and the exit status is 1 (it was 0, or
    an UnboundLocalError traceback when a ValueError came out of the run)."""
    import http.server
    import threading

    class Server(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = b"data: {not json\n\ndata: [DONE]\n\n"
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        proc = run("bench_serve.py", "--url", url, "--requests", 2, "--clients", 1, "--rate", 0,
                   "--out", tmp_path / "s.json")
    finally:
        server.shutdown()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "no request completed" in proc.stderr

    def no_nan(name: str) -> None:
        raise AssertionError(f"{name} in the JSON")

    got = json.loads((tmp_path / "s.json").read_text(), parse_constant=no_nan)
    assert (got["completed"], got["failed"]) == (0, 2)
    assert got["ttft_ms"] == {"mean": None, "p50": None, "p99": None}
    assert got["errors"] == ["not a JSON event: 'data: {not json'"]
    assert_user_error(run("bench_serve.py", "--url", url, "--prompt-words", 10**6),
                      "--prompt-words must be <")


def test_an_installed_copy_records_no_commit_of_the_repository_around_it(tmp_path):
    """From a wheel, tqjax lives in site-packages; a venv inside the user's own repository
    recorded that repository's HEAD as tqjax's commit (found by QA). Only a checkout's own
    `.git` counts; the version is always recorded."""
    import tqjax
    from tqjax.commands.provenance import git_info, source_checkout

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=u", "-c", "user.email=u@x",
                    "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    site = tmp_path / "venv" / "site-packages"
    site.mkdir(parents=True)
    assert git_info(site) == {"tqjax": tqjax.__version__, "commit": None, "dirty": None}
    assert git_info(tmp_path)["commit"] is not None  # (the repository itself is one)
    here = source_checkout()  # the tests run from the checkout
    assert here is not None and (here / "tqjax" / "__init__.py").is_file()
    assert git_info()["commit"] == git_info(here)["commit"]
