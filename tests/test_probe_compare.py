"""`portspeed compare --probe`: probe dumps put on one layout exactly, judged in a fixed order, named in one line.

Synthetic dumps (tests/helpers/probe_dumps.py, the format of docs/probe-format.md) hold float64
statistics of real tensors: one "true" iteration of a two-layer model (per micro-batch and layer,
a column-parallel and a row-parallel output, their gradients, the weights' gradients), recorded
as a TP1 run would and as TP2 / DP2 / PP2 / EP2 runs would (halves, copies, other ranks). So
every rule is checked against numbers computed here independently.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers.probe_dumps import RankDump, full, meta, partial, split, stats

from portspeed.parity import compare as compare_cli
from portspeed.parity.probe_compare import compare_dumps, first_line
from portspeed.parity.probe_format import ProbeInputError, TensorStats, merge, read_dump

LAYERS, SEQ, BATCH, HIDDEN = 2, 4, 2, 8
FC1, FC2 = "ColumnParallelLinear", "RowParallelLinear"


def fc(layer: int, n: int) -> str:
    return f"decoder.layers.{layer}.mlp.linear_fc{n}"


def truth(micro_batches: int, seed: int = 0) -> dict[tuple, torch.Tensor]:
    """One iteration's tensors on one rank: (phase, micro-batch, layer, name) -> tensor."""
    g = torch.Generator().manual_seed(seed)
    t: dict[tuple, torch.Tensor] = {}
    for mb in range(micro_batches):
        t[("forward", mb, -1, "embedding")] = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        for layer in range(LAYERS):
            for n in (1, 2):
                t[("forward", mb, layer, n)] = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
                t[("backward", mb, layer, n)] = torch.randn(SEQ, BATCH, HIDDEN, generator=g) * 1e-3
    for layer in range(LAYERS):
        for n in (1, 2):
            t[("parameters_grad", -1, layer, n)] = torch.randn(HIDDEN, HIDDEN, generator=g) * 1e-2
    return t


Tweak = Callable[[tuple, int, torch.Tensor], torch.Tensor]


def record(root: Path, *, tp: int = 1, dp: int = 1, pp: int = 1, per_rank_mbs: int | None = None,
           order: str = "contiguous", declared_order: str | None = None, grad_scale: float = 1.0,
           tweak: Tweak | None = None, noise: float = 0.0, phases: tuple[str, ...] = ("forward", "backward",
           "parameters_grad"), fc2_layout: dict | None = None, device: str = "cpu", **meta_over) -> Path:
    """Write the true iteration as a TP x PP x DP run records it (rank = tp_r + tp*(pp_r + pp*dp_r))."""
    m_local = per_rank_mbs or 4 // dp
    t = truth(m_local * dp)
    run_meta = meta(tp=tp, pp=pp, dp=dp, micro_batches=m_local, global_batch_size=2 * m_local * dp,
                    dp_order=declared_order or order, grad_scale=grad_scale, device=device, **meta_over)
    g = torch.Generator().manual_seed(99)
    for dp_r in range(dp):
        for pp_r in range(pp):
            for tp_r in range(tp):
                rank = tp_r + tp * (pp_r + pp * dp_r)
                r = RankDump(run_meta, rank=rank, tp=tp_r, pp=pp_r, dp=dp_r)
                layers = [L for L in range(LAYERS) if L * pp // LAYERS == pp_r]

                def put(key: tuple, part: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
                    x = t[key] * (grad_scale if key[0] == "backward" else 1.0)
                    if noise:
                        x = x * (1 + noise * torch.randn(x.shape, generator=g, dtype=x.dtype))
                    x = part(x)
                    return tweak(key, rank, x) if tweak else x

                col = lambda x, d=-1: x.chunk(tp, dim=d)[tp_r]  # noqa: E731
                for j in range(m_local):
                    mb = dp_r * m_local + j if order == "contiguous" else j * dp + dp_r
                    if "forward" in phases:
                        if pp_r == 0:
                            r.forward("embedding", "LanguageModelEmbedding",
                                      [put(("forward", mb, -1, "embedding"), lambda x: x)], layer=-1, mb=j,
                                      layout=full("tp"))
                        for L in layers:
                            r.forward(fc(L, 1), FC1, [put(("forward", mb, L, 1), col)], layer=L, mb=j,
                                      layout=split("tp", dim=-1))
                            r.forward(fc(L, 2), FC2, [put(("forward", mb, L, 2), lambda x: x)], layer=L, mb=j,
                                      layout=fc2_layout or full("tp"))
                    if "backward" in phases:
                        for L in reversed(layers):
                            r.backward(fc(L, 2), FC2, [put(("backward", mb, L, 2), lambda x: x)], layer=L, mb=j,
                                       layout=full("tp"))
                            r.backward(fc(L, 1), FC1, [put(("backward", mb, L, 1), col)], layer=L, mb=j,
                                       layout=split("tp", dim=-1))
                if "parameters_grad" in phases:
                    for L in reversed(layers):
                        for n, d in ((2, 1), (1, 0)):
                            r.params(fc(L, n), FC1 if n == 1 else FC2,
                                     {"weight": put(("parameters_grad", -1, L, n), lambda x: col(x, d))}, layer=L,
                                     layout=split("tp", dim=d) if tp > 1 else full("dp"))
                r.write(root)
    return root


def probe(ref: Path, run: Path, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = compare_cli.main(["--probe", str(ref), str(run), *extra], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def off_by(rel: float, where: Callable[[tuple, int], bool]) -> Tweak:
    return lambda key, rank, x: x * (1 + rel) if where(key, rank) else x


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


# ------------------------------------------------------------------ order and the first line


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
