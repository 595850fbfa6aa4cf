"""`portspeed compare --perf REF RUN`: the part of the step that grew most, and what was seen inside it.

Why shares and not times: REF and RUN may be other devices, other layouts, other machines; their
absolute times are not comparable, but the share of the step a part takes is. A part is one module's
own time (its children's taken out) in one phase, under the probe's canonical paths, so a TP2 run
names a module as a TP1 run does, plus ``(outside-modules)`` and ``(optimizer)``. For each rank of RUN
and each part, the excess is RUN's share, at the median over RUN's timed iterations (one hiccup names
nothing), minus the highest share REF showed in any of its iterations and ranks (what REF itself varies by
is not an excess); the iteration named is the one where RUN's median falls.

First line::

    slowest part: iteration I, <path> forward|backward [op OP], rank R: S% of the step on RUN vs S'% on REF
    (+P points, T ms): <cause>

The cause is what was seen inside that part on RUN (and how often on REF): host syncs with counts,
host<->device copies, ops run through the CPU fallback, the portable TE's kernels run in another
implementation than on REF (or the reference one), collectives the router rewrote, and waiting for other
ranks (with the rank that arrived last); when none of those, its own work is slower. Then the ten
largest excesses and the collectives with their achieved bus bandwidth (nccl-tests' factors) beside the one
measured for that link (``links``: ``portspeed conformance --suites bandwidth``). Exit 0
when no part exceeds the threshold (printed), 1 when a part is named, 2 when an input cannot be used.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TextIO

from portspeed.perf.reading import links as perf_links
from portspeed.perf.reading import slow_rank as perf_ranks
from portspeed.perf.reading import slow_links as perf_slow_links
from portspeed.perf.reading.host_fallbacks import run_line
from portspeed.perf.reading.recordings import PerfInputError, PerfRun, median, read_run, share
from portspeed.perf.reading.links import bus_factor

__all__ = ["THRESHOLD_POINTS", "Excess", "compare_runs", "main_perf", "bus_factor"]

#: a part is named when its share of the step grew by more than this many percentage points beyond REF's highest
#: (docs/performance.md, "The threshold": what clean pairs of the example trainer reached)
THRESHOLD_POINTS = 10.0


@dataclasses.dataclass
class Excess:
    """One part of one RUN rank: its share against REF's, at the median iteration."""

    path: str
    phase: str
    rank: int
    iteration: int
    run_share: float
    ref_share: float
    ms: float  # the excess in milliseconds of RUN's step

    @property
    def points(self) -> float:
        return self.run_share - self.ref_share


def _ref_shares(ref: PerfRun) -> dict[tuple[str, str], float]:
    """Each part's highest share of the step in any timed iteration and rank of REF: RUN is slower only beyond
    what REF itself showed (a shared machine moves a part's share by several points from one iteration to the
    next, and more between two processes)."""
    keys = {k for it, r in ref.lines for k in ref.parts(it, r)}
    return {key: max(share(line, ref.parts(it, r).get(key)) for (it, r), line in ref.lines.items()) for key in keys}


def compare_runs(ref: PerfRun, run: PerfRun) -> list[Excess]:
    """Every (rank, part) of RUN with its excess over REF, largest first."""
    base = _ref_shares(ref)
    out: list[Excess] = []
    for rank in run.ranks:
        its = [i for i in run.iterations if (i, rank) in run.lines]
        keys = {k for i in its for k in run.parts(i, rank)}
        for key in keys:
            rows = sorted(((share(run.lines[(i, rank)], run.parts(i, rank).get(key)), i) for i in its))
            s, it = rows[(len(rows) - 1) // 2]  # the median iteration (the lower one of an even count)
            step = float(run.lines[(it, rank)]["step_ms"])
            ref = base.get(key, 0.0)
            out.append(Excess(key[0], key[1], rank, it, s, ref, (s - ref) / 100.0 * step))
    out.sort(key=lambda e: -e.points)
    return out


def _counts(table: dict[str, int]) -> str:
    items = sorted(table.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{k} x{v}" for k, v in items[:4])
    return shown + (f", {len(items) - 4} more" if len(items) > 4 else "")


def _ref_count(ref: PerfRun, key: tuple[str, str], field: str) -> int:
    got = [sum(ref.parts(i, r).get(key, {}).get(field, {}).values()) for i, r in ref.lines]
    return int(median([float(g) for g in got])) if got else 0


def cause(e: Excess, ref: PerfRun, run: PerfRun) -> str:
    """What was seen inside the part on RUN (see the module docstring)."""
    key = (e.path, e.phase)
    part = run.parts(e.iteration, e.rank).get(key, {})
    said: list[str] = []
    syncs = part.get("syncs") or {}
    if syncs:
        said.append(f"{sum(syncs.values())} host syncs ({_counts(syncs)}; REF {_ref_count(ref, key, 'syncs')})")
    for kind, (n, nbytes) in sorted((part.get("copies") or {}).items()):
        said.append(f"{n} {kind} copies ({nbytes / 1024:.1f} KiB)")
    fallbacks = part.get("fallbacks") or {}
    if fallbacks:
        said.append(f"{sum(fallbacks.values())} ops ran through the CPU fallback, no kernel for the device "
                    f"({_counts(fallbacks)}; REF {_ref_count(ref, key, 'fallbacks')})")
    kernels = part.get("kernels") or {}
    ref_kernels = {k for i, q in ref.lines for k in (ref.parts(i, q).get(key, {}).get("kernels") or {})}
    unlike = {k: n for k, n in kernels.items() if k not in ref_kernels or k.endswith(" reference")}
    if unlike:
        said.append(f"portable TE kernels not as on REF ({_counts(unlike)}; REF "
                    f"{', '.join(sorted(ref_kernels)) or 'none'})")
    line = run.lines[(e.iteration, e.rank)]
    calls = [c for c in line.get("collectives", []) if c.get("module") == e.path and c.get("phase") == e.phase]
    rewrites: dict[str, int] = {}
    took = 0.0
    for c in calls:
        for how, n in (c.get("rewrites") or {}).items():
            rewrites[f"{c['op']} {how}"] = rewrites.get(f"{c['op']} {how}", 0) + n
        if c.get("rewrites") and "leave" in c:
            took += (c["leave"] - c["enter"]) * 1e3
    if rewrites:
        said.append(f"the router rewrote collectives ({_counts(rewrites)}), {took:.1f} ms in them")
    matches = [m for m in run.matches(e.iteration) if e.rank in m.calls
               and m.calls[e.rank].get("module") == e.path and m.calls[e.rank].get("phase") == e.phase]
    waited = sum(m.wait_ms(e.rank) for m in matches)
    if matches and waited >= 0.5 * max(e.ms, 1e-9):
        last: dict[int, int] = {}
        for m in matches:
            last[m.last_rank] = last.get(m.last_rank, 0) + 1
        who = max(last, key=lambda r: last[r])
        said.append(f"waiting for other ranks: {waited:.1f} ms in {len(matches)} collectives, rank {who} arrived "
                    f"last at {last[who]} of them")
    if not said:
        return ("no host sync, CPU fallback, router rewrite or wait for other ranks seen inside: its own work is "
                "slower")
    return "; ".join(said)


def _part(e: Excess) -> str:
    return f"{e.path} {e.phase}"


def slowest_op(e: Excess, ref: PerfRun, run: PerfRun) -> str | None:
    """At op level on both sides: the operator inside the part whose share of the step grew most (None: no op
    times, or none grew)."""
    key = (e.path, e.phase)
    ops = run.parts(e.iteration, e.rank).get(key, {}).get("ops") or {}
    if not ops or not any(r.get("ops") for (i, q) in ref.lines for r in ref.parts(i, q).values()):
        return None
    base: dict[str, float] = {}
    for op in ops:
        base[op] = median([100.0 * float((ref.parts(i, q).get(key, {}).get("ops") or {}).get(op, [0, 0.0])[1])
                           / float(ref_line["step_ms"]) for (i, q), ref_line in ref.lines.items()])
    its = [i for i in run.iterations if (i, e.rank) in run.lines]

    def share_in(i: int, op: str) -> float:  # the op's share of iteration i's step inside the part, on RUN
        got = (run.parts(i, e.rank).get(key, {}).get("ops") or {}).get(op, [0, 0.0])
        return 100.0 * float(got[1]) / float(run.lines[(i, e.rank)]["step_ms"])

    # the median over RUN's iterations, as for the part: one iteration's hiccup inside a cheap op (a view called
    # eighty times, each call stretched by the scheduler on a loaded machine) names nothing
    grew = {op: median([share_in(i, op) for i in its]) - base[op] for op in ops}
    op = max(grew, key=lambda k: grew[k])
    return op if grew[op] > 0 else None


def main_perf(runs: list[str], out: TextIO, threshold: float | None, json_path: str | None,
              chrome: str | None = None, bandwidth: str | None = None, png: str | None = None) -> int:
    """``compare --perf``: one folder (the slow rank) or two (REF RUN); raises PerfInputError for bad input."""
    if len(runs) not in (1, 2):
        raise PerfInputError(f"--perf takes one recording (the slow rank) or two (REF RUN), got {len(runs)}")
    table = bandwidth or perf_links.default_path()
    links = perf_links.read_table(table)  # a damaged table is refused before anything is written or said
    note = ""
    if chrome:  # written first: a path that cannot be written is refused before anything is said
        from portspeed.perf.reading.chrome import write_chrome

        n = write_chrome(read_run(runs[-1]), chrome)
        note = f"\nchrome trace of {runs[-1]}: {chrome} ({n} events; open it in Perfetto or chrome://tracing)"
    if len(runs) == 1:
        run = read_run(runs[0])
        if png:  # drawn before anything is said, as the trace: a path that cannot be written is refused first
            from portspeed.perf.reading.plot import draw_ranks

            note += draw_ranks(run, perf_ranks.find_slow_rank(run), png).note
        code = perf_ranks.report(run, out)
        code = max(code, perf_slow_links.report(run, out, links))
        fallbacks = run_line(run.lines)  # a PrivateUse1 device's CPU-fallback ops and the host rung's, if any
        if fallbacks:
            print(fallbacks, file=out)
        _collectives(run, table, links, out)
        if json_path:
            _dump(json_path, {"slow_rank": perf_ranks.describe(run),
                              "slow_links": perf_slow_links.describe(run, links), "exit": code})
        if note:
            print(note, file=out)
        return code
    ref, run = read_run(runs[0]), read_run(runs[1])
    limit = THRESHOLD_POINTS if threshold is None else threshold
    excesses = compare_runs(ref, run)
    if png:
        from portspeed.perf.reading.plot import draw_shares

        note += draw_shares(ref, run, excesses, limit, png).note
    top = excesses[0] if excesses else None
    named = top is not None and top.points > limit
    if named:
        assert top is not None
        op = slowest_op(top, ref, run)
        print(f"slowest part: iteration {top.iteration}, {_part(top)}{f' op {op}' if op else ''}, rank {top.rank}: "
              f"{top.run_share:.1f}% of "
              f"the step on RUN vs {top.ref_share:.1f}% on REF (+{top.points:.1f} points, {top.ms:.1f} ms): "
              f"{cause(top, ref, run)}", file=out)
    else:
        largest = (f"the largest excess is +{top.points:.1f} points ({_part(top)}, rank {top.rank})"
                   if top is not None else "nothing to compare")
        print(f"no slow part: no part's share of the step grew by more than {limit:g} points; {largest}", file=out)
    print(f"REF {ref.folder} (iterations {_span(ref.iterations)}, ranks {len(ref.ranks)}, clock "
          f"{'/'.join(ref.clocks)}); RUN {run.folder} (iterations {_span(run.iterations)}, ranks {len(run.ranks)}, "
          f"clock {'/'.join(run.clocks)}); threshold {limit:g} points", file=out)
    print("\nlargest excesses (RUN's share of the step at its median iteration vs REF's highest):", file=out)
    for e in [e for e in excesses if e.points >= 0.05][:10] or excesses[:1]:
        print(f"  {e.points:+6.1f} points  {e.run_share:5.1f}% vs {e.ref_share:5.1f}%  {e.ms:+8.2f} ms  rank {e.rank}  "
              f"iteration {e.iteration}  {_part(e)}", file=out)
    _collectives(run, table, links, out)
    if json_path:
        _dump(json_path, {"threshold": limit, "named": named, "excesses": [dict(dataclasses.asdict(e),
                                                                                points=e.points)
                                                                           for e in excesses[:50]]})
    if note:
        print(note, file=out)
    return 1 if named else 0


def _collectives(run: PerfRun, table: str, links: list[dict[str, Any]], out: TextIO) -> None:
    print("\ncollectives on RUN (median per call; wait: for the last rank to arrive; busbw from the transfer; "
          "link: the busbw measured on that link):", file=out)
    for row in perf_links.collectives_table(run, table, links):
        print(f"  {row}", file=out)


def _span(values: list[int]) -> str:
    return f"{values[0]}-{values[-1]}" if values else "none"


def _dump(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
