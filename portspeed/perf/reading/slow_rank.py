"""`portspeed compare --perf RUN` with one run: the slow rank, or that there is none.

Why from the collectives: a rank that is slow makes every other rank of its groups wait for it, so it is
the one that arrives last at the collectives after its slow work. Each collective is matched across the
ranks of its group (``recordings.Match``). Counting who arrives last misleads: a backend lets its ranks
leave a collective in a fixed order, so in back-to-back collectives the rank let go last also arrives
last. So the rank that arrives last is charged only what its own work since its previous collective
took beyond the other ranks' (its gap minus theirs), at most the spread (how long the first rank waited
for it). The slow rank is the one charged the most, by a margin over the next rank of at least
``MIN_SHARE`` of the median step, per iteration (median over the timed iterations).
Then: busy computing (it waited little in collectives itself while the others waited for it; the part
where its own time exceeds the other ranks' most is named) or waiting (it also waited, on something
outside the collectives this recording sees).

First line: ``slow rank: rank R arrives last at N of M collectives, making the others wait X ms per
iteration (Y% of the step): busy computing, ...`` or ``no slow rank: ...``; exit 1 or 0 (2: the input
cannot be used, raised by the reader).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TextIO

from portspeed.perf.reading.recordings import Match, PerfRun, median

__all__ = ["MIN_SHARE", "NOISE_MS", "SlowRank", "find_slow_rank", "report"]

#: the slow rank made the others wait this share of the step (per iteration) more than the next rank did
MIN_SHARE = 0.10
#: spreads below this are ties (thread wake-ups, clock reads), not counted as arriving last
NOISE_MS = 0.2


@dataclasses.dataclass
class SlowRank:
    """What the matched collectives of one run say about its ranks."""

    rank: int | None  # the slow rank, or None
    candidate: int | None  # the rank charged the most waiting
    last: dict[int, int]  # rank -> collectives it arrived last at (spread above the noise)
    counted: int  # collectives with a spread above the noise
    matched: int  # collectives matched across their group
    caused_ms: dict[int, float]  # rank -> waiting it caused per iteration (median)
    margin: float  # the candidate's caused waiting minus the next rank's, as a share of the median step
    step_ms: float
    wait_ms: dict[int, float]  # rank -> time it waited for others in collectives, per iteration (median)
    busy_part: tuple[str, str, float] | None  # the candidate's part with the largest excess over the others (ms)


def _gaps(run: PerfRun) -> dict[int, float]:
    """id(call) -> ms from this rank leaving its previous collective to entering this one (its own work between)."""
    out: dict[int, float] = {}
    for line in run.lines.values():
        calls = sorted((c for c in line.get("collectives", []) if "leave" in c), key=lambda c: c["enter"])
        for before, call in zip(calls, calls[1:]):
            out[id(call)] = (call["enter"] - before["leave"]) * 1e3
    return out


def _per_iteration_waits(run: PerfRun, matches: list[Match]) -> dict[int, float]:
    waits: dict[tuple[int, int], float] = {}
    for m in matches:
        for r in m.calls:
            waits[(m.iteration, r)] = waits.get((m.iteration, r), 0.0) + m.wait_ms(r)
    return {r: median([waits.get((i, r), 0.0) for i in run.iterations if (i, r) in run.lines]) for r in run.ranks}


def _busy_part(run: PerfRun, rank: int) -> tuple[str, str, float] | None:
    """The part where ``rank``'s own time exceeds the other ranks' median most (median over iterations)."""
    excess: dict[tuple[str, str], list[float]] = {}
    for it in run.iterations:
        if (it, rank) not in run.lines:
            continue
        mine = run.parts(it, rank)
        others = [run.parts(it, r) for r in run.ranks if r != rank and (it, r) in run.lines]
        if not others:
            return None
        for key, part in mine.items():
            other = median([float(o[key]["self_ms"]) - float(o[key]["collective_ms"]) if key in o else 0.0
                            for o in others])
            excess.setdefault(key, []).append(float(part["self_ms"]) - float(part["collective_ms"]) - other)
    if not excess:
        return None
    key = max(excess, key=lambda k: median(excess[k]))
    return key[0], key[1], median(excess[key])


def find_slow_rank(run: PerfRun) -> SlowRank:
    """The slow rank of ``run`` (see the module docstring), with the figures that decided it."""
    matches = [m for it in run.iterations for m in run.matches(it)]
    spread = [m for m in matches if m.spread_ms > NOISE_MS]
    last: dict[int, int] = {}
    caused: dict[tuple[int, int], float] = {}
    gaps = _gaps(run)
    for m in spread:
        r = m.last_rank
        last[r] = last.get(r, 0) + 1
        mine = gaps.get(id(m.calls[r]))
        theirs = [gaps.get(id(c)) for q, c in m.calls.items() if q != r]
        if mine is None or any(g is None for g in theirs):
            continue  # the first collective of an iteration: nothing before it to compare
        late = min(m.spread_ms, mine - median([float(g) for g in theirs if g is not None]))
        caused[(m.iteration, r)] = caused.get((m.iteration, r), 0.0) + max(0.0, late)
    per_rank = {r: median([caused.get((i, r), 0.0) for i in run.iterations]) for r in run.ranks}
    step = median([float(line["step_ms"]) for line in run.lines.values()])
    waits = _per_iteration_waits(run, matches)
    if not last or len(run.ranks) < 2:
        return SlowRank(None, None, last, len(spread), len(matches), per_rank, 0.0, step, waits, None)
    order = sorted(per_rank, key=lambda r: -per_rank[r])
    cand = order[0]
    margin = (per_rank[cand] - per_rank[order[1]]) / step if step > 0 else 0.0
    named = margin >= MIN_SHARE
    return SlowRank(cand if named else None, cand, last, len(spread), len(matches), per_rank, margin, step, waits,
                    _busy_part(run, cand) if named else None)


def report(run: PerfRun, out: TextIO) -> int:
    """Print the slow-rank report of ``run``; 1 when a rank is named, else 0."""
    s = find_slow_rank(run)
    n_it = max(1, len(run.iterations))
    if s.rank is None:
        if not s.matched:
            print(f"no slow rank: no collective of {run.folder} was recorded by every rank of its group "
                  f"(ranks recorded: {', '.join(map(str, run.ranks))})", file=out)
        else:
            c = s.candidate
            who = (f"rank {c} made the others wait most, {s.caused_ms[c]:.1f} ms per iteration, "
                   f"{s.margin:.1%} of the step more than the next rank") if c is not None else "no collective spread"
            print(f"no slow rank: {who}; a slow rank makes the others wait {MIN_SHARE:.0%} of the step or more "
                  f"beyond the next rank ({s.matched} collectives matched across ranks, iterations "
                  f"{_span(run.iterations)})", file=out)
        _waits(s, out)
        return 0
    others = [w for r, w in s.wait_ms.items() if r != s.rank]
    mine, theirs = s.wait_ms.get(s.rank, 0.0), median(others)
    if mine < 0.5 * theirs:
        how = f"busy computing: it waited {mine:.1f} ms per iteration in collectives, the others {theirs:.1f} ms"
        if s.busy_part is not None and s.busy_part[2] > 0:
            how += (f"; its {s.busy_part[0]} {s.busy_part[1]} took {s.busy_part[2]:.1f} ms more than the other "
                    "ranks' (outside collectives)")
    else:
        how = (f"waiting: it waited {mine:.1f} ms per iteration in collectives itself (the others {theirs:.1f} ms), "
               "so it is held up by something this recording does not see (host, I/O, another group)")
    print(f"slow rank: rank {s.rank} arrives last at {s.last.get(s.rank, 0) / n_it:.0f} of "
          f"{s.matched / n_it:.0f} collectives per iteration, making the others wait "
          f"{s.caused_ms[s.rank]:.1f} ms per iteration ({s.caused_ms[s.rank] / s.step_ms:.0%} of the step): {how}",
          file=out)
    _waits(s, out)
    return 1


def _waits(s: SlowRank, out: TextIO) -> None:
    print("rank  last arrivals  made others wait (ms/iteration)  waited for others (ms/iteration)", file=out)
    for r in sorted(s.wait_ms):
        print(f"{r:>4}  {s.last.get(r, 0):>13}  {s.caused_ms.get(r, 0.0):>31.2f}  {s.wait_ms[r]:>32.2f}", file=out)


def _span(values: list[int]) -> str:
    return f"{values[0]}-{values[-1]}" if values else "none"


def describe(run: PerfRun) -> dict[str, Any]:
    """The figures as JSON (``--json``)."""
    return dataclasses.asdict(find_slow_rank(run))
