"""Plot loss curves and their differences to the reference (optional: needs matplotlib).

matplotlib is an optional dependency (``pip install portspeed[plot]``; loaded by ``portspeed.plotting``). Without it,
`plot_comparisons` raises `PlotUnavailableError` with that instruction; `portspeed compare`
prints it and still reports and decides the exit status from the numbers, because a
missing plotting library says nothing about whether the losses agree.

The figure has two panels per metric: the curves of every run, and ``|run - ref|`` on a
log scale with the tolerance band drawn, so the iteration where a run leaves the band is
visible. Skipped iterations are gaps; NaN iterations are marked with an ``x`` at the top.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from portspeed.errors import PortspeedError
from portspeed.plotting import load_pyplot
from portspeed.parity.tolerance import Comparison

__all__ = ["plot_comparisons"]


def _nan_to_none(x: float | None) -> float:
    return math.nan if x is None else x


def plot_comparisons(comps: Sequence[Comparison], path: str | Path) -> Path:
    """Draw every comparison (grouped by metric) into one PNG at ``path`` and return the path."""
    if not comps:
        raise PortspeedError("nothing to plot: no comparisons")
    plt = load_pyplot()
    metrics = list(dict.fromkeys(c.metric for c in comps))
    fig, axes = plt.subplots(2, len(metrics), figsize=(7 * len(metrics), 7), squeeze=False, sharex="col")
    for col, metric in enumerate(metrics):
        mc = [c for c in comps if c.metric == metric]
        top, bottom = axes[0][col], axes[1][col]
        rows0 = mc[0].rows
        xs = [r.iteration for r in rows0]
        # zero differences are drawn at one floor below every nonzero one (log axis), not dropped
        pos = [r.abs_diff for c in mc for r in c.rows if r.abs_diff]
        floor = min(pos + [mc[0].tolerance.atol or 1e-12]) / 10
        top.plot(xs, [_nan_to_none(r.ref) for r in rows0], "k-", lw=2,
                 label=f"reference: {Path(mc[0].reference.source).name}")
        for i, c in enumerate(mc, 1):
            line = top.plot(xs, [_nan_to_none(r.value) for r in c.rows], "--", lw=1.2,
                            label=f"run {i}: {Path(c.run.source).name}")[0]
            nans = [r.iteration for r in c.rows if r.value is not None and math.isnan(r.value)]
            if nans:
                top.plot(nans, [top.get_ylim()[1]] * len(nans), "x", color=line.get_color())
            diffs = [(r.iteration, r.abs_diff) for r in c.rows if r.abs_diff is not None]
            if diffs:
                bottom.plot([n for n, _ in diffs], [max(d, floor) for _, d in diffs], ".-", color=line.get_color(),
                            label=f"run {i}")
            fd = c.first_divergence
            if fd is not None:
                bottom.axvline(fd.iteration, color=line.get_color(), ls=":", lw=1)
        bands = [(r.iteration, r.band) for r in rows0 if r.band is not None]
        if bands:
            bottom.plot([n for n, _ in bands], [b for _, b in bands], "r-", lw=1, label="tolerance band")
        top.set_title(metric)
        top.set_ylabel(metric)
        top.legend(fontsize=8)
        bottom.set_yscale("log")
        bottom.set_xlabel("iteration")
        bottom.xaxis.get_major_locator().set_params(integer=True)
        bottom.set_ylabel(f"|run - reference| ({metric})")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
