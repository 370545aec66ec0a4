"""The installed commands ([project.scripts]) and their scripts/ wrappers run the same
`tqjax.commands.<name>.main(argv)`; scripts/results.py plans the committed commands it runs."""

import importlib
import inspect
import runpy
import shutil
import subprocess
import tomllib

import pytest

from .conftest import ROOT
from .test_cli import assert_user_error, run


def entry_points() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def test_entry_points_are_the_scripts_mains():
    points = entry_points()
    assert {"tqjax-quantize", "tqjax-bench-sweep"} <= set(points)
    for name, target in points.items():
        module_name, _, attr = target.partition(":")
        module = importlib.import_module(module_name)
        main = getattr(module, attr)
        assert list(inspect.signature(main).parameters) == ["argv"], name
        script = ROOT / "scripts" / (module_name.rsplit(".", 1)[1] + ".py")
        assert runpy.run_path(str(script))["main"] is main, script


def test_installed_command_is_a_one_line_error(tmp_path):
    exe = shutil.which("tqjax-quantize")
    if exe is None:
        pytest.skip("tqjax-quantize is not installed (pip install -e . installs it)")
    proc = subprocess.run([exe, "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "q")],
                          capture_output=True, text=True, timeout=300)
    assert_user_error(proc, "missing")


def test_main_takes_argv(capsys):
    from tqjax.commands import bench_sweep

    with pytest.raises(SystemExit) as e:
        bench_sweep.main(["--preset", "slots", "--models", "smollm2-135m-instruct",
                          "--dry-run"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all("--kv" in ln for ln in lines)  # f32, turbo4 x 2 slot counts


def test_results_plan():
    proc = run("results.py", "--dry-run", "--only", "golden,weights",
               "--models", "smollm2-135m-instruct")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == ("golden: python scripts/golden_report.py > "
                        "results/current/golden_report.json")
    assert lines[1].startswith("weights: python scripts/weights_table.py --models "
                               "smollm2-135m-instruct ")
    assert "--kv '' " in lines[1]
    assert lines[1].endswith("--out results/current/weights/weights_smollm2.json")
    assert len(lines) == 2
    assert_user_error(run("results.py", "--only", "golden,nope"), "unknown step 'nope'")


def test_help_states_every_default(monkeypatch, capsys):
    """Each command's --help gives every option that has a default (a number, a name) its
    value, and every option some text."""
    import argparse

    from tqjax import cli

    for name, target in entry_points().items():
        parsers = []
        real = argparse.ArgumentParser.parse_args

        def grab(self, args=None, namespace=None, parsers=parsers, real=real):
            parsers.append(self)
            return real(self, ["--help"])

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
        module = importlib.import_module(target.partition(":")[0])
        with pytest.raises(SystemExit) as e:
            module.main([])
        monkeypatch.undo()
        assert e.value.code == 0 and len(parsers) == 1, name
        text = " ".join(capsys.readouterr().out.split())
        text = text[text.index("options:"):]  # not the usage line
        assert isinstance(parsers[0], cli.ArgumentParser), name
        for action in parsers[0]._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            assert action.help, (name, action.option_strings)
            if (action.default is not None and action.default is not False
                    and action.default not in ("", [], argparse.SUPPRESS)):
                shown = action.option_strings[-1]
                entry = text[text.index(shown + " "):]
                assert f"default: {action.default}" in entry[:600] or "default" in action.help, (
                    name, shown)
