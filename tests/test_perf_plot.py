"""`portspeed compare --perf ... --png FILE` on written recordings (no run): what is drawn, and the refusals.

The recordings of real runs are drawn in tests/test_perf.py (its module fixture's planted slow module among the
labels, the slow rank in red); here, recordings written by the test, so each rule of the drawing is checked
against figures the test chose: one bar per part, the named part first and in red, parts with no share left
out, at most ``TOP`` bars; a PNG that matplotlib reads back at the size drawn; without matplotlib a note and
the comparison's own exit status; with a loss comparison or a path that cannot be written, exit 2 in one line.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.requires import require
from portspeed.parity import compare as compare_cli
from portspeed.perf.reading import plot as perf_plot
from portspeed.perf.reading.compare import THRESHOLD_POINTS, compare_runs
from portspeed.perf.reading.recordings import read_run

SIGNATURE = b"\x89PNG\r\n\x1a\n"
GROWN = "decoder.layers.1.mlp"


def _write(folder: Path, shares: dict[str, float], ranks: int = 1) -> Path:
    """Iterations 2-4 of ``ranks`` ranks, each part (forward) taking ``shares[path]`` ms of a step of their sum."""
    folder.mkdir()
    for rank in range(ranks):
        rows = [{"path": p, "phase": "forward", "class": "", "calls": 1, "total_ms": ms, "self_ms": ms, "syncs": {},
                 "copies": {}, "fallbacks": {}, "collective_ms": 0.0, "collectives": 0} for p, ms in shares.items()]
        with open(folder / f"rank{rank}.jsonl", "w") as f:
            for it in (2, 3, 4):
                f.write(json.dumps({"format": "portspeed-perf", "version": 1, "iteration": it, "rank": rank,
                                    "world": ranks, "device": "cpu", "layout": {"tp": ranks, "pp": 1},
                                    "clock": "host", "step_ms": sum(shares.values()), "parts": rows,
                                    "collectives": []}) + "\n")
    return folder


def _pair(tmp_path: Path, n: int = 25) -> tuple[Path, Path]:
    """``n`` parts of 4 ms each, one of them an empty module; on RUN, GROWN takes 60 ms instead of 4."""
    ref = {f"decoder.layers.0.part{i}": 4.0 for i in range(n - 2)} | {GROWN: 4.0, "decoder.empty": 0.0}
    return _write(tmp_path / "ref", ref), _write(tmp_path / "run", ref | {GROWN: 60.0})


def compare(*args: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = compare_cli.main(list(map(str, args)), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def read_back(path: Path) -> tuple[int, int]:
    """The PNG's (width, height) as matplotlib reads it, after its signature is checked."""
    assert path.read_bytes()[:8] == SIGNATURE, path
    import matplotlib.image

    height, width = matplotlib.image.imread(str(path)).shape[:2]
    return width, height


def test_the_part_that_grew_is_drawn_first_in_red_one_bar_per_part(tmp_path: Path) -> None:
    """RUN's GROWN part at 60 of 152 ms vs 4 of 96 on REF: the first bar and the red one; every label a distinct
    part, at most TOP of them, the empty module not drawn; the PNG read back at the size drawn."""
    require("matplotlib", "pip install 'portspeed[plot]'")
    ref_dir, run_dir = _pair(tmp_path)
    ref, run = read_run(str(ref_dir)), read_run(str(run_dir))
    drawn = perf_plot.draw_shares(ref, run, compare_runs(ref, run), THRESHOLD_POINTS, str(tmp_path / "s.png"))
    assert drawn.labels[0] == drawn.highlighted == f"{GROWN} forward", drawn.labels
    assert len(drawn.labels) == perf_plot.TOP == len(set(drawn.labels)), drawn.labels
    assert "decoder.empty forward" not in drawn.labels
    assert "REF ref: cpu, tp1 pp1" in drawn.title and "threshold 10 points" in drawn.title, drawn.title
    assert read_back(tmp_path / "s.png") == drawn.size


def test_png_through_the_command_keeps_the_report_and_its_exit_status(tmp_path: Path) -> None:
    """`compare --perf REF RUN --png FILE`: the same first line and exit 1 as without it, and the PNG; with two
    ranks, each bar names its rank."""
    require("matplotlib", "pip install 'portspeed[plot]'")
    ref_dir, run_dir = _pair(tmp_path)
    plain = compare("--perf", ref_dir, run_dir)
    code, out, err = compare("--perf", ref_dir, run_dir, "--png", tmp_path / "sub" / "s.png")
    assert code == plain[0] == 1 and out.splitlines()[0] == plain[1].splitlines()[0], out + err
    assert out.splitlines()[-1].startswith(f"module shares of REF and RUN: {tmp_path / 'sub' / 's.png'} (15 bars; "
                                           f"in red: {GROWN} forward)"), out
    assert read_back(tmp_path / "sub" / "s.png")[0] > 0
    two = _write(tmp_path / "tp2", {GROWN: 4.0, "decoder": 4.0}, ranks=2)
    drawn = perf_plot.draw_shares(read_run(str(two)), read_run(str(two)), compare_runs(read_run(str(two)),
                                  read_run(str(two))), THRESHOLD_POINTS, str(tmp_path / "t.png"))
    assert drawn.highlighted is None and all(label.endswith(("(rank 0)", "(rank 1)")) for label in drawn.labels)


def test_without_matplotlib_the_comparison_still_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No matplotlib: one note with --plot's install hint, the report and exit 1 unchanged, no file."""
    ref_dir, run_dir = _pair(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code, out, err = compare("--perf", ref_dir, run_dir, "--png", tmp_path / "s.png")
    assert code == 1 and out.startswith(f"slowest part: iteration 3, {GROWN} forward"), out + err
    assert err.count("\n") == 1 and "--png needs matplotlib" in err and "pip install 'portspeed[plot]'" in err, err
    assert not (tmp_path / "s.png").exists()


def test_png_is_refused_in_one_line_off_perf_and_where_it_cannot_be_written(tmp_path: Path) -> None:
    """A loss comparison with --png, and a PNG whose folder is a file: exit 2, one line, nothing printed."""
    require("matplotlib", "pip install 'portspeed[plot]'")
    logs = [Path(__file__).parent / "data" / "megatron_fp32_tp1.log"] * 2
    code, out, err = compare(*logs, "--png", tmp_path / "x.png")
    assert code == 2 and not out and err.count("\n") == 1 and "--png apply to --perf recordings only" in err, err
    ref_dir, run_dir = _pair(tmp_path)
    (tmp_path / "afile").write_text("")
    for args in ((ref_dir, run_dir), (run_dir,)):
        code, out, err = compare("--perf", *args, "--png", tmp_path / "afile" / "s.png")
        assert code == 2 and not out and err.count("\n") == 1, (args, out, err)
        assert f"--png '{tmp_path / 'afile' / 's.png'}' cannot be written" in err, err
