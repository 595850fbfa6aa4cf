"""`portspeed compare --probe REF RUN`: where two probed runs part, in one line.

Why: loss parity names the iteration where losses part, and can miss a wrong shard entirely (a
1e-3 error in one TP shard of one layer moves the loss by 2e-6). The probe dumps hold every
module's output, gradient and parameter; put in the order the iteration computed them, the first
one outside its band is where the runs part.

Contract: both dumps are read (`dumps`), put on the reference's layout (`pairing`) and
judged tensor by tensor (`bands`) in a fixed order: iteration, micro-batch, forward by global
layer number, then backward in reverse, then parameter gradients (in backward order), then the
parameters after the step. The report's first line is exactly (one line; folded here)::

    first divergence: iteration I, micro-batch M, forward|backward, <module path> [op <name> #k], rank R:
        <statistic> ref X run Y (band B)

(``no divergence: ...`` when all agree), then the context: the last agreeing tensors, the next
differing ones, that module's parameter and gradient entries, what was not compared and why, and
the largest difference per statistic relative to its band. Exit status: 0 agree, 1 diverged,
2 bad input (one line: missing or empty dump, different models or releases, a pair of layouts
that cannot be mapped, nothing left to compare).

Example::

    portspeed compare --probe probe-tp1 probe-tp2          # exit 0
    code = main_probe(["probe-tp1", "probe-tp2"], out=sys.stdout)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Sequence, TextIO

from portspeed.probe.reading.bands import STAT_ORDER, UPDATED_STATS, Verdict, bands_for, check
from portspeed.probe.reading.dumps import ProbeDump, ProbeInputError, read_dump
from portspeed.probe.reading.pairing import Copy, Pairing, Side, Slot, pair_dumps

__all__ = ["TensorResult", "ProbeReport", "compare_dumps", "first_line", "format_report", "main_probe"]

EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2
#: context lines around the first divergence
AGREEING_BEFORE, DIFFERING_AFTER, NOT_COMPARED_SHOWN = 3, 5, 8


@dataclasses.dataclass(slots=True)
class TensorResult:
    """One slot judged: agree / differ (with each rank's verdict) / not compared (with the reason)."""

    slot: Slot
    order: tuple
    status: str  # "agree" | "differ" | "not compared"
    reason: str = ""
    #: (reference copy, run copy, verdict) per run copy
    pairs: list[tuple[Copy, Copy, Verdict]] = dataclasses.field(default_factory=list)
    bands: str = ""
    #: the entry holds several tensors: the statistic is named with its field
    several: bool = False

    @property
    def first_bad(self) -> tuple[Copy, Copy, Verdict] | None:
        return next((p for p in self.pairs if not p[2].ok), None)

    @property
    def worst(self) -> tuple[Copy, Copy, Verdict] | None:
        return max(self.pairs, key=lambda p: p[2].ratio, default=None)


@dataclasses.dataclass(slots=True)
class ProbeReport:
    """Every slot in the fixed order, the pair's kind, and what was left out as a whole."""

    ref: ProbeDump
    run: ProbeDump
    kind: str
    results: list[TensorResult]
    notes: list[str]

    @property
    def compared(self) -> list[TensorResult]:
        return [r for r in self.results if r.status != "not compared"]

    @property
    def first_divergence(self) -> TensorResult | None:
        return next((r for r in self.results if r.status == "differ"), None)

    @property
    def exit_code(self) -> int:
        return EXIT_DIVERGED if self.first_divergence else EXIT_OK


def compare_dumps(ref: str | Path | ProbeDump, run: str | Path | ProbeDump,
                  iterations: tuple[int | None, int | None] = (None, None), rtol: float | None = None) -> ProbeReport:
    """Judge every tensor of ``run`` against ``ref``; `ProbeInputError` when nothing can be compared."""
    a = ref if isinstance(ref, ProbeDump) else read_dump(ref)
    b = run if isinstance(run, ProbeDump) else read_dump(run)
    pairing = pair_dumps(a, b, iterations)
    results = [_judge(s, rs, us, pairing, rtol) for s, (rs, us) in pairing.slots.items()]
    results.sort(key=lambda r: r.order)
    report = ProbeReport(a, b, pairing.kind, results, pairing.notes)
    if not report.compared:
        why = Counter(r.reason for r in results).most_common(2)
        raise ProbeInputError(
            f"nothing to compare between {a.path} and {b.path}: {len(results)} tensors, none comparable "
            f"({'; '.join(f'{n} {w}' for w, n in why) or 'no entries in the common iterations'})"
            + (f"; {pairing.notes[0]}" if pairing.notes else ""))
    return report


def _judge(slot: Slot, rs: Side | None, us: Side | None, pairing: Pairing, rtol: float | None) -> TensorResult:
    side = rs or us
    assert side is not None
    res = TensorResult(slot, rs.order if rs else (*us.order[:-1], math.inf), "not compared",
                       several=(side.fields > 1) or slot.phase.startswith("parameters"))
    refused = next((f"{n}: {x.refused}" for n, x in (("reference", rs), ("run", us)) if x and x.refused), None)
    if refused:
        res.reason = refused
        return res
    if rs is None or us is None:
        side_name = "run" if us is None else "reference"
        why = pairing.unmatched.get(side_name) if slot.micro_batch >= 0 else None
        res.reason = (f"the {side_name}'s micro-batches cannot be matched ({why})" if why else
                      "only in the reference" if us is None else "only in the run")
        return res
    ref_copies = rs.copies
    for i, u in enumerate(us.copies):
        r = ref_copies[i] if len(ref_copies) == len(us.copies) else ref_copies[0]
        bands, name = bands_for(r.stats.dtype, u.stats.dtype, pairing.kind, rtol, pairing.dtype)
        judged = UPDATED_STATS if slot.phase == "parameters_updated" else STAT_ORDER
        res.pairs.append((r, u, check(r.stats, u.stats, bands, judged)))
        res.bands = name
    res.status = "differ" if res.first_bad else "agree"
    return res


# ----------------------------------------------------------------------------- the report

def _mb(r: TensorResult) -> str:
    return "all" if r.slot.micro_batch < 0 else str(r.slot.micro_batch)


def _name(s: Slot) -> str:
    """A slot's module (and op) for lists: ``decoder.layers.0.mlp op linear``, or msprobe's key."""
    if s.key:
        return s.key
    return f"{s.module} op {s.op}" if s.op and s.module else s.op or s.module or "<root>"


_KEY_MODULE = re.compile(r"^Module\.(.+)\.(?:forward|backward|recompute|parameters_grad|parameters_updated)\.\d+$")


def _owner(s: Slot) -> str:
    """The module a slot belongs to: its path; for msprobe's keys (a dump msprobe wrote) ``<path>.<Class>``."""
    if not s.key:
        return s.module
    m = _KEY_MODULE.match(s.key)
    return m[1] if m else ""


def _where(r: TensorResult) -> str:
    s = r.slot
    path = s.module or s.key or ("" if s.op else "<root>")
    if s.call > 0:
        path += f" (call {s.call})"
    if s.op:  # an op outside every module is named by itself
        path += f"{' ' if path else ''}op {s.op} #{max(s.op_index, 0)}"
    return f"iteration {s.iteration}, micro-batch {_mb(r)}, {s.phase}, {path}"


def _stat(r: TensorResult, v: Verdict) -> str:
    return f"{r.slot.field} {v.stat}" if r.several else v.stat


def _num(x: object) -> str:
    if isinstance(x, float):
        return repr(x) if math.isnan(x) or math.isinf(x) else f"{x:.9g}"
    return str(x)


def _ranks(c: Copy) -> str:
    """A copy's rank; parts joined from several ranks are named 0+1."""
    return "+".join(str(r) for r in c.ranks)


def _verdict_text(r: TensorResult, rc: Copy, uc: Copy, v: Verdict) -> str:
    band = "must match" if v.band is None else f"band {v.band:.3g}"
    return f"rank {_ranks(uc)}: {_stat(r, v)} ref {_num(v.ref)} run {_num(v.run)} ({band})"


def first_line(report: ProbeReport) -> str:
    """The report's first line: where the runs part, or that they do not."""
    fd = report.first_divergence
    if fd is None:
        n = report.compared
        its = sorted({r.slot.iteration for r in n})
        return (f"no divergence: {len(n)} tensors agree over iteration(s) {','.join(map(str, its))} "
                f"({report.kind} pair, {', '.join(sorted({r.bands for r in n}))} bands)")
    rc, uc, v = fd.first_bad  # type: ignore[misc]
    return f"first divergence: {_where(fd)}, {_verdict_text(fd, rc, uc, v)}"


def _line(r: TensorResult) -> str:
    if r.status == "not compared":
        return f"  {_where(r)}: {r.slot.field}: not compared ({r.reason})"
    bad = r.first_bad
    if bad:
        return f"  {_where(r)}, {_verdict_text(r, *bad)}"
    _, uc, v = r.worst  # type: ignore[misc]
    ratio = "exactly equal" if v.ratio == 0 else f"worst {v.stat} at {v.ratio:.2g} of its band"
    return f"  {_where(r)}, rank(s) {','.join(_ranks(p[1]) for p in r.pairs)}: {r.slot.field} agrees ({ratio})"


def format_report(report: ProbeReport) -> str:
    """The first line, then the context that explains it."""
    out = [first_line(report)]
    out.append(f"reference: {report.ref.path}{_meta_str(report.ref)}")
    out.append(f"run:       {report.run.path}{_meta_str(report.run)}")
    res = report.results
    fd = report.first_divergence
    if fd is not None:
        i = res.index(fd)
        before = [r for r in res[:i] if r.status == "agree"][-AGREEING_BEFORE:]
        after = [r for r in res[i + 1:] if r.status == "differ"][:DIFFERING_AFTER]
        if before:
            out.append("last agreeing:")
            out += [_line(r) for r in before]
        out.append("next differing:" if after else "next differing: none")
        out += [_line(r) for r in after]
        if _owner(fd.slot):
            params = [r for r in res if _owner(r.slot) == _owner(fd.slot) and r.slot.iteration == fd.slot.iteration
                      and r.slot.phase.startswith("parameters")]
            out.append(f"{fd.slot.module or fd.slot.key}'s parameters:" + ("" if params else " none recorded"))
            out += [_line(r) for r in params]
    left = [r for r in res if r.status == "not compared"]
    if left:
        out.append(f"not compared: {len(left)} tensors")
        by_reason: dict[str, list[TensorResult]] = {}
        for r in left:
            by_reason.setdefault(r.reason, []).append(r)
        for why, rs in by_reason.items():
            names = list(dict.fromkeys(f"{_name(r.slot)} ({r.slot.phase})" for r in rs))
            more = f", ... {len(names) - NOT_COMPARED_SHOWN} more" if len(names) > NOT_COMPARED_SHOWN else ""
            out.append(f"  {why} ({len(rs)} tensors): {', '.join(names[:NOT_COMPARED_SHOWN])}{more}")
    out += [f"note: {n}" for n in report.notes]
    comp = report.compared
    n_bad = sum(r.status == "differ" for r in comp)
    out.append(f"compared {len(comp)} tensors ({sum(len(r.pairs) for r in comp)} rank pairs): "
               f"{len(comp) - n_bad} agree, {n_bad} differ; {report.kind} pair")
    out.append("largest |diff| / band per statistic: " + _largest(comp))
    return "\n".join(out)


def _largest(comp: list[TensorResult]) -> str:
    best: dict[str, tuple[float, TensorResult]] = {}
    for r in comp:
        for _, _, v in r.pairs:
            for stat, ratio in v.ratios:
                if math.isfinite(ratio) and ratio > best.get(stat, (-1.0, r))[0]:
                    best[stat] = (ratio, r)
    return ", ".join(f"{s} {best[s][0]:.2g} ({_name(best[s][1].slot)} {best[s][1].slot.phase}, {best[s][1].bands})"
                     for s in STAT_ORDER if s in best) or "-"


def _meta_str(d: ProbeDump) -> str:
    if not d.portspeed:
        return "  (msprobe's own dump)"
    m = d.meta
    lay = m.get("layout") or {}
    bits = [f"{k}{v}" for k, v in lay.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1]
    bits += [k for k, v in lay.items() if v is True]
    asked = f" (asked: {m['backend_requested']})" if m.get("backend_requested") else ""
    return (f"  ({m.get('device', '?')}/{m.get('backend', '?')}{asked}, {m.get('dtype', '?')}, "
            f"layout {' '.join(bits) or 'one rank'}, {len({r for _, r in d.ranks})} rank(s))")


def report_json(report: ProbeReport) -> dict[str, Any]:
    """Everything the report saw, for --json."""
    def tensor(r: TensorResult) -> dict[str, Any]:
        return {"slot": dataclasses.asdict(r.slot), "status": r.status, "reason": r.reason, "bands": r.bands,
                "pairs": [{"ref_ranks": list(rc.ranks), "run_ranks": list(uc.ranks), "ok": v.ok, "stat": v.stat,
                           "ref": v.ref, "run": v.run, "band": v.band, "ratio": v.ratio, "ratios": dict(v.ratios)}
                          for rc, uc, v in r.pairs]}
    return {"first_line": first_line(report), "exit_code": report.exit_code, "kind": report.kind,
            "reference": str(report.ref.path), "run": str(report.run.path), "notes": report.notes,
            "tensors": [tensor(r) for r in report.results]}


def main_probe(paths: Sequence[str], out: TextIO, iterations: tuple[int | None, int | None] | None = None,
               rtol: float | None = None, json_path: str | None = None) -> int:
    """`portspeed compare --probe REF RUN`: 0 agree, 1 diverged; bad input raises `ProbeInputError` (exit 2)."""
    if len(paths) != 2:
        raise ProbeInputError(f"--probe compares two dump folders (reference, run); got {len(paths)}: "
                              f"{' '.join(paths)}")
    report = compare_dumps(paths[0], paths[1], iterations or (None, None), rtol)
    text = format_report(report)
    if json_path:
        p = Path(json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report_json(report), indent=1, allow_nan=True) + "\n", encoding="utf-8")
    try:
        print(text, file=out)
    except BrokenPipeError:  # `| head`: the reader has what it wanted; the verdict still stands
        pass
    return report.exit_code
