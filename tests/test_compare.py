"""portspeed.parity and `portspeed compare`: tolerance bands, first divergence, exit codes, reports."""

from __future__ import annotations

import copy
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.requires import require

from portspeed.parity import compare as compare_cli
from portspeed.parity.losslog import LossRecord, read_record, record_from_json, write_record
from portspeed.parity.tolerance import (
    DEFAULT_TOLERANCES,
    ParityInputError,
    Tolerance,
    compare,
    pick_tolerance,
    tolerance_for,
)

DATA = Path(__file__).parent / "data"
TP1 = str(DATA / "megatron_fp32_tp1.log")
TP2 = str(DATA / "megatron_fp32_tp2.log")
PP2_BAD = str(DATA / "megatron_fp32_pp2_diverged.log")


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = compare_cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def planted(rec: LossRecord, at: int, delta: float, source: str = "planted") -> LossRecord:
    """A copy of ``rec`` whose loss is shifted by ``delta`` from iteration ``at`` on."""
    new = copy.deepcopy(rec)
    new.source = source
    for it in new.iterations:
        if it.iteration >= at and it.lm_loss is not None:
            it.lm_loss += delta
    return new


def simple(values: dict[int, object], dtype: str | None = None, name: str = "r") -> LossRecord:
    items = []
    for n, v in values.items():
        if v == "skip":
            items.append({"iteration": n, "lm_loss": None, "skipped": True})
        else:
            items.append({"iteration": n, "lm_loss": v})
    return record_from_json({"meta": {"dtype": dtype} if dtype else {}, "iterations": items}, name)


# ----------------------------------------------------------------------------- parity logic

@pytest.mark.parametrize("at", [1, 7, 20])
def test_planted_divergence_is_found_at_its_first_iteration(at):
    """A loss shifted by 1e-4 from iteration k on is reported as first diverging at k, not before."""
    ref = read_record(TP1)
    c = compare(ref, planted(ref, at, 1e-4), tolerance_for("fp32"))
    assert not c.ok
    assert c.first_divergence.iteration == at
    assert c.first_divergence.reason == "out of band"
    assert c.n_failed == 20 - at + 1


def test_identical_and_near_identical_runs_match():
    """A run within print resolution of the reference (TP2 log) matches at the fp32 default."""
    c = compare(read_record(TP1), read_record(TP2), tolerance_for("fp32"))
    assert c.ok and c.first_divergence is None
    assert 0 < c.largest.abs_diff <= 1e-5


def test_largest_deviation_is_reported():
    """The largest finite |diff| and its iteration are reported even when the run diverged."""
    ref = read_record(TP1)
    run = planted(ref, 5, 1e-3)
    run.by_iteration()[12].lm_loss += 0.5
    c = compare(ref, run, tolerance_for("fp32"))
    assert c.first_divergence.iteration == 5
    assert c.largest.iteration == 12
    assert c.largest.abs_diff == pytest.approx(0.501)


def test_band_uses_atol_plus_rtol_times_reference():
    """|a-b| <= atol + rtol*|ref|: a 0.05 shift on a loss near 10 passes at rtol 1e-2 and fails at rtol 1e-3."""
    ref = simple({1: 10.0, 2: 9.0})
    run = simple({1: 10.05, 2: 9.05})
    assert compare(ref, run, Tolerance(0.0, 1e-2)).ok
    c = compare(ref, run, Tolerance(0.0, 1e-3))
    assert not c.ok and c.first_divergence.iteration == 1
    assert c.first_divergence.band == pytest.approx(1e-2)
    assert compare(ref, run, Tolerance(0.06, 0.0)).ok


@pytest.mark.parametrize("a, b, ok, reason", [
    ("skip", "skip", True, "both skipped"),
    ("skip", 5.0, False, "skipped in reference only"),
    (5.0, "skip", False, "skipped in run only"),
    (math.nan, math.nan, True, "both nan"),
    (math.nan, 5.0, False, "nan in reference"),
    (5.0, math.nan, False, "nan in run"),
    (math.inf, math.nan, False, "different non-finite values"),
])
def test_skipped_and_nan_rules(a, b, ok, reason):
    """Skips and NaNs are judged explicitly: the same on both sides is fine, one-sided is a divergence."""
    c = compare(simple({1: 5.0, 2: a}), simple({1: 5.0, 2: b}), Tolerance(1e-5))
    assert c.ok is ok
    assert c.rows[1].reason == reason
    if not ok:
        assert c.first_divergence.iteration == 2


def test_bf16_log_against_itself_with_nan_tail_matches():
    """The bf16 log compared with itself: NaN on both sides from iteration 15 is agreement, not divergence."""
    rec = read_record(DATA / "megatron_bf16_nan.log")
    c = compare(rec, copy.deepcopy(rec), tolerance_for("bf16"))
    assert c.ok
    assert [r.reason for r in c.rows[14:]] == ["both nan"] * 6


def test_mismatched_iterations_are_bad_input():
    """Different logged iterations (here log-interval 5 vs 1) raise ParityInputError listing which."""
    with pytest.raises(ParityInputError, match=r"only the reference has iterations 1-4, 6-9"):
        compare(read_record(TP1), read_record(DATA / "megatron_fp32_interval5.log"), tolerance_for("fp32"))


def test_iteration_window_restricts_the_comparison():
    """--iterations FIRST:LAST compares only that window (the diverged run agrees on 1..6)."""
    c = compare(read_record(TP1), read_record(PP2_BAD), tolerance_for("fp32"), iterations=(1, 6))
    assert c.ok and [r.iteration for r in c.rows] == list(range(1, 7))


def test_tolerance_choice():
    """Defaults come from --dtype, else the loosest dtype among the records, else fp32; atol/rtol override."""
    fp32, bf16, nodt = simple({1: 1.0}, "fp32"), simple({1: 1.0}, "bfloat16"), simple({1: 1.0})
    assert pick_tolerance([nodt, nodt])[0] == DEFAULT_TOLERANCES["fp32"]
    assert "assumed fp32" in pick_tolerance([nodt, nodt])[1]
    assert pick_tolerance([fp32, bf16])[0] == DEFAULT_TOLERANCES["bf16"]
    assert pick_tolerance([fp32, bf16], dtype="fp32")[0] == DEFAULT_TOLERANCES["fp32"]
    tol, origin = pick_tolerance([bf16, bf16], atol=0.5)
    assert (tol.atol, tol.rtol) == (0.5, DEFAULT_TOLERANCES["bf16"].rtol) and "overridden" in origin
    with pytest.raises(ParityInputError, match="atol"):
        Tolerance(-1.0)
    assert DEFAULT_TOLERANCES["fp32"].atol < DEFAULT_TOLERANCES["fp16"].atol < DEFAULT_TOLERANCES["bf16"].atol


# ----------------------------------------------------------------------------- CLI exit codes and outputs

def test_cli_exit_0_when_within_tolerance():
    """Two runs that agree: exit 0 and a MATCH line."""
    code, out, _ = run_cli(TP1, TP2)
    assert code == 0
    assert "MATCH: 20/20" in out


def test_cli_exit_1_names_first_divergence():
    """The diverged PP2 log: exit 1, the verdict names iteration 7."""
    code, out, _ = run_cli(TP1, TP2, PP2_BAD)
    assert code == 1
    assert "DIVERGED at iteration 7" in out
    assert "MATCH: 20/20" in out  # the good run is still reported as matching


def test_cli_atol_override_turns_divergence_into_match():
    """A wide enough --atol accepts the PP2 drift (largest is 0.18), a tighter one does not."""
    assert run_cli(TP1, PP2_BAD, "--atol", "0.2")[0] == 0
    assert run_cli(TP1, PP2_BAD, "--atol", "0.1")[0] == 1


def test_cli_dtype_picks_looser_band():
    """--dtype bf16 widens the default band: the PP2 drift stays within 2e-2 + 1e-2*|ref| until late."""
    code, out, _ = run_cli(TP1, PP2_BAD, "--dtype", "bf16")
    assert code == 1  # 0.18 at iteration 20 is beyond 0.02 + 0.09
    assert "DIVERGED at iteration 19" in out


@pytest.mark.parametrize("args, match", [
    ([TP1, "/no/such/file.log"], "no such file"),
    ([TP1, str(DATA / "megatron_fp32_interval5.log")], "mismatched iteration ranges"),
    ([TP1], "need at least two runs"),
])
def test_cli_exit_2_on_bad_input(args, match):
    """Missing file, mismatched iterations, a single run: exit 2 and a message naming the problem."""
    code, out, err = run_cli(*args)
    assert code == 2
    assert match in err
    assert out == ""


def test_cli_exit_2_on_unknown_format_and_no_loss_lines(tmp_path):
    """A JSON file that is no record and a text file with no loss lines are bad input (exit 2)."""
    odd = tmp_path / "odd.json"
    odd.write_text('{"hello": 1}')
    code, _, err = run_cli(TP1, str(odd))
    assert code == 2 and "not a portspeed loss record" in err
    empty = tmp_path / "train.log"
    empty.write_text("starting\nno losses here\n")
    code, _, err = run_cli(TP1, str(empty))
    assert code == 2 and "no loss lines" in err


@pytest.mark.parametrize("args", [["--atol", "-1"], ["--iterations", "9:3"], ["--iterations", "x"],
                                  ["--metric", "perplexity"]])
def test_cli_exit_2_on_bad_options(args, capsys):
    """Malformed options are usage errors (exit 2), not tracebacks."""
    code, _, _ = run_cli(TP1, TP2, *args)
    assert code == 2
    assert "error" in capsys.readouterr().err


def test_cli_json_and_markdown_reports(tmp_path):
    """--json holds status, tolerance, first divergence and rows; --markdown holds a summary table."""
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    code, _, _ = run_cli(TP1, TP2, PP2_BAD, "--json", str(js), "--markdown", str(md))
    assert code == 1
    rep = json.loads(js.read_text())
    assert rep["status"] == "diverged" and rep["exit_code"] == 1
    assert rep["tolerance"]["atol"] == 1e-5
    good, bad = rep["comparisons"]
    assert good["status"] == "match" and good["first_divergence"] is None
    assert bad["first_divergence"]["iteration"] == 7
    assert bad["largest_deviation"]["iteration"] == 20
    assert len(bad["rows"]) == 20 and bad["iterations_outside"] == 14
    text = md.read_text()
    assert text.startswith("## Loss parity: DIVERGED")
    assert "| lm_loss | **diverged** | 6/20 within | 7 (out of band" in text


def test_cli_grad_norm_metric():
    """--metric grad_norm compares grad norms (the PP2 log's grad norm drifts too)."""
    code, out, _ = run_cli(TP1, PP2_BAD, "--metric", "grad_norm", "--atol", "0.001")
    assert code == 1
    assert "run 1 grad_norm" in out and "DIVERGED at iteration 7" in out


def test_cli_records_and_logs_mix(tmp_path):
    """A JSON record and a Megatron log of the same run compare equal; the record's dtype sets the band."""
    rec = read_record(TP1)
    rec.meta = {"dtype": "fp32", "backend": "gloo", "accelerator": "cpu", "layout": {"tp": 1, "pp": 1, "dp": 1}}
    p = write_record(rec, tmp_path / "tp1.json")
    code, out, _ = run_cli(str(p), TP2)
    assert code == 0
    assert "dtype fp32 from the records' meta" in out
    assert "backend=gloo" in out


def test_cli_long_runs_are_elided_but_keep_the_divergence():
    """With --rows 10 the table is shortened but still shows the first diverging iteration."""
    code, out, _ = run_cli(TP1, PP2_BAD, "--rows", "10")
    table = [ln for ln in out.splitlines() if ln.strip().split(" ")[0].isdigit()]
    shown = [int(ln.split("|")[0]) for ln in table]
    assert 7 in shown and len(shown) < 20


def test_portspeed_command_dispatches_compare():
    """`python -m portspeed.cli compare` runs this tool in a fresh process and returns its exit status."""
    r = subprocess.run([sys.executable, "-m", "portspeed.cli", "compare", TP1, PP2_BAD],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "DIVERGED at iteration 7" in r.stdout


# ----------------------------------------------------------------------------- plotting

def test_plot_written_when_matplotlib_present(tmp_path):
    """--plot writes a PNG of curves and differences."""
    require("matplotlib", "pip install 'portspeed[plot]'")
    png = tmp_path / "cmp.png"
    code, out, _ = run_cli(TP1, TP2, PP2_BAD, str(DATA / "megatron_fp32_tp1.log"), "--plot", str(png))
    assert code == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in out


def test_plot_without_matplotlib_still_compares(tmp_path, monkeypatch):
    """Without matplotlib, --plot prints how to install it and the exit status still comes from the losses."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    code, out, err = run_cli(TP1, TP2, "--plot", str(tmp_path / "x.png"))
    assert code == 0
    assert "pip install 'portspeed[plot]'" in err
    assert not (tmp_path / "x.png").exists()
    assert "MATCH" in out


def test_real_stock_megatron_tp2_matches_tp1():
    """Real stock Megatron-LM logs on CPU, TP1 vs TP2 from one checkpoint: within the fp32 band (exit 0)."""
    code, out, _ = run_cli(str(DATA / "megatron_stock_cpu_tp1.real.log"), str(DATA / "megatron_stock_cpu_tp2.real.log"))
    assert code == 0, out
    assert "MATCH: 10/10" in out
