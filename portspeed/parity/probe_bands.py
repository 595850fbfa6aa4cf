"""Bands for probe statistics: per statistic, scaled to the tensor, per dtype and per kind of pair.

Why not the loss bands of `tolerance`: a statistic's rounding noise scales with the tensor it
describes, not with the loss. A layer output's Max moves with the output's largest element, its
Mean with the size of its elements (RMS), its Norm with its Norm, so each difference is judged
against that scale:

    Max, Min:  |run - ref| <= band * absmax(ref)          absmax = max(|Max|, |Min|)
    Mean:      |run - ref| <= band * RMS(ref)             RMS = Norm / sqrt(number of elements)
    Norm:      |run - ref| <= band * Norm(ref)

Shapes (element counts where split parts were joined without a known dim) and NaN / Inf counts
must match exactly. Integer tensors (token ids, positions) must match exactly.

The numbers (`BANDS`) were calibrated on clean runs, the measurements and the margins are in
docs/accuracy.md ("Bands"). A ``device`` pair is one layout on two devices (or backends); a
``layout`` pair is two layouts (TP2 against TP1, ...). A pair of two dtypes is judged at the
looser one's band.
"""

from __future__ import annotations

import dataclasses
import math

from portspeed.parity.probe_layout import Merged

__all__ = ["Bands", "BANDS", "Verdict", "bands_for", "dtype_class", "check", "STAT_ORDER"]

#: the statistics compared against a band, in the order they are reported
STAT_ORDER = ("Max", "Min", "Mean", "Norm")


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
    ("fp32", "device"): _same(1e-5, "fp32, one layout, two devices: kernel rounding differs"),
    ("fp32", "layout"): _same(1e-5, "fp32, two layouts: reduction order differs (split matmuls, reduces)"),
    ("fp16", "device"): _same(1e-2, "fp16 (unit roundoff 4.9e-4): reasoned, not measured"),
    ("fp16", "layout"): _same(1e-2, "fp16 (unit roundoff 4.9e-4): reasoned, not measured"),
    ("bf16", "device"): _same(5e-2, "bf16 (unit roundoff 3.9e-3): ~4 ulps per element, layers compound"),
    ("bf16", "layout"): _same(5e-2, "bf16 (unit roundoff 3.9e-3): ~4 ulps per element, layers compound"),
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


def bands_for(ref_dtype: str, run_dtype: str, kind: str, override: float | None = None) -> tuple[Bands, str]:
    """The bands of a tensor pair and their name (``fp32 layout``); ``override`` sets every float band."""
    a, b = dtype_class(ref_dtype), dtype_class(run_dtype)
    cls = max(a, b, key=_LOOSENESS.index)
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


def check(ref: Merged, run: Merged, bands: Bands) -> Verdict:
    """Judge ``run`` against ``ref``: exact shape and non-finite counts, then each statistic in its band."""
    if ref.numel != run.numel or (ref.shape is not None and run.shape is not None and ref.shape != run.shape):
        shape = (lambda m: list(m.shape) if m.shape is not None else f"{m.numel} elements")
        return Verdict(False, "shape", shape(ref), shape(run), None, math.inf)
    for name, a, b in (("nan count", ref.nan, run.nan), ("inf count", ref.inf, run.inf)):
        if a is not None and b is not None and a != b:
            return Verdict(False, name, a, b, None, math.inf)
    worst: Verdict | None = None
    ratios = []
    for stat in STAT_ORDER:
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
