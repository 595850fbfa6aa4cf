"""`portspeed compare --perf ... --png FILE`: the comparison's shares of the step as one picture.

Why: the first line names one part; the picture shows it among the others, so a reader sees at a glance
whether one part grew or many grew a little. It draws the figures the comparison already computed, never
its own: with REF and RUN, the rows of ``compare.compare_runs`` (RUN's share at its median iteration
beside REF's highest share), one row per part (its rank with the largest excess), sorted by the excess, the
part the first line names in red; with one run, ``slow_rank.find_slow_rank``'s waiting per rank as a share
of the step beside the rest of the step (computing and transfers), the slow rank in red.

matplotlib is optional as for ``--plot`` (``portspeed.plotting``: the same error and install hint): without it
`png_or_note` says so and the comparison still prints and decides the exit status. A path that cannot be
written raises ``PerfInputError`` naming it; the drawing comes before anything is printed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from portspeed.perf.reading.recordings import PerfInputError, PerfRun
from portspeed.plotting import PlotUnavailableError, load_pyplot

if TYPE_CHECKING:
    from portspeed.perf.reading.compare import Excess
    from portspeed.perf.reading.slow_rank import SlowRank

__all__ = ["TOP", "Drawn", "png_or_note", "share_rows", "draw_shares", "draw_ranks"]

#: the parts drawn: the largest excesses (the first line's part is always the first)
TOP = 15
#: percent of the step under which a part is not drawn on either side (dozens of tiny modules, -0.1 points each,
#: would push out the parts that shrank while the named one grew)
MIN_SHARE = 0.5
DPI = 100
_REF, _RUN, _NAMED, _WAIT = "#9e9e9e", "#3b75af", "#c62828", "#f0a030"


@dataclasses.dataclass
class Drawn:
    """What a PNG shows: its bar labels top to bottom (as drawn), the one in red, its title, its size in pixels."""

    path: str
    labels: list[str]
    highlighted: str | None
    title: str
    size: tuple[int, int]  # (width, height)
    what: str

    @property
    def note(self) -> str:
        return f"\n{self.what}: {self.path} ({len(self.labels)} bars{self._red()})"

    def _red(self) -> str:
        return f"; in red: {self.highlighted}" if self.highlighted else ""


def png_or_note(path: str | None, err: TextIO) -> str | None:
    """``path`` when a PNG can be drawn; without matplotlib, None after one note on ``err`` saying how to install
    it (a missing plotting library says nothing about where a run is slow)."""
    if not path:
        return None
    try:
        load_pyplot("--png")
    except PlotUnavailableError as e:
        print(f"portspeed compare: note: {e}; the comparison still decides the exit status", file=err)
        return None
    return path


def share_rows(excesses: list[Excess], top: int = TOP) -> list[Excess]:
    """One row per part (path, phase): its rank with the largest excess, largest first, at most ``top``; a part
    under ``MIN_SHARE`` on both sides is left out (dozens of empty modules would bury the few that matter)."""
    seen: set[tuple[str, str]] = set()
    rows: list[Excess] = []
    for e in excesses:  # compare_runs sorts them largest first
        if max(e.run_share, e.ref_share) < MIN_SHARE:
            continue
        if (e.path, e.phase) not in seen and len(rows) < top:
            seen.add((e.path, e.phase))
            rows.append(e)
    return rows


def _describe(run: PerfRun) -> str:
    """Device, layout, ranks and clock of a recording, from its first line."""
    line = run.lines[min(run.lines)] if run.lines else {}
    lay = line.get("layout") or {}
    layout = " ".join(f"{k}{lay[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if isinstance(lay.get(k), int))
    device = line.get("device") or "device not recorded"
    return f"{device}, {layout or 'layout not recorded'}, {len(run.ranks)} ranks, clock {'/'.join(run.clocks)}"


def _name(run: PerfRun) -> str:
    return Path(run.folder.rstrip("/")).name or run.folder


def draw_shares(ref: PerfRun, run: PerfRun, excesses: list[Excess], threshold: float, path: str) -> Drawn:
    """REF beside RUN: each drawn part's share of the step, the part the first line names in red."""
    plt = load_pyplot("--png")
    rows = share_rows(excesses)
    named = rows[0] if rows and rows[0].points > threshold else None
    several = len(run.ranks) > 1
    labels = [f"{e.path} {e.phase}" + (f" (rank {e.rank})" if several else "") for e in rows]
    fig, ax = plt.subplots(figsize=(12, max(3.0, 0.42 * len(rows) + 1.8)))
    ys = list(range(len(rows)))
    ax.barh([y - 0.2 for y in ys], [e.ref_share for e in rows], height=0.4, color=_REF,
            label=f"REF {_name(ref)}: its highest share (any iteration, any rank)")
    bars = ax.barh([y + 0.2 for y in ys], [e.run_share for e in rows], height=0.4, color=_RUN,
                   label=f"RUN {_name(run)}: its share at its median iteration")
    ax.legend(fontsize=8, loc="lower right")  # before the named bar turns red: the legend's swatch is blue
    if named is not None:
        bars[0].set_color(_NAMED)
    for y, e in zip(ys, rows):
        ax.text(max(e.run_share, e.ref_share), y, f"  {e.points + 0.0:+.1f} points", va="center", fontsize=8,
                color=_NAMED if e is named else "black")
    ax.set_yticks(ys, labels, fontsize=8)
    if named is not None:
        ax.get_yticklabels()[0].set_color(_NAMED)
        ax.get_yticklabels()[0].set_fontweight("bold")
    ax.invert_yaxis()
    ax.set_xlabel("% of the step (the part's own time, its children's taken out)")
    ax.margins(x=0.12)
    verdict = (f"named: {labels[0]} (+{named.points:.1f} points)" if named is not None
               else "no part named")
    ax.set_title(f"REF {_name(ref)}: {_describe(ref)}\nRUN {_name(run)}: {_describe(run)}\n"
                 f"threshold {threshold:g} points beyond REF's highest share\n{verdict}", fontsize=9)
    _empty(ax, rows, "nothing to compare: no part in either recording")
    return _save(plt, fig, ax, path, "module shares of REF and RUN")


def draw_ranks(run: PerfRun, slow: SlowRank, path: str) -> Drawn:
    """One run, per rank: waiting for other ranks in collectives vs the rest of the step, the slow rank in red."""
    plt = load_pyplot("--png")
    ranks = sorted(slow.wait_ms)
    ys = list(range(len(ranks)))
    step = slow.step_ms if slow.step_ms > 0 else 1.0
    waited = [min(100.0, 100.0 * slow.wait_ms[r] / step) for r in ranks]
    labels = [f"rank {r}" for r in ranks]
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.5 * len(ranks) + 1.8)))
    rest = [100.0 - w for w in waited]
    bars = ax.barh(ys, rest, color=_RUN, label="the rest of the step: computing (and transferring)")
    ax.barh(ys, waited, left=rest, color=_WAIT, label="waiting for other ranks in collectives")
    fig.legend(fontsize=8, loc="lower center", ncol=2)  # before the slow rank's bar turns red
    for y, r in zip(ys, ranks):
        made = 100.0 * slow.caused_ms.get(r, 0.0) / step
        ax.text(1, y, f"made the others wait {made:.0f}% of the step", va="center", fontsize=8, color="white")
    ax.set_yticks(ys, labels)
    if slow.rank is not None:
        bars[ranks.index(slow.rank)].set_color(_NAMED)
        ax.get_yticklabels()[ranks.index(slow.rank)].set_color(_NAMED)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel(f"% of the step (median per iteration; the median step is {slow.step_ms:.1f} ms)")
    verdict = f"slow rank: rank {slow.rank}" if slow.rank is not None else "no slow rank"
    ax.set_title(f"{_name(run)}: {_describe(run)}\n{verdict} ({slow.matched} collectives matched across ranks)",
                 fontsize=9)
    _empty(ax, ranks, "no rank recorded")
    return _save(plt, fig, ax, path, "per-rank waiting and computing", bottom=0.45 / fig.get_size_inches()[1])


def _empty(ax: Any, rows: list[Any], text: str) -> None:
    if not rows:
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _save(plt: Any, fig: Any, ax: Any, path: str, what: str, bottom: float = 0.0) -> Drawn:
    """Write the figure at its own size (no tight crop: the size in pixels is the figure's), then close it; the
    labels, the red one and the title are read back from the axes, as drawn."""
    labels, title = [t.get_text() for t in ax.get_yticklabels()], ax.get_title()
    red = [t.get_text() for t in ax.get_yticklabels() if t.get_color() == _NAMED]
    fig.tight_layout(rect=(0.0, bottom, 1.0, 1.0))
    width, height = (int(round(v * DPI)) for v in fig.get_size_inches())
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=DPI)
    except OSError as e:
        raise PerfInputError(f"--png {path!r} cannot be written ({e.strerror or e}: {e.filename}); give a file in "
                             "a writable folder") from None
    finally:
        plt.close(fig)
    return Drawn(str(path), labels, red[0] if red else None, title, (width, height), what)
