"""`portspeed compare`: do two or more runs agree, iteration by iteration, within tolerance?

    portspeed compare REF.log RUN.json [RUN ...] [--atol X] [--rtol X] [--dtype bf16]
                      [--metric lm_loss|grad_norm] [--iterations FIRST:LAST]
                      [--plot out.png] [--json out.json] [--markdown out.md]
    portspeed compare SPEC.json [--workdir DIR]           # launch the runs a spec lists, then compare
    portspeed compare --probe REF_DIR RUN_DIR [--iterations A:B] [--rtol X] [--json out.json]
                                                           # where two probed runs part (probe.reading.compare)
    portspeed compare --perf REF_DIR RUN_DIR [--threshold POINTS] [--json out.json]
                                                           # where RUN is slow against REF (perf.reading.compare)
    portspeed compare --perf RUN_DIR [--chrome trace.json]  # one run's slow rank and slow link (perf.reading), its
                                                           # timeline
                                                           # both --perf forms: [--bandwidth FILE], the link table
                                                           # `portspeed conformance --suites bandwidth` wrote
    portspeed compare --perf [REF_DIR] RUN_DIR --png shares.png  # the shares drawn (perf.reading.plot; matplotlib)

The first RUN is the reference. Exit status: 0 every run within tolerance, 1 some run
outside it, 2 bad input (missing file, unknown format, no loss lines, mismatched iteration
ranges, a spec run that failed) with a message naming which. Without matplotlib,
``--plot`` prints how to install it and the comparison still decides the exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from portspeed.errors import PortspeedError
from portspeed.parity.losslog import LossRecord, read_record
from portspeed.parity.tolerance import METRICS, Comparison, Tolerance, compare_many, pick_tolerance
from portspeed.settings import BY_ENV

__all__ = ["main", "build_parser", "format_table", "format_markdown", "report_json"]

log = logging.getLogger("portspeed.parity.compare")

EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    p = argparse.ArgumentParser(
        prog="portspeed compare",
        description="Compare per-iteration losses of runs against the first (the reference). "
                    "A RUN is a Megatron log, a JSON loss record, or a JSON run spec to launch.",
        epilog="exit status: 0 within tolerance, 1 outside, 2 bad input",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="Megatron log, JSON loss record, or JSON run spec")
    p.add_argument("--atol", type=_nonneg, help="absolute tolerance (default from the dtype: fp32 1e-5)")
    p.add_argument("--rtol", type=_nonneg, help="relative tolerance, times |reference| (default from the dtype)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "float32", "bfloat16", "float16"],
                   help="pick default tolerances for this dtype (else the records' meta.dtype, else fp32)")
    p.add_argument("--metric", action="append", choices=METRICS,
                   help="what to compare (repeatable; default lm_loss)")
    p.add_argument("--iterations", metavar="FIRST:LAST", type=_window,
                   help="compare only iterations FIRST..LAST inclusive (either side may be empty)")
    p.add_argument("--plot", metavar="FILE.png", help="write loss curves and their differences (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write a markdown summary")
    p.add_argument("--rows", type=int, default=30, metavar="N",
                   help="print at most about N table rows (always keeps the first divergence); 0 = all")
    p.add_argument("--workdir", metavar="DIR", default="portspeed-runs",
                   help="where spec-launched runs write records and logs (default ./portspeed-runs)")
    p.add_argument("--probe", action="store_true",
                   help="the two RUNs are probe dump folders (`portspeed run --probe DIR`): name the first module "
                        "whose output, gradient or parameter leaves its band (--rtol sets every band)")
    p.add_argument("--perf", action="store_true",
                   help="the RUNs are perf recordings (`portspeed run --perf DIR`): with REF RUN, name the part whose "
                        "share of the step grew most and why; with one RUN, name the slow rank")
    p.add_argument("--threshold", type=_nonneg, default=None, metavar="POINTS",
                   help="--perf: name a part only when its share of the step grew by more than POINTS percentage "
                        "points (default 10)")
    p.add_argument("--chrome", default=None, metavar="FILE",
                   help="--perf: also write RUN's timeline as a Chrome trace (Perfetto, chrome://tracing)")
    p.add_argument("--bandwidth", default=None, metavar="FILE",
                   help="--perf: the link bandwidth table `portspeed conformance --suites bandwidth` wrote (default "
                        "PORTSPEED_BANDWIDTH, else ~/.cache/portspeed/bandwidth.json)")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="--perf: also draw the shares as a PNG (REF beside RUN; one RUN: per rank; needs matplotlib)")
    return p


#: options of the loss comparison that mean nothing to --probe
_NOT_WITH_PROBE = ("atol", "dtype", "metric", "plot", "markdown")


def _nonneg(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{s!r} must be a finite number >= 0")
    return v


def _window(s: str) -> tuple[int | None, int | None]:
    lo, sep, hi = s.partition(":")
    try:
        if not sep:
            raise ValueError
        a = int(lo) if lo.strip() else None
        b = int(hi) if hi.strip() else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not FIRST:LAST (e.g. 1:10, 5:, :20)") from None
    if a is not None and b is not None and a > b:
        raise argparse.ArgumentTypeError(f"{s!r}: FIRST is after LAST")
    return a, b


# ----------------------------------------------------------------------------- formatting

def _f(x: float | None, width: int = 12, skipped: bool = True) -> str:
    if x is None:
        return ("skipped" if skipped else "-").rjust(width)
    if math.isnan(x):
        return "nan".rjust(width)
    return f"{x:.7g}".rjust(width)


def _d(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _keep_rows(n: int, first_bad: int | None, limit: int) -> list[int]:
    """Row indices to print: all if few, else head, tail and a window around the first divergence."""
    if limit <= 0 or n <= limit:
        return list(range(n))
    keep = set(range(min(5, n))) | set(range(max(0, n - 5), n))
    if first_bad is not None:
        keep |= set(range(max(0, first_bad - 3), min(n, first_bad + 4)))
    return sorted(keep)


def format_table(comps: Sequence[Comparison], tol: Tolerance, origin: str, limit: int = 30) -> str:
    """The terminal report: one table per metric (reference and each run side by side), then a verdict per run."""
    out: list[str] = []
    ref = comps[0].reference
    out.append(f"reference: {ref.source}" + _meta_str(ref))
    out.append(f"tolerance: |run - ref| <= {tol.atol:g} + {tol.rtol:g}*|ref|   ({origin})")
    for metric in dict.fromkeys(c.metric for c in comps):
        mc = [c for c in comps if c.metric == metric]
        out.append("")
        out.append(f"{metric}:")
        header = f"{'iter':>6} | {'reference':>12}"
        for i, _ in enumerate(mc, 1):
            header += f" | {'run ' + str(i):>12} {'|diff|':>9}  "
        out.append(header)
        out.append("-" * len(header))
        n = len(mc[0].rows)
        bads = [i for i in range(n) if any(not c.rows[i].ok for c in mc)]
        keep = _keep_rows(n, bads[0] if bads else None, limit)
        prev = -1
        for i in keep:
            if i != prev + 1:
                out.append(f"{'...':>6} |")
            prev = i
            r0 = mc[0].rows[i]
            line = f"{r0.iteration:>6} | {_f(r0.ref, skipped='skipped' in r0.reason)}"
            for c in mc:
                r = c.rows[i]
                mark = "  " if r.ok else " !"
                line += f" | {_f(r.value, skipped='skipped' in r.reason)} {_d(r.abs_diff):>9}{mark}"
            out.append(line)
    out.append("")
    for i, c in enumerate(comps, 1):
        out.append(_verdict(i, c))
    return "\n".join(out)


def _meta_str(rec: LossRecord) -> str:
    m = rec.meta
    bits = [f"{k}={m[k]}" for k in ("backend", "accelerator", "dtype") if m.get(k)]
    lay = m.get("layout")
    if isinstance(lay, dict):
        bits.append("layout " + ",".join(f"{k}{v}" for k, v in lay.items() if v is not None))
    return f"  ({'; '.join(bits)})" if bits else ""


def _verdict(i: int, c: Comparison) -> str:
    head = f"run {i} {c.metric}: {c.run.source}{_meta_str(c.run)}\n    "
    lg = c.largest
    largest = (f"largest |diff| {lg.abs_diff:.3e} at iteration {lg.iteration}"
               f" (rel {lg.rel_diff:.3e})" if lg and lg.rel_diff is not None else "no finite pair")
    if c.ok:
        return head + f"MATCH: {len(c.rows)}/{len(c.rows)} iterations within tolerance; {largest}"
    fd = c.first_divergence
    assert fd is not None
    what = (f"|diff| {fd.abs_diff:.3e} > band {fd.band:.3e}" if fd.reason == "out of band" else fd.reason)
    return head + (f"DIVERGED at iteration {fd.iteration}: ref {_f(fd.ref, 0)} vs run {_f(fd.value, 0)} "
                   f"({what}); {c.n_failed}/{len(c.rows)} iterations outside; {largest}")


def format_markdown(comps: Sequence[Comparison], tol: Tolerance, origin: str) -> str:
    """A markdown summary for PR comments and docs."""
    ref = comps[0].reference
    ok = all(c.ok for c in comps)
    lines = [
        f"## Loss parity: {'MATCH' if ok else 'DIVERGED'}",
        "",
        f"Reference: `{ref.source}`{_meta_str(ref)}  ",
        f"Tolerance: `|run - ref| <= {tol.atol:g} + {tol.rtol:g}*|ref|` ({origin})",
        "",
        "| run | metric | status | iterations | first divergence | largest abs diff |",
        "|---|---|---|---|---|---|",
    ]
    for c in comps:
        fd, lg = c.first_divergence, c.largest
        fd_s = "-" if fd is None else (f"{fd.iteration} ({fd.reason}: ref {_f(fd.ref, 0)}, run {_f(fd.value, 0)})")
        lg_s = "-" if lg is None else f"{lg.abs_diff:.3e} @ {lg.iteration}"
        lines.append(f"| `{c.run.source}` | {c.metric} | {'match' if c.ok else '**diverged**'} | "
                     f"{len(c.rows) - c.n_failed}/{len(c.rows)} within | {fd_s} | {lg_s} |")
    return "\n".join(lines) + "\n"


def report_json(comps: Sequence[Comparison], tol: Tolerance, origin: str, exit_code: int) -> dict[str, Any]:
    """The machine-readable report written by --json."""
    ref = comps[0].reference
    return {
        "status": "match" if exit_code == EXIT_OK else "diverged",
        "exit_code": exit_code,
        "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "origin": origin, "why": tol.why},
        "reference": {"source": ref.source, "meta": ref.meta},
        "comparisons": [c.to_json() for c in comps],
    }


# ----------------------------------------------------------------------------- main

def _load_inputs(paths: Sequence[str], workdir: str, err: TextIO) -> list[LossRecord]:
    records: list[LossRecord] = []
    for p in paths:
        if _is_spec(Path(p)):
            from portspeed.parity.runspec import load_spec, run_spec  # only spec users pay for the launcher
            spec = load_spec(p)
            print(f"portspeed compare: launching {len(spec.runs)} run(s) from {p} in {workdir}", file=err)
            records.extend(run_spec(spec, workdir, progress=err))
        else:
            records.append(read_record(p))
    return records


def _is_spec(p: Path) -> bool:
    if p.suffix.lower() != ".json" or not p.is_file():
        return False
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and ("runs" in data or "matrix" in data) and "iterations" not in data


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point for `portspeed compare`; returns the exit status (0 / 1 / 2)."""
    out = out or sys.stdout
    err = err or sys.stderr
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse already printed the usage error
        return EXIT_BAD_INPUT if e.code else EXIT_OK
    if args.perf:
        return _main_perf(args, out, err)
    if any(v is not None for v in (args.threshold, args.chrome, args.bandwidth, args.png)):
        print("portspeed compare: error: --threshold, --chrome, --bandwidth and --png apply to --perf recordings "
              "only", file=err)
        return EXIT_BAD_INPUT
    if args.probe:
        return _main_probe(args, out, err)
    try:
        records = _load_inputs(args.runs, args.workdir, err)
        if len(records) < 2:
            raise PortspeedError(
                f"need at least two runs (a reference and one to compare), got {len(records)} from {list(args.runs)}")
        tol, origin = pick_tolerance(records, args.dtype, args.atol, args.rtol)
        comps = compare_many(records, tol, args.metric or ["lm_loss"], args.iterations or (None, None))
    except PortspeedError as e:
        print(f"portspeed compare: error: {e}", file=err)
        return EXIT_BAD_INPUT
    code = EXIT_OK if all(c.ok for c in comps) else EXIT_DIVERGED
    print(format_table(comps, tol, origin, args.rows), file=out)
    try:
        if args.json:
            _write(args.json, json.dumps(report_json(comps, tol, origin, code), indent=1) + "\n")
        if args.markdown:
            _write(args.markdown, format_markdown(comps, tol, origin))
    except OSError as e:
        print(f"portspeed compare: error: cannot write report: {e}", file=err)
        return EXIT_BAD_INPUT
    if args.plot:
        from portspeed.parity.plot import plot_comparisons
        from portspeed.plotting import PlotUnavailableError
        try:
            path = plot_comparisons(comps, args.plot)
            print(f"plot written to {path}", file=out)
        except PlotUnavailableError as e:
            print(f"portspeed compare: note: {e}; the comparison above still decides the exit status", file=err)
    return code


def _main_probe(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    given = [f"--{o}" for o in _NOT_WITH_PROBE if getattr(args, o) not in (None, False)]
    if given:
        print(f"portspeed compare: error: {' '.join(given)} compare losses, not probe dumps; --probe takes "
              "--iterations, --rtol (every statistic's band, relative to the tensor's scale) and --json", file=err)
        return EXIT_BAD_INPUT
    from portspeed.probe.reading.compare import main_probe  # only --probe users pay for it
    try:
        return main_probe(args.runs, out, args.iterations, args.rtol, args.json)
    except PortspeedError as e:
        print(f"portspeed compare: error: {e}", file=err)
    except OSError as e:
        print(f"portspeed compare: error: cannot write report: {e}", file=err)
    return EXIT_BAD_INPUT


#: options of the loss comparison that mean nothing to --perf
_NOT_WITH_PERF = ("atol", "rtol", "dtype", "metric", "plot", "markdown", "iterations", "probe")


def _main_perf(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    given = [f"--{o}" for o in _NOT_WITH_PERF if getattr(args, o) not in (None, False)]
    if given:
        print(f"portspeed compare: error: {' '.join(given)} do not apply to perf recordings; --perf takes "
              "--threshold, --json, --chrome, --bandwidth and --png", file=err)
        return EXIT_BAD_INPUT
    from portspeed.perf.reading.compare import main_perf  # only --perf users pay for it
    try:
        from portspeed.perf.reading.plot import png_or_note

        bandwidth = None if args.bandwidth is None else BY_ENV["PORTSPEED_BANDWIDTH"].parse("--bandwidth",
                                                                                           args.bandwidth)
        return main_perf(args.runs, out, args.threshold, args.json, args.chrome, bandwidth,
                         png_or_note(args.png, err))
    except PortspeedError as e:
        print(f"portspeed compare: error: {e}", file=err)
    except OSError as e:
        print(f"portspeed compare: error: cannot read or write: {e}", file=err)
    return EXIT_BAD_INPUT


def _write(path: str, text: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
