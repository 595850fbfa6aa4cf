"""A perf recording read back (``DIR/rank<R>.jsonl``, written by ``portspeed.perf.writer``), checked, indexed.

Why its own module: both readers, the two-run comparison (``compare``) and the one-run slow-rank
report (``slow_rank``), need the same things: every (iteration, rank) line, each part's share of the step,
and each collective matched across the ranks of its group (same group, op and per-group sequence
number), which is what separates waiting for the last rank from moving bytes. Nothing here imports
torch or the recording side (the parity layer reads files only); a folder that cannot be used raises
``PerfInputError`` naming the file and what is wrong.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import statistics
from typing import Any, Iterator

from portspeed.errors import PortspeedError

__all__ = ["PerfInputError", "PerfRun", "Match", "read_run", "share", "median"]

FORMAT, VERSION = "portspeed-perf", 1
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


class PerfInputError(PortspeedError, ValueError):
    """A perf recording that cannot be compared (missing, empty, not this format)."""


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


@dataclasses.dataclass
class Match:
    """One collective as every rank of its group saw it, in one iteration."""

    iteration: int
    op: str
    group: tuple[int, ...]
    seq: int
    calls: dict[int, dict[str, Any]]  # rank -> its call

    @property
    def last_rank(self) -> int:
        return max(self.calls, key=lambda r: self.calls[r]["enter"])

    @property
    def spread_ms(self) -> float:
        """How long the first rank to arrive waited for the last one."""
        enters = [c["enter"] for c in self.calls.values()]
        return (max(enters) - min(enters)) * 1e3

    def wait_ms(self, rank: int) -> float:
        """How long ``rank`` waited for the last rank to arrive."""
        return (max(c["enter"] for c in self.calls.values()) - self.calls[rank]["enter"]) * 1e3

    def transfer_ms(self, rank: int) -> float | None:
        """From the last rank's arrival to ``rank``'s leaving (None: no leave time, a coalesced call)."""
        leave = self.calls[rank].get("leave")
        if leave is None:
            return None
        return max(0.0, (leave - max(c["enter"] for c in self.calls.values())) * 1e3)


@dataclasses.dataclass
class PerfRun:
    """Every line of one recording: ``lines[(iteration, rank)]``."""

    folder: str
    lines: dict[tuple[int, int], dict[str, Any]]

    @property
    def iterations(self) -> list[int]:
        return sorted({i for i, _ in self.lines})

    @property
    def ranks(self) -> list[int]:
        return sorted({r for _, r in self.lines})

    @property
    def clocks(self) -> list[str]:
        return sorted({line.get("clock", "?") for line in self.lines.values()})

    def parts(self, iteration: int, rank: int) -> dict[tuple[str, str], dict[str, Any]]:
        """The line's parts by (path, phase)."""
        return {(p["path"], p["phase"]): p for p in self.lines[(iteration, rank)]["parts"]}

    def matches(self, iteration: int) -> Iterator[Match]:
        """The collectives of ``iteration`` that every rank of their group recorded."""
        by_key: dict[tuple, dict[int, dict[str, Any]]] = {}
        for (it, rank), line in self.lines.items():
            if it != iteration:
                continue
            for call in line.get("collectives", []):
                key = (call["op"], tuple(call.get("group") or ()), call["seq"])
                by_key.setdefault(key, {})[rank] = call
        for (op, group, seq), calls in by_key.items():
            if len(group) > 1 and set(group) <= set(calls):
                yield Match(iteration, op, group, seq, {r: calls[r] for r in group})


def share(line: dict[str, Any], part: dict[str, Any] | None) -> float:
    """A part's own time as a percentage of its line's step."""
    step = float(line.get("step_ms") or 0.0)
    return 100.0 * float(part["self_ms"]) / step if part is not None and step > 0 else 0.0


def read_run(folder: str) -> PerfRun:
    """Every ``rank<R>.jsonl`` of ``folder``; ``PerfInputError`` naming what cannot be used."""
    if not os.path.isdir(folder):
        raise PerfInputError(f"{folder!r} is not a folder; give the folder `portspeed run --perf DIR` wrote")
    files = sorted(f for f in glob.glob(os.path.join(folder, "rank*.jsonl")) if _RANK_FILE.match(os.path.basename(f)))
    if not files:
        raise PerfInputError(f"{folder!r} holds no perf recording (rank<R>.jsonl); was the run started with "
                             "`portspeed run --perf DIR` (or PORTSPEED_PERF) and did it reach a timed iteration "
                             "(--perf-iterations, default 2:4)?")
    lines: dict[tuple[int, int], dict[str, Any]] = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            for n, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    line = json.loads(text)
                except ValueError:
                    raise PerfInputError(f"{path}:{n} is not JSON; the recording is damaged") from None
                if not isinstance(line, dict) or line.get("format") != FORMAT:
                    raise PerfInputError(f"{path}:{n} is not a portspeed perf line (format {FORMAT!r})")
                if line.get("version") != VERSION:
                    raise PerfInputError(f"{path}:{n} is perf format version {line.get('version')!r}; this "
                                         f"portspeed reads version {VERSION}")
                try:
                    lines[(int(line["iteration"]), int(line["rank"]))] = line
                    _ = [(p["path"], p["phase"], float(p["self_ms"])) for p in line["parts"]]
                    float(line["step_ms"])
                except (KeyError, TypeError, ValueError):
                    raise PerfInputError(f"{path}:{n} lacks the iteration, rank, step_ms or parts of a perf "
                                         "line") from None
    return PerfRun(folder, lines)
