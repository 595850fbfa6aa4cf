"""`portspeed compare --probe`: the order entries are judged in, the first line and its context, what must be exact.

Forward first and backward in reverse; ops matched by name inside their module, an op outside every module after
the module before it; identical runs compared rank by rank; NaN counts and shapes exact; msprobe's own dump read
as a one-rank run; exit codes through `portspeed compare` and the pytest plugin; input errors in one line. The
dumps and the layouts they are put on: test_probe_compare.py (helpers.probe_runs writes them).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from helpers.probe_dumps import RankDump, full, meta, partial, stats
from helpers.probe_runs import FC2, fc, off_by, probe, record, truth

from portspeed.probe.reading.dumps import ProbeInputError, read_dump


@pytest.fixture(scope="module")
def tp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record(tmp_path_factory.mktemp("tp1"))


def test_forward_comes_first_and_backward_runs_in_reverse(tp1: Path, tmp_path: Path) -> None:
    """A forward difference in layer 1 beats a backward difference in layer 0 (recorded later in the same
    micro-batch); among backward differences, layer 1's comes before layer 0's."""
    both = off_by(1e-2, lambda k, r: k in {("forward", 0, 1, 2), ("backward", 0, 0, 2)})
    out = probe(tp1, record(tmp_path / "fb", tweak=both))[1]
    assert out.startswith(f"first divergence: iteration 1, micro-batch 0, forward, {fc(1, 2)}, rank 0: ")
    assert f"next differing:\n  iteration 1, micro-batch 0, backward, {fc(0, 2)}, rank 0:" in out
    back = off_by(1e-2, lambda k, r: k in {("backward", 0, 0, 1), ("backward", 0, 1, 1)})
    out = probe(tp1, record(tmp_path / "bb", tweak=back))[1]
    assert out.startswith(f"first divergence: iteration 1, micro-batch 0, backward, {fc(1, 1)}, rank 0: ")


def test_the_first_line_and_its_context(tp1: Path, tmp_path: Path) -> None:
    """The exact first line (the worst statistic, both values, the band), then the last agreeing tensors, the
    next differing ones and the module's parameter gradients."""
    shift = lambda x: x + 1e-3 * x.square().mean().sqrt().item()  # noqa: E731  (moves the Mean by 10 bands)
    run = record(tmp_path / "exact", tweak=lambda k, r, x: shift(x) if k[2:] == (1, 1) and k[0] == "forward" else x)
    code, out, _ = probe(tp1, run)
    assert code == 1
    x = truth(4)[("forward", 0, 1, 1)]
    ref, got = stats(x), stats(shift(x))
    rms = ref["Norm"] / math.sqrt(x.numel())
    lines = out.splitlines()
    assert lines[0] == (f"first divergence: iteration 1, micro-batch 0, forward, {fc(1, 1)}, rank 0: "
                        f"Mean ref {ref['Mean']:.9g} run {got['Mean']:.9g} (band {1e-4 * rms:.3g})")
    i = lines.index("last agreeing:")
    assert [ln.split(", ")[3] for ln in lines[i + 1:i + 4]] == ["embedding", fc(0, 1), fc(0, 2)]
    assert all("agrees (exactly equal)" in ln for ln in lines[i + 1:i + 4])
    j = lines.index("next differing:")
    assert [ln.split(", ")[1] for ln in lines[j + 1:j + 4]] == ["micro-batch 1", "micro-batch 2", "micro-batch 3"]
    assert f"{fc(1, 1)}'s parameters:" in out
    assert re.search(rf"iteration 1, micro-batch all, parameters_grad, {re.escape(fc(1, 1))}, rank\(s\) 0: weight "
                     r"agrees", out), out


def test_ops_are_matched_by_name_inside_their_module(tmp_path: Path) -> None:
    """Op level: the TP2 run's module calls an all_reduce the TP1 run has not; the ops after it still meet theirs
    (the k-th op of a name inside a module), and the first line names the op, #k and the module."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    def write(root: Path, tp: int, off: float = 0.0) -> Path:
        for rank in range(tp):
            r = RankDump(meta(tp=tp, level="op"), rank=rank, tp=rank)
            r.op(fc(0, 2), "linear", [x.chunk(tp, dim=-1)[rank] if tp > 1 else x], layer=0, cls=FC2, index=0,
                 layout=partial("tp") if tp > 1 else full())
            if tp > 1:
                r.op(fc(0, 2), "all_reduce", [x], layer=0, cls=FC2, index=1, layout=full("tp"))
            r.op(fc(0, 2), "gelu", [y, y * (1 + off)], layer=0, cls=FC2, index=tp, layout=full("tp"))
            r.op(fc(0, 2), "gelu", [y * (1 + off)], layer=0, cls=FC2, index=tp + 1, layout=full("tp"))
            r.forward(fc(0, 2), FC2, [y], layer=0, layout=full("tp"))
            r.write(root)
        return root

    ref = write(tmp_path / "tp1", 1)
    code, out, _ = probe(ref, write(tmp_path / "tp2", 2))
    assert code == 0 and "compared 4 tensors" in out, out  # 3 gelu outputs and the module's output
    assert (f"run: a partial sum on each rank (before the reduce) of ops inside {FC2}: compared only between "
            f"identical layouts (1 tensors): {fc(0, 2)} op linear (forward)") in out, out
    assert f"only in the run (1 tensors): {fc(0, 2)} op all_reduce (forward)" in out, out
    code, out, _ = probe(ref, write(tmp_path / "tp2-off", 2, off=1e-3))
    assert code == 1 and out.startswith(
        f"first divergence: iteration 1, micro-batch 0, forward, {fc(0, 2)} op gelu #0, rank 0: output.1 "), out


def test_an_op_outside_every_module_sits_after_the_module_before_it(tmp_path: Path) -> None:
    """The loss's ops run outside every module (the dump's layer -1): they are placed after the last module that
    finished before them, so a difference in layer 1 is named before the loss op it feeds."""
    g = torch.Generator().manual_seed(8)
    t = [torch.randn(4, 8, generator=g) for _ in range(4)]

    def write(root: Path, off: float) -> Path:
        r = RankDump(meta(level="op"))
        r.op("", "randint", [t[0]], layer=-1)  # the data, before any module
        r.forward(fc(0, 2), FC2, [t[1]], layer=0)
        r.forward(fc(1, 2), FC2, [t[2] * (1 + off)], layer=1)
        r.op("", "cross_entropy", [t[3] * (1 + off)], layer=-1)
        r.write(root)
        return root

    code, out, _ = probe(write(tmp_path / "a", 0.0), write(tmp_path / "b", 1e-2))
    assert code == 1 and out.startswith(f"first divergence: iteration 1, micro-batch 0, forward, {fc(1, 2)}, rank 0: ")
    assert "next differing:\n  iteration 1, micro-batch 0, forward, op cross_entropy #0, rank 0: " in out, out


def test_identical_runs_compare_rank_by_rank_as_a_device_pair(tmp_path: Path) -> None:
    """Same layout, another device: a device pair, every rank against the same rank, exit 0; an output off by
    2e-4 relative (twice the fp32 band) on one rank is named there."""
    a = record(tmp_path / "a", tp=2, dp=2)
    assert probe(a, record(tmp_path / "b", tp=2, dp=2, device="testdev", noise=1e-7))[0] == 0
    code, out, _ = probe(a, record(tmp_path / "c", tp=2, dp=2, device="testdev",
                                   tweak=off_by(2e-4, lambda k, r: k == ("forward", 3, 0, 1) and r == 3)))
    assert code == 1 and out.startswith(f"first divergence: iteration 1, micro-batch 1, forward, {fc(0, 1)}, rank 3: ")


def test_nan_counts_and_shapes_must_match_exactly(tp1: Path, tmp_path: Path) -> None:
    """One NaN in a layer's output is named by its count; a shape that differs is named as the shape."""
    def nan(key: tuple, rank: int, x: torch.Tensor) -> torch.Tensor:
        if key == ("forward", 0, 0, 2):
            x = x.clone()
            x[0, 0, 0] = math.nan
        return x
    out = probe(tp1, record(tmp_path / "nan", tweak=nan))[1]
    assert out.startswith(f"first divergence: iteration 1, micro-batch 0, forward, {fc(0, 2)}, rank 0: "
                          "nan count ref 0 run 1 (must match)")
    short = lambda k, r, x: x[:-1] if k == ("forward", 0, 0, 2) else x  # noqa: E731
    out = probe(tp1, record(tmp_path / "shape", tweak=short))[1]
    assert out.startswith(f"first divergence: iteration 1, micro-batch 0, forward, {fc(0, 2)}, rank 0: "
                          "shape ref [4, 2, 8] run [3, 2, 8] (must match)")


def test_msprobes_own_dump_reads_as_a_one_rank_run(tp1: Path, tmp_path: Path) -> None:
    """A dump in msprobe's own layout (proc<pid>, step0, no portspeed meta, statistics only) compares by key
    with a one-rank portspeed dump; against a two-rank run it is refused."""
    src = json.loads((tp1 / "step1" / "rank0" / "dump.json").read_text())
    data = {k: {f: v for f, v in e.items() if not f.startswith("ps_")} for k, e in src["data"].items()}
    for e in data.values():
        for t in [*e.get("output", []), *e.get("input", []), *e.get("weight", [])]:
            for f in ("ps_nan", "ps_inf", "ps_layout"):
                t.pop(f)
    d = tmp_path / "ms" / "step0" / "proc4242"
    d.mkdir(parents=True)
    (d / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L0", "framework": "pytorch",
                                             "dump_data_dir": None, "data": data}))
    assert not read_dump(tmp_path / "ms").portspeed
    code, out, _ = probe(tmp_path / "ms", tp1)
    assert code == 0 and "msprobe's own dump" in out, out
    code, _, err = probe(tmp_path / "ms", record(tmp_path / "tp2", tp=2))
    assert code == 2 and "compare it with a one-rank run" in err
    nested = tmp_path / "nested" / "step1" / "rank0"  # portspeed's entry keys in one field, as msprobe's compare needs
    nested.mkdir(parents=True)
    src["data"] = {k: {**{f: v for f, v in e.items() if not f.startswith("ps_")},
                       "ps": {f: v for f, v in e.items() if f.startswith("ps_")}} for k, e in src["data"].items()}
    (nested / "dump.json").write_text(json.dumps(src))
    code, out, _ = probe(tp1, tmp_path / "nested")
    assert code == 0 and "not compared" not in out and "compared 40 tensors" in out, out


def test_exit_codes_through_portspeed_compare(tp1: Path, tmp_path: Path) -> None:
    """0 agree, 1 diverged, 2 bad input (one line on stderr); --json writes the report; loss options refused."""
    assert probe(tp1, tp1)[0] == 0
    bad = record(tmp_path / "bad", tweak=off_by(1e-3, lambda k, r: k[0] == "parameters_grad"))
    code, out, _ = probe(tp1, bad, "--json", str(tmp_path / "r.json"))
    assert code == 1 and out.startswith("first divergence: iteration 1, micro-batch all, parameters_grad, ")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["exit_code"] == 1 and rep["first_line"] == out.splitlines()[0]
    code, _, err = probe(tp1, tmp_path / "nowhere")
    assert code == 2 and err.count("\n") == 1 and "no such folder" in err
    code, _, err = probe(tp1, bad, "--atol", "1e-3")
    assert code == 2 and "--atol compare losses, not probe dumps" in err
    assert probe(tp1, bad, "--rtol", "1e-2")[0] == 0  # every band widened to 1e-2


def test_a_parity_failure_in_pytest_carries_the_first_divergence_line(tp1: Path, tmp_path: Path) -> None:
    """assert_losses_match (the pytest plugin): when both runs were probed, a loss failure starts with the first
    divergence line; probes=True fails on probes that part while the losses agree; one probed run is said."""
    from portspeed.parity.losslog import IterationLoss, LossRecord
    from portspeed.parity.pytest_plugin import _check

    def rec(losses: list[float], probe: Path | None) -> LossRecord:
        r = LossRecord([IterationLoss(i, v, 1.0) for i, v in enumerate(losses, 1)], {"dtype": "fp32"})
        if probe is not None:
            r.probe_dir = str(probe)
        return r
    bad = record(tmp_path / "bad", tp=2, tweak=off_by(1e-3, lambda k, r: k == ("forward", 0, 1, 2) and r == 1))
    with pytest.raises(AssertionError) as e:
        _check(rec([5.0, 4.0], bad), rec([5.0, 4.1], tp1), None, None, None, "lm_loss", "the expected run")
    msg = str(e.value).splitlines()
    assert msg[0].startswith(f"first divergence: iteration 1, micro-batch 0, forward, {fc(1, 2)}, rank 1: ")
    assert msg[1] == "losses do not match the expected run:"
    _check(rec([5.0, 4.0], bad), rec([5.0, 4.0], tp1), None, None, None, "lm_loss", "x")  # losses agree: passes
    with pytest.raises(AssertionError, match="losses match x, the probes do not:\nfirst divergence: "):
        _check(rec([5.0, 4.0], bad), rec([5.0, 4.0], tp1), None, None, None, "lm_loss", "x", probes=True)
    with pytest.raises(AssertionError, match="probe: only the expected run was probed"):
        _check(rec([5.0, 4.0], None), rec([5.0, 4.1], tp1), None, None, None, "lm_loss", "x")


def test_probe_errors_are_one_line(tmp_path: Path) -> None:
    """The reader's refusals: a file, an empty folder, a non-probe folder, a torn dump.json."""
    (tmp_path / "f").write_text("x")
    (tmp_path / "empty").mkdir()
    torn = tmp_path / "torn" / "step1" / "rank0"
    torn.mkdir(parents=True)
    (torn / "dump.json").write_text('{"data": {')
    for p, words in [(tmp_path / "f", "not a folder"), (tmp_path / "empty", "not a probe dump"),
                     (tmp_path / "torn", "not JSON")]:
        with pytest.raises(ProbeInputError, match=words) as e:
            read_dump(p)
        assert "\n" not in str(e.value)
