"""`portspeed compare --perf RUN` with one run: a slow group or link, or that there is none.

Why from one run: a link that is slow (a bad cable, a CCL that stages through the host for one group, a
route across a slower fabric) shows as a group that moves the same bytes with the same collective far
slower than another group of the same run does. Comparing groups of one run needs no reference run and
no table measured beforehand; the table (``links``) is printed beside each collective for the rest.

How: each collective matched across its group's ranks (``recordings.Match``) gives its transfer time
(from the last rank's arrival to the first rank leaving it done: waiting for a late rank is the slow
rank's, not the link's) and so its bus bandwidth (nccl-tests' factors). For each collective and message
size moved by two or more groups, each group's best call (its shortest transfer) is set against the fastest
group's best. The best and not the median: on a shared host a rank asleep in the collective is woken
late, which only ever adds time, and did so on most calls of a clean 3-rank run on 2 busy cores; a link
that is slow is slow on every call, its best included. A group is slow when the fastest is
``SLOW_FACTOR`` times faster and its best call at least ``NOISE_MS`` longer.

A group not named against another group (one TP group has none to be set against; on one slow fabric all
groups are alike) is set against the bus bandwidth measured for its link (``portspeed conformance --suites
bandwidth``, read by ``links``) at a message size within a factor of two of its own: the same
``SLOW_FACTOR`` and ``NOISE_MS``, on the same best call.

Line: ``slow link: group [1, 2] moves all_reduce of 64.0 KiB at 0.004 GB/s bus bandwidth at best (15 calls,
the fastest 30.2 ms), 95x below group [0, 1] (0.38 GB/s, 0.3 ms)`` (or ``... below the bus bandwidth measured
for this link ...``) or ``no slow link: ...``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Sequence, TextIO

from portspeed.perf.reading import links as perf_links
from portspeed.perf.reading.recordings import PerfRun

__all__ = ["MIN_CALLS", "NOISE_MS", "SLOW_FACTOR", "BelowLink", "GroupSpeed", "SlowLink", "below_measured",
           "find_slow_links", "group_speeds", "report"]

#: a group is slow when another group moves the same bytes with the same collective this many times faster
SLOW_FACTOR = 4.0
#: and its best transfer is at least this much longer (below it, scheduling noise on a shared host)
NOISE_MS = 1.0
#: calls a group needs of one collective and size before its median is compared
MIN_CALLS = 3


@dataclasses.dataclass
class GroupSpeed:
    """One group's calls of one collective at one message size: its best call's transfer and bus bandwidth."""

    op: str
    nbytes: int
    group: tuple[int, ...]
    calls: int
    transfer_ms: float
    gbps: float


@dataclasses.dataclass
class SlowLink:
    slow: GroupSpeed
    fast: GroupSpeed

    @property
    def factor(self) -> float:
        return self.fast.gbps / self.slow.gbps if self.slow.gbps > 0 else float("inf")


def group_speeds(run: PerfRun) -> list[GroupSpeed]:
    """Every (collective, bytes, group) of ``run`` with two or more ranks, from its matched calls."""
    got: dict[tuple[str, int, tuple[int, ...]], list[float]] = {}
    for it in run.iterations:
        for m in run.matches(it):
            if len(m.group) < 2:
                continue
            times = [t for t in (m.transfer_ms(r) for r in m.calls) if t is not None]
            nbytes = int(next(iter(m.calls.values())).get("bytes") or 0)
            if times and nbytes > 0:  # done when the first rank left it done
                got.setdefault((m.op, nbytes, m.group), []).append(min(times))
    out = []
    for (op, nbytes, group), times in got.items():
        ms = min(times)
        gbps = nbytes * perf_links.bus_factor(op, len(group)) / (max(ms, 1e-6) * 1e-3) / 1e9
        out.append(GroupSpeed(op, nbytes, group, len(times), ms, gbps))
    return out


def find_slow_links(run: PerfRun) -> tuple[list[SlowLink], int]:
    """The slow groups of ``run``, slowest against its fastest peer first; and how many (collective, size) pairs
    two or more groups moved (what could be compared)."""
    by_size: dict[tuple[str, int], list[GroupSpeed]] = {}
    for g in group_speeds(run):
        if g.calls >= MIN_CALLS:
            by_size.setdefault((g.op, g.nbytes), []).append(g)
    found, compared = [], 0
    for peers in by_size.values():
        if len({g.group for g in peers}) < 2:
            continue
        compared += 1
        fast = max(peers, key=lambda g: g.gbps)
        for g in peers:
            if g is not fast and g.transfer_ms - fast.transfer_ms >= NOISE_MS \
                    and fast.gbps >= SLOW_FACTOR * g.gbps:
                found.append(SlowLink(g, fast))
    found.sort(key=lambda s: -s.factor)
    return found, compared


@dataclasses.dataclass
class BelowLink:
    """A group's best call set against the bus bandwidth measured for its link at a size near its own."""

    slow: GroupSpeed
    measured_gbps: float
    measured_bytes: int

    @property
    def factor(self) -> float:
        return self.measured_gbps / self.slow.gbps if self.slow.gbps > 0 else float("inf")


def below_measured(run: PerfRun, links: Sequence[dict[str, Any]],
                   skip: Collection[tuple[int, ...]] = ()) -> list[BelowLink]:
    """The groups of ``run`` (those in ``skip`` left out) whose best call is ``SLOW_FACTOR`` times below the bus
    bandwidth measured for RUN's link (``links``: the table) at a message size within 2x of theirs."""
    link = perf_links.find_link(links, *perf_links.run_link(run))
    if link is None:
        return []
    found = []
    for g in group_speeds(run):
        row = perf_links.measured(link, g.op, len(g.group), g.nbytes)
        if g.calls < MIN_CALLS or g.group in skip or row is None or not row.get("busbw_gbs") \
                or abs(math.log2(row["bytes"] / g.nbytes)) > 1:
            continue
        ref = float(row["busbw_gbs"])
        expected_ms = g.nbytes * perf_links.bus_factor(g.op, len(g.group)) / (ref * 1e9) * 1e3
        if ref >= SLOW_FACTOR * g.gbps and g.transfer_ms - expected_ms >= NOISE_MS:
            found.append(BelowLink(g, ref, int(row["bytes"])))
    found.sort(key=lambda b: -b.factor)
    return found


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def _group(g: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, g)) + "]"


def _speed(g: GroupSpeed) -> str:
    return (f"group {_group(g.group)} moves {g.op} of {_size(g.nbytes)} at {g.gbps:.3g} GB/s bus bandwidth at best "
            f"({g.calls} calls, the fastest {g.transfer_ms:.1f} ms)")


_LOOK = ("look at the link between these ranks, or at what its backend does for this group (`portspeed info`, the "
         "router's rewrites in the table below)")


def report(run: PerfRun, out: TextIO, links: Sequence[dict[str, Any]] = ()) -> int:
    """Print the slow-link finding of ``run`` (one line per slow group), against the other groups and then against
    the bandwidth measured for the link (``links``: the table); 1 when a group is named, else 0."""
    found, compared = find_slow_links(run)
    below = below_measured(run, links, {s.slow.group for s in found})
    for s in found:
        print(f"slow link: {_speed(s.slow)}, {s.factor:.0f}x below group {_group(s.fast.group)} "
              f"({s.fast.gbps:.3g} GB/s, {s.fast.transfer_ms:.1f} ms): {_LOOK}", file=out)
    for b in below:
        print(f"slow link: {_speed(b.slow)}, {b.factor:.0f}x below the bus bandwidth measured for this link "
              f"({b.measured_gbps:.3g} GB/s at {_size(b.measured_bytes)} in the link's bandwidth table): {_LOOK}",
              file=out)
    if found or below:
        return 1
    why = (f"{compared} collective(s) and size(s) moved by two or more groups, none {SLOW_FACTOR:g}x slower "
           f"than another group's" if compared else
           "no two groups moved the same bytes with the same collective: nothing to compare")
    measured = perf_links.find_link(links, *perf_links.run_link(run)) is not None
    against = (f"none {SLOW_FACTOR:g}x below the bandwidth measured for the link" if measured else
               "no bandwidth measured for the link to set a group against (the note under the table below)")
    print(f"no slow link: {why}; {against}", file=out)
    return 0


def describe(run: PerfRun, links: Sequence[dict[str, Any]] = ()) -> dict:
    """The finding as JSON (``--json``)."""
    found, compared = find_slow_links(run)
    slow = [dataclasses.asdict(s.slow) | {"fast": dataclasses.asdict(s.fast), "factor": s.factor} for s in found]
    below = [dataclasses.asdict(b.slow) | {"measured_gbps": b.measured_gbps, "measured_bytes": b.measured_bytes,
                                           "factor": b.factor}
             for b in below_measured(run, links, {s.slow.group for s in found})]
    return {"compared": compared, "slow": slow, "below_measured": below}
