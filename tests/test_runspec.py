"""portspeed.parity.runspec: `portspeed compare SPEC.json` launches the runs it lists and compares them."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from portspeed.parity import compare as compare_cli
from portspeed.parity.runspec import RunFailedError, SpecError, run_one, spec_from_json

DATA = Path(__file__).parent / "data"
TRAIN = str(DATA / "tiny_ddp_train.py")
TP1 = str(DATA / "megatron_fp32_tp1.log")
TP2 = str(DATA / "megatron_fp32_tp2.log")


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return compare_cli.main(list(argv), out=out, err=err), out.getvalue(), err.getvalue()


def write_spec(tmp_path: Path, spec: dict) -> str:
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(spec))
    return str(p)


def cat(path: str) -> list[str]:
    """A command that prints a file (stands for a stock Megatron run that writes no record)."""
    return ["{python}", "-c", f"print(open({path!r}).read())"]


@pytest.mark.multiproc
def test_spec_matrix_launches_real_runs_and_finds_planted_divergence(tmp_path):
    """1-rank reference vs a 2-rank torchrun run (match) vs a run whose step 4 update is perturbed (diverges at 5)."""
    torchrun = ["{python}", "-m", "torch.distributed.run", "--nproc-per-node", "{nproc}", "--master-addr",
                "127.0.0.1", "--master-port", "{port}", TRAIN, "--iters", "6", "--perturb-at", "{perturb}"]
    spec = {
        "timeout": 120,
        "runs": [{"name": "single", "command": ["{python}", TRAIN, "--iters", "6", "--loss-log", "{record}"]}],
        "matrix": {"name": "dp{nproc}-perturb{perturb}", "command": torchrun,
                   "axes": {"layout": [{"nproc": 2, "perturb": 0}, {"nproc": 1, "perturb": 4}]}},
    }
    js = tmp_path / "report.json"
    code, out, err = run_cli(write_spec(tmp_path, spec), "--workdir", str(tmp_path / "runs"), "--json", str(js))
    assert code == 1, out + err
    rep = json.loads(js.read_text())
    dp2, perturbed = rep["comparisons"]
    assert dp2["run_meta"]["name"] == "dp2-perturb0" and dp2["run_meta"]["layout"]["dp"] == 2
    assert dp2["status"] == "match"
    # iteration 4's loss is computed before its (perturbed) update, so iteration 5 is the first to differ
    assert perturbed["first_divergence"]["iteration"] == 5
    assert [r["ok"] for r in perturbed["rows"]][:4] == [True] * 4
    assert (tmp_path / "runs" / "dp2-perturb0.log").exists()


def test_spec_runs_without_record_are_read_from_their_log(tmp_path):
    """A run that writes no record but prints Megatron lines (a stock run) is read from its captured log."""
    spec = {"runs": [{"name": "tp1", "command": cat(TP1)}, {"name": "tp2", "command": cat(TP2)}], "timeout": 60}
    code, out, err = run_cli(write_spec(tmp_path, spec), "--workdir", str(tmp_path / "w"))
    assert code == 0, err
    assert "MATCH: 20/20" in out


def test_spec_reference_can_be_named(tmp_path):
    """"reference": NAME puts that run first, whatever the listing order."""
    spec = spec_from_json({"runs": [{"name": "a", "command": ["x"]}, {"name": "b", "command": ["y"]}],
                           "reference": "b"})
    assert [r.name for r in spec.runs] == ["b", "a"]


def test_failed_run_is_exit_2_with_log_tail(tmp_path):
    """A run exiting non-zero stops the comparison with exit 2, naming the run and showing its last lines."""
    spec = {"runs": [{"name": "good", "command": cat(TP1)},
                     {"name": "bad",
                      "command": ["{python}", "-c", "import sys; print('boom at step 3'); sys.exit(3)"]}]}
    code, _, err = run_cli(write_spec(tmp_path, spec), "--workdir", str(tmp_path / "w"))
    assert code == 2
    assert "run bad: exited with status 3" in err and "boom at step 3" in err


def test_run_past_its_timeout_is_killed(tmp_path):
    """A hanging run is killed at its timeout and reported, instead of hanging the tool."""
    from portspeed.parity.runspec import RunSpec
    run = RunSpec("hang", ["{python}", "-c", "import time; print('waiting', flush=True); time.sleep(120)"], timeout=2)
    with pytest.raises(RunFailedError, match=r"still running after 2s, killed(.|\n)*waiting"):
        run_one(run, tmp_path)


def test_run_with_no_losses_is_an_error(tmp_path):
    """Exit 0 but no record and no iteration lines: the message says to write the record."""
    from portspeed.parity.runspec import RunSpec
    with pytest.raises(RunFailedError, match="wrote no loss record"):
        run_one(RunSpec("quiet", ["{python}", "-c", "print('done')"]), tmp_path)


@pytest.mark.parametrize("spec, match", [
    ([], "JSON object"),
    ({"runs": [{"name": "a", "command": ["x"]}]}, "at least two"),
    ({"runs": [{"name": "a", "command": ["x"]}, {"name": "a", "command": ["y"]}]}, "duplicate run names"),
    ({"runs": [{"name": "a b", "command": ["x"]}, {"command": ["y"]}]}, "may only use"),
    ({"runs": [{"command": "python train.py"}, {"command": ["y"]}]}, "list of strings"),
    ({"runs": [{"name": "a", "command": ["x"]}, {"name": "b", "command": ["y"]}], "timeout": -5}, "positive number"),
    ({"runs": [], "colour": 1}, "unknown keys"),
    ({"matrix": {"command": ["x"], "axes": {"tp": []}}}, "non-empty list"),
    ({"matrix": {"command": ["x"], "axes": {"tp": [1, 2]}, "name": "{pp}"}}, r"unknown placeholder \{pp\}"),
    ({"runs": [{"name": "a", "command": ["x"]}, {"name": "b", "command": ["y"]}], "reference": "c"}, "not a run name"),
])
def test_spec_validation_names_the_field(spec, match):
    """Malformed specs are refused before anything is launched, naming the field."""
    with pytest.raises(SpecError, match=match):
        spec_from_json(spec, "spec.json")


def test_unknown_placeholder_in_command_is_reported_at_launch(tmp_path):
    """A command placeholder that is neither an axis nor a built-in is named, with the known ones."""
    from portspeed.parity.runspec import RunSpec
    with pytest.raises(SpecError, match=r"unknown placeholder \{tp\}.*known: \[.*'record'"):
        run_one(RunSpec("a", ["{python}", "--tp", "{tp}"]), tmp_path)


def test_matrix_expands_in_axis_order():
    """Axes multiply out in order; object-valued axes contribute their keys as placeholders."""
    spec = spec_from_json({"matrix": {"command": ["t", "--tp", "{tp}"], "env": {"PORTSPEED_BACKEND": "{backend}"},
                                      "axes": {"backend": ["gloo", "standin"], "layout": [{"tp": 1}, {"tp": 2}]}}})
    assert [r.values for r in spec.runs] == [{"backend": "gloo", "tp": 1}, {"backend": "gloo", "tp": 2},
                                             {"backend": "standin", "tp": 1}, {"backend": "standin", "tp": 2}]
    assert [r.name for r in spec.runs] == ["backend=gloo,tp=1", "backend=gloo,tp=2",
                                           "backend=standin,tp=1", "backend=standin,tp=2"]
    assert spec.runs[0].env == {"PORTSPEED_BACKEND": "{backend}"}  # filled at launch, like the command


def test_setup_steps_run_first_and_are_not_compared(tmp_path):
    """'setup' commands run before the runs (e.g. writing a shared checkpoint) and need no record."""
    shared = tmp_path / "shared.txt"
    make = ["{python}", "-c", f"open({str(shared)!r}, 'w').write(open({TP1!r}).read())"]
    spec = {"setup": [{"name": "init", "command": make}],
            "runs": [{"name": "a", "command": cat(str(shared))}, {"name": "b", "command": cat(TP2)}]}
    code, out, err = run_cli(write_spec(tmp_path, spec), "--workdir", str(tmp_path / "w"))
    assert code == 0, err
    assert "[setup] init" in err
    assert "MATCH: 20/20" in out
    with pytest.raises(SpecError, match="duplicate run names"):
        spec_from_json({"setup": [{"name": "a", "command": ["x"]}], **{k: spec[k] for k in ("runs",)}})
