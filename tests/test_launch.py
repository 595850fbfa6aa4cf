"""`portspeed run`: torchrun's launcher with the adaptor imported in every worker before the script."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from helpers.launch import Result, run_python
from helpers.requires import require

from portspeed.cli import run as launch

TIMEOUT = 180  # seconds; a hung launch fails instead of hanging CI

PROBE = textwrap.dedent(
    """
    import json, multiprocessing, os, sys


    def spawned(path):
        # runs in a spawn child: defined in the script, so the child must re-create __main__
        with open(path, "w") as f:
            json.dump({"adaptor": "probe_pkg.probe_adaptor" in sys.modules, "name": __name__}, f)


    if __name__ == "__main__":
        out = sys.argv[sys.argv.index("--out") + 1]
        rank = int(os.environ["RANK"])
        record = {
            "rank": rank,
            "world_size": int(os.environ["WORLD_SIZE"]),
            "name": __name__,
            "argv": sys.argv,
            "path0": sys.path[0],
            "adaptors": sorted(m for m in sys.modules if m.endswith("_adaptor")),
            "marker": getattr(sys.modules.get("probe_pkg.probe_adaptor"), "IMPORTED_BEFORE_SCRIPT", None),
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
        if "--spawn" in sys.argv and rank == 0:
            child = multiprocessing.get_context("spawn").Process(target=spawned,
                                                                 args=(os.path.join(out, "child.json"),))
            child.start()
            child.join(120)
        if "--fail-on-rank1" in sys.argv and rank == 1:
            sys.exit(3)
    """
)


def _pythonpath(first: Path) -> dict[str, str]:
    """PYTHONPATH with ``first`` ahead of this process's."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(first), os.environ.get("PYTHONPATH", "")) if p)}


def _portspeed_run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Result:
    """``python -m portspeed.cli run args...`` in ``cwd`` (its process group killed at TIMEOUT); not checked."""
    return run_python(["-m", "portspeed.cli", "run", *args], timeout=TIMEOUT, env=env, cwd=cwd)


@pytest.fixture()
def probe(tmp_path: Path) -> Path:
    """A probe script plus a tiny adaptor package that marks itself imported."""
    (tmp_path / "probe.py").write_text(PROBE)
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe_adaptor.py").write_text("IMPORTED_BEFORE_SCRIPT = True\n")
    (tmp_path / "out").mkdir()
    return tmp_path


@pytest.mark.multiproc
def test_two_workers_import_the_adaptor_then_run_the_script_as_main(probe: Path) -> None:
    """Each of 2 workers has the adaptor imported and sees the script's own argv, __main__ and folder;
    a child it spawns (multiprocessing spawn) imports the adaptor before re-running the script's top level."""
    out = probe / "out"
    res = _portspeed_run(
        ["--nproc-per-node", "2", "--adaptor", "probe_pkg.probe_adaptor", "probe.py", "--out", str(out), "--spawn"],
        cwd=probe, env=_pythonpath(probe),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, rec in enumerate(records):
        assert rec["rank"] == r and rec["world_size"] == 2
        assert rec["name"] == "__main__"
        assert rec["marker"] is True, "the adaptor was not imported before the script ran"
        assert rec["argv"][1:] == ["--out", str(out), "--spawn"]
        assert Path(rec["argv"][0]).name == "probe.py"
        assert Path(rec["path0"]) == probe
    child = json.loads((out / "child.json").read_text())
    assert child == {"adaptor": True, "name": "__mp_main__"}, "a spawned child did not import the adaptor first"


@pytest.mark.multiproc
def test_default_adaptor_is_the_megatron_adaptor(probe: Path) -> None:
    """Without --adaptor, workers import portspeed.megatron_adaptor (here with the script given as -m MODULE)."""
    require("megatron.core", "pip install 'portspeed[megatron]'")
    out = probe / "out"
    res = _portspeed_run(["--nproc-per-node", "1", "-m", "probe", "--out", str(out)], cwd=probe, env=_pythonpath(probe))
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((out / "rank0.json").read_text())
    assert "portspeed.megatron_adaptor" in rec["adaptors"]
    assert rec["name"] == "__main__" and rec["argv"][1:] == ["--out", str(out)]


@pytest.mark.multiproc
def test_a_failing_worker_fails_the_launch(probe: Path) -> None:
    """A worker exiting non-zero makes `portspeed run` exit 1 and name the failure."""
    out = probe / "out"
    res = _portspeed_run(
        ["--nproc-per-node", "2", "--adaptor", "none", "probe.py", "--out", str(out), "--fail-on-rank1"],
        cwd=probe,
    )
    assert res.returncode == 1
    assert "a worker failed" in res.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node", "2", "no_such_script.py"], "training script 'no_such_script.py' not found"),
        (["--no-python", "probe.py"], "--no-python runs TRAINING_SCRIPT as an executable"),
        (["--run-path", "probe.py"], "--run-path runs the script inside torchrun's own process"),
        (["--adaptor", "bogus", "probe.py"], "--adaptor 'bogus' is neither a known adaptor"),
        (["--adaptor", "no_such_pkg.adaptor", "probe.py"], "adaptor module 'no_such_pkg.adaptor' cannot be found"),
        (["-m", "no_such_module_xyz"], "-m 'no_such_module_xyz': no such module"),
    ],
)
def test_bad_command_lines_are_refused_with_a_reason(
    probe: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bad input exits 2 before any worker starts, with a message naming the problem."""
    monkeypatch.chdir(probe)
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_missing_script_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """No TRAINING_SCRIPT at all: argparse's usage error, exit 2."""
    assert launch.main(["--nproc-per-node", "2"]) == 2
    assert "training_script" in capsys.readouterr().err


def test_worker_command_keeps_the_script_and_its_arguments() -> None:
    """The rewrite hands the script, its args and -m mode to the worker, after '--'."""
    args = launch.build_parser().parse_args(["--nproc-per-node", "2", "-m", "pkg.train", "--lr", "1"])
    launch.worker_command(args, "portspeed.megatron_adaptor")
    assert args.module is True and args.training_script == "portspeed.cli.worker"
    assert args.training_script_args == ["--adaptor", "portspeed.megatron_adaptor", "--module", "--", "pkg.train",
                                         "--lr", "1"]
