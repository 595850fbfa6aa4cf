"""Bands for probe statistics: per statistic, scaled to the tensor, per dtype and per kind of pair.

Why not the loss bands of `tolerance`: a statistic's rounding noise scales with the tensor it
describes, not with the loss. A layer output's Max moves with the output's largest element, its
Mean with the size of its elements (RMS), its Norm with its Norm, so each difference is judged
against that scale:

    Max, Min:  |run - ref| <= band * absmax(ref)          absmax = max(|Max|, |Min|)
    Mean:      |run - ref| <= band * RMS(ref)             RMS = Norm / sqrt(number of elements)
    Norm:      |run - ref| <= band * Norm(ref)

Shapes (element counts where split parts were joined without a known dim) and NaN / Inf counts
must match exactly. Integer tensors (token ids, positions) must match exactly. The Mean of a
parameter after the optimizer step is not judged (`UPDATED_STATS`): Adam's first steps move an
element whose gradient is rounding noise by +-lr with the noise's sign, so a correct run flips a
few of them (measured: 2 of 64 elements of a bias in bf16 TP2 against TP1), which moves the Mean
of a freshly updated tensor by a few percent and no other statistic (Max, Min and Norm of +-lr
elements do not see a sign).

The numbers (`BANDS`) were calibrated on clean runs, the measurements and the margins are in
docs/accuracy.md ("Bands"). A ``device`` pair is one layout on two devices (or backends); a
``layout`` pair is two layouts (TP2 against TP1, ...). A pair of two dtypes is judged at the
looser one's band, and a run's training dtype counts (a bf16 run's fp32 main gradients carry bf16
arithmetic's rounding).
"""

from __future__ import annotations

import dataclasses
import math

from portspeed.probe.reading.dumps import Merged

__all__ = ["Bands", "BANDS", "Verdict", "bands_for", "dtype_class", "check", "STAT_ORDER", "UPDATED_STATS"]

#: the statistics compared against a band, in the order they are reported
STAT_ORDER = ("Max", "Min", "Mean", "Norm")
#: those judged for a parameter after the optimizer step (see the module docstring)
UPDATED_STATS = ("Max", "Min", "Norm")


@dataclasses.dataclass(frozen=True, slots=True)
class Bands:
    """Relative bands of one (dtype, pair kind): |diff| <= band * the tensor's scale for that statistic."""

    max: float
    min: float
    mean: float
    norm: float
    why: str = ""

    def of(self, stat: str) -> float:
        return {"Max": self.max, "Min": self.min, "Mean": self.mean, "Norm": self.norm}[stat]


def _same(x: float, why: str) -> Bands:
    return Bands(x, x, x, x, why)


#: (dtype class, pair kind) -> bands; measurements and margins in docs/accuracy.md ("Bands")
BANDS: dict[tuple[str, str], Bands] = {
    ("fp64", "device"): _same(1e-12, "float64: reduction order only (unit roundoff 1.1e-16), reasoned"),
    ("fp64", "layout"): _same(1e-12, "float64: reduction order only (unit roundoff 1.1e-16), reasoned"),
    ("fp32", "device"): _same(1e-4, "fp32, one layout on two devices: the test device against the CPU measured 0; "
                                    "a device's own kernels round as a layout's reorderings do, so the layout band"),
    ("fp32", "layout"): _same(1e-4, "fp32, two layouts: worst 6.3e-7 at iteration 1, 2.1e-5 by iterations 2-10 "
                                    "(TP2, SP, PP2 against TP1)"),
    ("fp16", "device"): _same(1e-2, "fp16 (unit roundoff 4.9e-4): reasoned, not measured"),
    ("fp16", "layout"): _same(1e-2, "fp16 (unit roundoff 4.9e-4): reasoned, not measured"),
    ("bf16", "device"): _same(5e-2, "bf16: the layout band (no second bf16 device measured)"),
    ("bf16", "layout"): _same(5e-2, "bf16 (unit roundoff 3.9e-3), two layouts: worst 1.5e-2 at iteration 1 "
                                    "(TP2 against TP1)"),
    ("int", "device"): _same(0.0, "integers match exactly"),
    ("int", "layout"): _same(0.0, "integers match exactly"),
}
#: the looser of two dtypes decides a pair's band
_LOOSENESS = ("int", "fp64", "fp32", "fp16", "bf16")


def dtype_class(dtype: str) -> str:
    """``torch.bfloat16`` -> bf16, ``torch.float32`` -> fp32, ``torch.int64`` -> int; unknown -> fp32."""
    d = dtype.lower().removeprefix("torch.")
    if d in ("bfloat16", "bf16"):
        return "bf16"
    if d in ("float16", "half", "fp16"):
        return "fp16"
    if d in ("float64", "double", "fp64"):
        return "fp64"
    if d.startswith(("int", "uint", "long", "bool", "short")):
        return "int"
    return "fp32"


def bands_for(ref_dtype: str, run_dtype: str, kind: str, override: float | None = None,
              trained: tuple[str, ...] = ()) -> tuple[Bands, str]:
    """The bands of a tensor pair and their name (``fp32 layout``); ``override`` sets every float band.

    ``trained``: the runs' training dtypes (the meta's ``dtype``). A float tensor is judged at the loosest of its
    own dtypes and these: a bf16 run's fp32 main gradients carry bf16 arithmetic's rounding.
    """
    a, b = dtype_class(ref_dtype), dtype_class(run_dtype)
    classes = [a, b] if "int" in (a, b) else [a, b, *(dtype_class(t) for t in trained if t)]
    cls = max(classes, key=_LOOSENESS.index)
    if override is not None and cls != "int":
        return _same(override, "--rtol"), f"{cls} {kind} (--rtol {override:g})"
    return BANDS[(cls, kind)], f"{cls} {kind}"


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """One tensor pair judged: the deciding statistic (the worst one), both values and the band."""

    ok: bool
    stat: str
    ref: object
    run: object
    #: the allowed |diff| (None for exact checks: shape, counts)
    band: float | None
    #: |diff| / band (inf: outside an exact check or a zero band); the worst over the statistics
    ratio: float
    #: |diff| / band per statistic (for the calibration tables)
    ratios: tuple[tuple[str, float], ...] = ()


def check(ref: Merged, run: Merged, bands: Bands, judged: tuple[str, ...] = STAT_ORDER) -> Verdict:
    """Judge ``run`` against ``ref``: exact shape and non-finite counts, then each ``judged`` statistic in its band."""
    if ref.numel != run.numel or (ref.shape is not None and run.shape is not None and ref.shape != run.shape):
        shape = (lambda m: list(m.shape) if m.shape is not None else f"{m.numel} elements")
        return Verdict(False, "shape", shape(ref), shape(run), None, math.inf)
    for name, a, b in (("nan count", ref.nan, run.nan), ("inf count", ref.inf, run.inf)):
        if a is not None and b is not None and a != b:
            return Verdict(False, name, a, b, None, math.inf)
    worst: Verdict | None = None
    ratios = []
    for stat in judged:
        r, v = ref.stat(stat), run.stat(stat)
        band = bands.of(stat) * _scale(ref, stat)
        ratio = _ratio(r, v, band)
        ratios.append((stat, ratio))
        if worst is None or ratio > worst.ratio:
            worst = Verdict(ratio <= 1.0, stat, r, v, band, ratio)
    assert worst is not None
    return dataclasses.replace(worst, ratios=tuple(ratios))


def _scale(ref: Merged, stat: str) -> float:
    if stat in ("Max", "Min"):
        vals = [abs(x) for x in (ref.max, ref.min) if x is not None and not math.isnan(x)]
        return max(vals, default=0.0)
    if ref.norm is None or math.isnan(ref.norm):
        return 0.0
    return ref.norm / math.sqrt(ref.numel) if stat == "Mean" else ref.norm


def _ratio(r: float | None, v: float | None, band: float) -> float:
    if r is None or v is None:
        return 0.0 if r is v else math.inf
    if math.isnan(r) or math.isnan(v):
        return 0.0 if math.isnan(r) and math.isnan(v) else math.inf
    if r == v:
        return 0.0
    diff = abs(v - r)
    if math.isinf(diff) or math.isnan(diff):
        return math.inf
    if math.isnan(band) or band <= 0:
        return math.inf
    return diff / band
