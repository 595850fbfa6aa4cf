"""`portspeed compare --probe`: probe dumps put on one layout exactly, judged in a fixed order, named in one line.

Synthetic dumps (tests/helpers/probe_dumps.py, the format of docs/probe-format.md) hold float64
statistics of real tensors: one "true" iteration of a two-layer model (per micro-batch and layer,
a column-parallel and a row-parallel output, their gradients, the weights' gradients), recorded
as a TP1 run would and as TP2 / DP2 / PP2 / EP2 runs would (halves, copies, other ranks). So
every rule is checked against numbers computed here independently.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from helpers.probe_dumps import RankDump, full, meta, partial, split, stats
from helpers.probe_runs import FC1, FC2, HIDDEN, LAYERS, fc, off_by, probe, record, truth

from portspeed.probe.reading.compare import compare_dumps
from portspeed.probe.reading.dumps import TensorStats, merge


@pytest.fixture(scope="module")
def tp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record(tmp_path_factory.mktemp("tp1"))


# ------------------------------------------------------------------ combining split statistics


def test_split_statistics_combine_exactly_into_the_whole_tensors() -> None:
    """Max of maxes, min of mins, count-weighted means and root-summed squares of the parts equal the whole
    tensor's float64 statistics (torch), also for uneven parts, an empty part and non-finite elements."""
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(6, 3, 10, generator=g) * 5
    whole[2, 1, 7] = math.inf
    cases = [(list(whole.chunk(2, dim=-1)), -1), (list(whole.split([1, 2, 3], dim=0)), 0),
             ([whole[:, :0], whole], 1)]
    for parts, dim in cases:
        merged = merge([TensorStats(**_ts(p, dim)) for p in parts], shape=tuple(whole.shape))
        x = whole.to(torch.float64)
        assert merged.max == x.max().item() and merged.min == x.min().item()
        assert merged.numel == whole.numel() and merged.inf == 1 and merged.nan == 0
        assert merged.norm == math.inf and merged.mean == math.inf
    finite = whole.clone()
    finite[2, 1, 7] = 0.25
    x = finite.to(torch.float64)
    for parts in (finite.chunk(2, dim=-1), finite.split([1, 2, 3], dim=0), finite.chunk(3, dim=1)):
        merged = merge([TensorStats(**_ts(p, 0)) for p in parts])
        assert merged.max == x.max().item() and merged.min == x.min().item()
        assert merged.mean == pytest.approx(x.mean().item(), rel=1e-14, abs=1e-15)
        assert merged.norm == pytest.approx(x.norm().item(), rel=1e-14)
    nan = finite.clone()
    nan[0, 0, 0] = math.nan
    merged = merge([TensorStats(**_ts(p, 0)) for p in nan.chunk(2, dim=0)])
    assert merged.nan == 1 and math.isnan(merged.max) and math.isnan(merged.norm)


def _ts(t: torch.Tensor, dim: int) -> dict:
    s = stats(t, split("tp", dim=dim))
    return dict(dtype=s["dtype"], shape=tuple(s["shape"]), max=s["Max"], min=s["Min"], mean=s["Mean"],
                norm=s["Norm"], nan=s["ps_nan"], inf=s["ps_inf"], layout="split", groups=("tp",), dims=(("tp", dim),))


# ------------------------------------------------------------------ layouts


def test_clean_tp2_dp2_pp2_runs_agree_with_tp1(tp1: Path, tmp_path: Path) -> None:
    """TP2 (halves joined, copies rank by rank), DP2 (both sampler orders) and PP2 runs, with fp32-sized
    reduction noise, agree with TP1: exit 0, and every tensor of the reference was compared."""
    for name, kw in [("tp2", dict(tp=2, noise=1e-7)), ("dp2", dict(dp=2)), ("dp2-single", dict(dp=2, order="single")),
                     ("pp2", dict(pp=2)), ("tp2dp2", dict(tp=2, dp=2, noise=1e-7))]:
        code, out, err = probe(tp1, record(tmp_path / name, **kw))
        assert code == 0, (name, out, err)
        assert out.startswith("no divergence: ") and "not compared" not in out, (name, out)
        report = compare_dumps(tp1, tmp_path / name)
        assert len(report.compared) == len(report.results) == 4 * (1 + 4 + 4) + 4, name


def test_dp_sampler_order_decides_the_matching(tp1: Path, tmp_path: Path) -> None:
    """Megatron's `single` sampler (rank r call j = j*DP + r) recorded but declared `contiguous`: micro-batches
    are matched wrongly and the first one differs; declared right, all agree."""
    code, out, _ = probe(tp1, record(tmp_path / "wrong", dp=2, order="single", declared_order="contiguous"))
    assert code == 1 and out.startswith("first divergence: iteration 1, micro-batch 1, forward, embedding, rank 0:")
    assert probe(tp1, record(tmp_path / "right", dp=2, order="single"))[0] == 0


def test_a_cyclic_sampler_compares_only_per_iteration_entries(tp1: Path, tmp_path: Path) -> None:
    """`cyclic`: per-micro-batch entries cannot be matched; the parameter gradients are compared, and the
    report says why the rest is not. With per-micro-batch entries alone nothing is left: bad input."""
    code, out, _ = probe(tp1, record(tmp_path / "cyc", dp=2, order="cyclic"))
    assert code == 0, out
    assert "note: the run's micro-batches cannot be matched (dp_order 'cyclic' with 2 data-parallel ranks)" in out
    assert "compared 4 tensors (8 rank pairs)" in out
    code, out, err = probe(tp1, record(tmp_path / "cyc-fwd", dp=2, order="cyclic", phases=("forward",)))
    assert code == 2 and "nothing to compare" in err and "dp_order 'cyclic'" in err and err.count("\n") == 1


def test_one_full_copy_off_is_named_with_its_rank(tp1: Path, tmp_path: Path) -> None:
    """A row-parallel output (a full copy on each TP rank) off by 1e-3 on rank 1 only: named on rank 1, never
    summed with rank 0's good copy."""
    run = record(tmp_path / "r1", tp=2, tweak=off_by(1e-3, lambda k, r: k == ("forward", 0, 1, 2) and r == 1))
    code, out, _ = probe(tp1, run)
    assert code == 1
    assert out.startswith(f"first divergence: iteration 1, micro-batch 0, forward, {fc(1, 2)}, rank 1: ")


def test_a_split_part_off_is_named_with_the_joined_ranks(tp1: Path, tmp_path: Path) -> None:
    """One TP shard of a column-parallel output off by 1e-3: the joined tensor leaves the band, named with
    the ranks whose parts were joined."""
    run = record(tmp_path / "shard", tp=2, tweak=off_by(1e-3, lambda k, r: k == ("forward", 1, 0, 1) and r == 0))
    code, out, _ = probe(tp1, run)
    assert code == 1 and out.startswith(
        f"first divergence: iteration 1, micro-batch 1, forward, {fc(0, 1)}, rank 0+1: ")


def test_partial_sums_are_refused_by_name(tp1: Path, tmp_path: Path) -> None:
    """Row-parallel outputs recorded as partial sums are listed as not compared, with the reason; the rest agree.
    Between identical layouts (device pair) the same partial entries are compared rank by rank."""
    run = record(tmp_path / "partial", tp=2, fc2_layout=partial("tp"))
    code, out, _ = probe(tp1, run)
    assert code == 0, out
    assert ("not compared: 8 tensors\n  run: a partial sum on each rank (before the reduce) of RowParallelLinear: "
            f"compared only between identical layouts (8 tensors): {fc(0, 2)} (forward), {fc(1, 2)} (forward)\n") in out
    same = record(tmp_path / "partial-b", tp=2, fc2_layout=partial("tp"), device="testdev")
    code, out, _ = probe(run, same)
    assert code == 0 and "not compared" not in out and "device pair" in out


def test_unknown_layouts_are_refused_and_a_missing_part_is_named(tp1: Path, tmp_path: Path) -> None:
    """An output with no layout rule, and a split tensor with one TP rank's part missing, are not compared."""
    run = record(tmp_path / "unk", tp=2, fc2_layout={"kind": "unknown", "groups": []})
    code, out, _ = probe(tp1, run)
    assert code == 0 and "no layout rule for RowParallelLinear (ps_layout 'unknown')" in out
    (run / "step1" / "rank1" / "dump.json").unlink()
    code, out, _ = probe(tp1, run)
    assert code == 0 and "only 1 of its 2 parts over tp were recorded (ranks 0)" in out


def test_distributed_optimizer_shards_join_into_the_parameter(tp1: Path, tmp_path: Path) -> None:
    """Under TP2 x DP2 with the distributed optimizer each rank holds an uneven flat slice of its TP part of a weight
    gradient (``ps_shard``): the four slices join into the TP1 gradient; one slice off is named by the joined ranks."""
    def write(root: Path, off: float = 0.0) -> Path:
        m = meta(tp=2, dp=2, micro_batches=2, global_batch_size=8, distributed_optimizer=True)
        m["layout"]["distributed_optimizer"] = True
        t = truth(4)
        for rank in range(4):
            tp_r, dp_r = rank % 2, rank // 2
            r = RankDump(m, rank=rank, tp=tp_r, dp=dp_r)
            for L in reversed(range(LAYERS)):
                part = t[("parameters_grad", -1, L, 1)].chunk(2, dim=0)[tp_r].reshape(-1)
                start, end = (0, 19) if dp_r == 0 else (19, part.numel())
                piece = part[start:end] * (1 + off if rank == 3 and L == 0 else 1)
                r.params(fc(L, 1), FC1, {"weight": piece}, layer=L, layout=split("tp", "dp", dim=0),
                         shard=(start, end, part.numel()))
            r.write(root)
        return root

    ref = record(tmp_path / "tp1-grads", phases=("parameters_grad",))
    code, out, _ = probe(ref, write(tmp_path / "distopt"))
    assert code == 0 and "compared 2 tensors" in out, out
    code, out, _ = probe(ref, write(tmp_path / "distopt-off", off=1e-3))
    assert code == 1 and out.startswith(f"first divergence: iteration 1, micro-batch all, parameters_grad, {fc(0, 1)}, "
                                        "rank 0+1+2+3: weight ")


def test_parameters_after_the_step_are_judged_without_their_mean(tmp_path: Path) -> None:
    """A bias after Adam's first step is +-lr per element; two signs flipped by rounding noise (a correct run) move
    its Mean only: agree. The step taken with twice the lr moves its Max and Norm: named."""
    signs = torch.tensor([1.0, -1.0] * 32)

    def write(root: Path, bias: torch.Tensor, **lay: int) -> Path:
        m = meta(**lay)
        for rank in range(m["world"]):
            r = RankDump(m, rank=rank, tp=rank)
            r.params(fc(0, 2), FC2, {"bias": bias}, layer=0, phase="parameters_updated", layout=full("tp"))
            r.write(root)
        return root

    ref = write(tmp_path / "ref", 1e-3 * signs)
    flipped = signs.clone()
    flipped[:4:2] = -1.0
    assert probe(ref, write(tmp_path / "flip", 1e-3 * flipped, tp=2))[0] == 0
    code, out, _ = probe(ref, write(tmp_path / "lr2", 2e-3 * signs, tp=2))
    assert code == 1 and re.search(rf"parameters_updated, {re.escape(fc(0, 2))}, rank 0: bias (Max|Norm) ref",
                                   out.splitlines()[0])


def test_a_container_on_several_pipeline_stages_is_refused(tp1: Path, tmp_path: Path) -> None:
    """Under PP2 each stage's TransformerBlock holds its own layers: the `decoder` entries of two stages are not
    one tensor, so they are refused by name; the layers inside compare."""
    run = record(tmp_path / "pp2", pp=2)
    for stage in (0, 1):
        f = run / "step1" / f"rank{stage}" / "dump.json"
        doc = json.loads(f.read_text())
        doc["data"]["Module.decoder.TransformerBlock.forward.0"] = {
            "input_args": [], "input_kwargs": {}, "output": [stats(torch.full((2, 2), float(stage)))],
            "ps_micro_batch": 0, "ps_phase": "forward", "ps_module": "decoder", "ps_class": "TransformerBlock",
            "ps_layer": LAYERS, "ps_seq": 99}
        f.write_text(json.dumps(doc))
    code, out, _ = probe(tp1, run)
    assert code == 0, out
    assert ("run: recorded on 2 pipeline stages: a TransformerBlock each stage runs its own part of, no one tensor "
            "to compare (1 tensors): decoder (forward)") in out


def test_grad_scale_is_divided_out_of_backward_entries(tp1: Path, tmp_path: Path) -> None:
    """Gradients that carry a factor 4 (a schedule dividing by fewer micro-batches) agree once the meta's
    grad_scale says so; the same gradients with grad_scale 1 differ at the first backward entry."""
    assert probe(tp1, record(tmp_path / "gs", tp=2, grad_scale=4.0))[0] == 0
    run = record(tmp_path / "gs1", tp=2, grad_scale=4.0)
    for f in run.glob("step1/rank*/dump.json"):
        doc = json.loads(f.read_text())
        doc["portspeed"]["grad_scale"] = 1.0
        f.write_text(json.dumps(doc))
    code, out, _ = probe(tp1, run)
    assert code == 1 and out.startswith(f"first divergence: iteration 1, micro-batch 0, backward, {fc(1, 2)}, rank 0: ")


def test_experts_compare_by_global_index_aggregated_over_the_iteration(tmp_path: Path) -> None:
    """EP1 (four experts on one rank, tokens per micro-batch) against EP2 (experts 2, 3 on rank 1, tokens grouped
    into other calls): the union of each expert's tokens over the iteration agrees, whatever the sampler order;
    expert 3 off on rank 1 is named there."""
    g = torch.Generator().manual_seed(5)
    tokens = {e: torch.randn(10 + e, HIDDEN, generator=g) for e in range(4)}

    def write(root: Path, ep: int, off: float = 0.0, order: str = "contiguous") -> Path:
        m = meta(ep=ep, dp=ep, micro_batches=2, global_batch_size=4, micro_batch_size=2, dp_order=order)
        m["model"]["num_moe_experts"] = 4
        for r in range(ep):
            d = RankDump(m, rank=r, ep=r, dp=r)
            for e in range(r * 4 // ep, (r + 1) * 4 // ep):
                rows = tokens[e] * (1 + off if e == 3 else 1)
                cuts = (0, 3, rows.shape[0]) if ep == 1 else (0, 7, rows.shape[0])  # other calls, same tokens
                for j in range(2):
                    d.forward(f"decoder.layers.0.mlp.experts.local_experts.{e}", "MLP", [rows[cuts[j]:cuts[j + 1]]],
                              layer=0, mb=j, expert=e, layout=full("tp"))
            d.write(root)
        return root

    ref = write(tmp_path / "ep1", 1)
    assert probe(ref, write(tmp_path / "ep2", 2))[0] == 0
    code, out, _ = probe(ref, write(tmp_path / "ep2-unknown", 2, order="unknown"))  # no call order needed
    assert code == 0 and "compared 4 tensors" in out, out
    code, out, _ = probe(ref, write(tmp_path / "ep2-off", 2, off=1e-3))
    assert code == 1
    assert out.startswith("first divergence: iteration 1, micro-batch all, forward, "
                          "decoder.layers.0.mlp.experts.local_experts.3, rank 1: ")
