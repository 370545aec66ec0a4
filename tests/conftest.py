import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# In-process CLI entry points (tqjax.cli.run_main) would otherwise switch on XLA's persistent
# compilation cache for the rest of the pytest process; writing some of the suite's executables
# to it crashed CI (SIGSEGV in compilation_cache.put_executable_and_time).
os.environ.setdefault("TQJAX_XLA_CACHE", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-large", action="store_true",
                     help="also run the tests marked `large` (see pyproject.toml)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Compile with most of XLA's optimizations off (`jax_disable_most_optimizations`: LLVM at
    level 0, its expensive passes off; XLA's own HLO passes, fusion and layouts run as in the
    product) for the tests of tiny models, and as the product does for those that run a real
    model (marked `slow`, or reading one through `real_model`). Set before the test's fixtures,
    and in the environment for the processes a test starts. Compiling is most of a tiny-model
    test's time; a real model's compute is slower without the optimizations by more than its
    compile saves (SmolLM2's mixed-4.25 regression: 700 s against 197). With the tiny tests
    compiled so, the suite took 1387 s instead of 1919 (`tests/test_stacked_cache.py` 276 ->
    117 s of test time; 2-core AMD EPYC, docs/research.md stop 58)."""
    import jax

    fast = (item.get_closest_marker("slow") is None
            and "real_model" not in getattr(item, "fixturenames", ()))
    jax.config.update("jax_disable_most_optimizations", fast)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1" if fast else "0"


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    _heaviest_files_first(items)
    if config.getoption("--run-large") or os.environ.get("TQJAX_TEST_LARGE") == "1":
        return
    skip = pytest.mark.skip(reason="large model: --run-large or TQJAX_TEST_LARGE=1 runs it")
    for item in items:
        if "large" in item.keywords:
            item.add_marker(skip)


def _heaviest_files_first(items: list) -> None:
    """Order the test files by their real-model (`slow`) tests, then by their number of tests,
    most first, each file's own order kept. The xdist workers take whole files (`--dist
    loadfile`, pyproject.toml) in this order, so the long files start first and the short ones
    fill in at the end (xdist's own order, by number of tests only, started the real-model
    files last and left one worker idle for minutes)."""
    weight: dict[str, list[int]] = {}
    for item in items:
        w = weight.setdefault(item.nodeid.split("::")[0], [0, 0])
        w[0] += item.get_closest_marker("slow") is not None
        w[1] += 1
    rank = {f: i for i, f in enumerate(sorted(weight, key=lambda f: (-weight[f][0],
                                                                     -weight[f][1], f)))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: keeps each file's


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN


@pytest.fixture(scope="session")
def real_model():
    """real_model(name) -> `tqjax.load(name)` of a registered real checkpoint, loaded once per
    session and shared by every test that reads it (Qwen2.5-Coder-0.5B takes ~25 s to load and
    dequantize here). Tests must not modify what they get (they make copies, e.g. with
    dataclasses.replace); the model's own caches (KV calibration, cache metas) fill once."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            import tqjax

            loaded[name] = tqjax.load(name)
        return loaded[name]

    yield get
    loaded.clear()


@pytest.fixture
def keep_quantizer_programs(monkeypatch):
    """The quantizer keeps the programs it compiles (`quantize_params` drops them at each stage
    and every `KEPT_PROGRAMS` formats, so that none stays beside a loaded model): for tests of
    what it computes, not of its memory, where the drops would compile every format again at
    each stage and call (a tiny "mixed" quantized twice: 41 s, 23 s with the programs kept).
    The module's programs still go at its end (`_free_compiled_programs`)."""
    from tqjax.models import quantize

    monkeypatch.setattr(quantize, "drop_programs", lambda: None)


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs(request):
    """Drop JAX's compiled programs after each test module. Every XLA CPU executable keeps ~3
    memory mappings for its code; the whole suite in one process compiles enough of them to
    reach Linux's vm.max_map_count (65530), after which a compile's mmap fails and XLA crashes
    (SIGSEGV in CI at ~70% of the suite)."""
    yield
    import gc

    import jax

    before = _mapped_regions()
    jax.clear_caches()
    gc.collect()
    log = os.environ.get("TQJAX_TEST_MAPS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{request.module.__name__} {before} {_mapped_regions()}\n")
