"""Loss parity: compare a run's per-iteration losses to a reference run within a tolerance band.

An iteration *matches* when ``|value - ref| <= atol + rtol * |ref|`` (the band of
``numpy.isclose``, with the reference on the right). Explicit rules for the cases a
plain subtraction gets wrong:

* both skipped: fine (loss-scale overflow on both sides); one skipped: divergence;
* NaN (or inf) on one side only: divergence; NaN on both sides: fine (both blew up at
  the same step, which is what parity means), but reported;
* the two runs must log the same iterations; a missing iteration is bad input
  (`ParityInputError`), not a divergence, since the comparison would be meaningless.

Default tolerances depend on the dtype the runs trained in (record ``meta.dtype``, else
``--dtype``, else fp32); see `DEFAULT_TOLERANCES` and docs/compare.md for the reasons.

Example::

    from portspeed.parity.losslog import read_record
    from portspeed.parity.tolerance import compare, tolerance_for
    result = compare(read_record("tp1.log"), read_record("tp2.json"), tolerance_for("fp32"))
    result.ok, result.first_divergence, result.largest
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

from portspeed.errors import PortspeedError
from portspeed.parity.losslog import IterationLoss, LossRecord, normalize_dtype

__all__ = [
    "Tolerance",
    "DEFAULT_TOLERANCES",
    "tolerance_for",
    "pick_tolerance",
    "Row",
    "Comparison",
    "ParityInputError",
    "compare",
    "compare_many",
    "METRICS",
]

#: what can be compared: the IterationLoss attribute of each name
METRICS = ("lm_loss", "grad_norm")


class ParityInputError(PortspeedError, ValueError):
    """The runs cannot be compared (different iterations logged, no overlap, bad tolerance)."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Band of agreement: ``|value - ref| <= atol + rtol * |ref|``."""

    atol: float
    rtol: float = 0.0
    #: why these numbers (shown in reports)
    why: str = ""

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ParityInputError(f"tolerance {name}={v!r} must be a finite number >= 0")

    def band(self, ref: float) -> float:
        """The allowed absolute difference around ``ref``."""
        return self.atol + self.rtol * abs(ref)


#: defaults per training dtype; reasons in docs/compare.md ("Tolerances")
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(1e-5, 0.0, "fp32 default: layouts differ only in reduction order, ~1e-6 on a loss near 10"),
    "fp16": Tolerance(5e-3, 1e-3, "fp16 default: ~2 ulp of fp16 (2^-11 relative) on the loss plus headroom"),
    "bf16": Tolerance(2e-2, 1e-2, "bf16 default: ~2-3 ulp of bf16 (2^-8 relative) on the loss; "
                                   "reduction-order noise in bf16 activations grows over steps"),
}


def tolerance_for(dtype: str | None) -> Tolerance:
    """The default tolerance for a dtype spelling; None means fp32."""
    canon = normalize_dtype(dtype) or "fp32"
    return DEFAULT_TOLERANCES[canon]


def pick_tolerance(records: Sequence[LossRecord], dtype: str | None = None, atol: float | None = None,
                   rtol: float | None = None) -> tuple[Tolerance, str]:
    """Choose the tolerance for comparing ``records`` and say where it came from.

    ``dtype`` (from --dtype) wins; otherwise the loosest default among the records' dtypes
    (comparing a bf16 run to an fp32 one is judged at bf16's band); otherwise fp32.
    Explicit ``atol``/``rtol`` override the chosen default field by field.
    """
    if dtype is not None:
        canon = normalize_dtype(dtype)
        origin = f"--dtype {canon}"
    else:
        seen = [r.dtype for r in records if r.dtype]
        order = ["fp32", "fp16", "bf16"]
        if seen:
            canon = max(seen, key=order.index)
            origin = f"dtype {canon} from the records' meta"
        else:
            canon = "fp32"
            origin = "no dtype in the inputs: assumed fp32 (pass --dtype bf16 for bf16 logs)"
    base = DEFAULT_TOLERANCES[canon]  # type: ignore[index]
    if atol is None and rtol is None:
        return base, origin
    tol = Tolerance(base.atol if atol is None else atol, base.rtol if rtol is None else rtol,
                    f"given on the command line (default for {canon} would be atol={base.atol:g} rtol={base.rtol:g})")
    return tol, origin + ", overridden by --atol/--rtol"


@dataclasses.dataclass
class Row:
    """One iteration of one metric: both values, the difference, and the verdict."""

    iteration: int
    ref: float | None
    value: float | None
    ok: bool
    #: 'ok', 'both skipped', 'both nan', 'out of band', 'nan in run', 'nan in reference',
    #: 'skipped in run only', 'skipped in reference only'
    reason: str
    abs_diff: float | None = None
    rel_diff: float | None = None
    band: float | None = None

    def to_json(self) -> dict[str, Any]:
        def enc(x: float | None) -> float | str | None:
            if x is None:
                return None
            return x if math.isfinite(x) else repr(x)
        return {"iteration": self.iteration, "ref": enc(self.ref), "value": enc(self.value), "ok": self.ok,
                "reason": self.reason, "abs_diff": enc(self.abs_diff), "rel_diff": enc(self.rel_diff),
                "band": enc(self.band)}


@dataclasses.dataclass
class Comparison:
    """The result of comparing one run to the reference on one metric."""

    reference: LossRecord
    run: LossRecord
    metric: str
    tolerance: Tolerance
    rows: list[Row]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def first_divergence(self) -> Row | None:
        """The first iteration that leaves the band (or differs in skip/NaN status)."""
        return next((r for r in self.rows if not r.ok), None)

    @property
    def largest(self) -> Row | None:
        """The row with the largest finite absolute difference (None if no finite pair)."""
        finite = [r for r in self.rows if r.abs_diff is not None and math.isfinite(r.abs_diff)]
        return max(finite, key=lambda r: r.abs_diff) if finite else None  # type: ignore[arg-type, return-value]

    @property
    def n_failed(self) -> int:
        return sum(not r.ok for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        fd, lg = self.first_divergence, self.largest
        return {
            "reference": self.reference.source,
            "run": self.run.source,
            "run_meta": self.run.meta,
            "metric": self.metric,
            "status": "match" if self.ok else "diverged",
            "iterations_compared": len(self.rows),
            "iterations_outside": self.n_failed,
            "first_divergence": fd.to_json() if fd else None,
            "largest_deviation": lg.to_json() if lg else None,
            "rows": [r.to_json() for r in self.rows],
        }


def _value(it: IterationLoss, metric: str) -> float | None:
    return getattr(it, metric)


def _judge(n: int, a: IterationLoss, b: IterationLoss, metric: str, tol: Tolerance) -> Row:
    ref, val = _value(a, metric), _value(b, metric)
    if a.skipped or b.skipped:
        if a.skipped and b.skipped:
            return Row(n, ref, val, True, "both skipped")
        return Row(n, ref, val, False, "skipped in reference only" if a.skipped else "skipped in run only")
    if ref is None or val is None:
        if ref is None and val is None:
            return Row(n, ref, val, True, f"no {metric} in either")
        return Row(n, ref, val, False, f"{metric} missing in " + ("reference" if ref is None else "run"))
    ref_bad, val_bad = not math.isfinite(ref), not math.isfinite(val)
    if ref_bad or val_bad:
        if ref_bad and val_bad:
            same = (math.isnan(ref) and math.isnan(val)) or ref == val
            return Row(n, ref, val, same, "both nan" if same else "different non-finite values")
        return Row(n, ref, val, False, "nan in reference" if ref_bad else "nan in run")
    d = abs(val - ref)
    band = tol.band(ref)
    rel = d / abs(ref) if ref != 0 else (0.0 if d == 0 else math.inf)
    ok = d <= band
    return Row(n, ref, val, ok, "ok" if ok else "out of band", d, rel, band)


def compare(reference: LossRecord, run: LossRecord, tolerance: Tolerance, metric: str = "lm_loss",
            iterations: tuple[int | None, int | None] = (None, None)) -> Comparison:
    """Compare ``run`` to ``reference`` iteration by iteration on ``metric``.

    ``iterations`` = (first, last), inclusive, either None for open, restricts the window.
    Raises ParityInputError when the two runs did not log the same iterations in that window.
    """
    if metric not in METRICS:
        raise ParityInputError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")
    lo, hi = iterations

    def window(rec: LossRecord) -> dict[int, IterationLoss]:
        return {n: it for n, it in rec.by_iteration().items()
                if (lo is None or n >= lo) and (hi is None or n <= hi)}

    a, b = window(reference), window(run)
    if not a:
        raise ParityInputError(f"{reference.source}: no iterations in the window {_fmt_window(lo, hi)}")
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        parts = []
        if only_a:
            parts.append(f"only the reference has iterations {_ranges(only_a)}")
        if only_b:
            parts.append(f"only the run has iterations {_ranges(only_b)}")
        raise ParityInputError(
            f"{run.source} vs reference {reference.source}: mismatched iteration ranges: {'; '.join(parts)}. "
            "Use the same --train-iters and --log-interval, or restrict with --iterations FIRST:LAST"
        )
    rows = [_judge(n, a[n], b[n], metric, tolerance) for n in sorted(a)]
    return Comparison(reference, run, metric, tolerance, rows)


def compare_many(records: Sequence[LossRecord], tolerance: Tolerance, metrics: Iterable[str] = ("lm_loss",),
                 iterations: tuple[int | None, int | None] = (None, None)) -> list[Comparison]:
    """Compare every record after the first to the first, on each metric."""
    if len(records) < 2:
        raise ParityInputError(f"need at least two runs to compare, got {len(records)}")
    ref = records[0]
    return [compare(ref, rec, tolerance, m, iterations) for rec in records[1:] for m in metrics]


def _fmt_window(lo: int | None, hi: int | None) -> str:
    return f"{'' if lo is None else lo}:{'' if hi is None else hi}"


def _ranges(ns: list[int]) -> str:
    """[1,2,3,7,9,10] -> '1-3, 7, 9-10' (short, for messages)."""
    out: list[str] = []
    start = prev = ns[0]
    for n in ns[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(out[:8]) + (" ..." if len(out) > 8 else "")
