"""`portspeed precheck DIR`: the recorded ops whose device result leaves its band, worst first, with no golden run.

Why: a vendor kernel off by 1e-3 moves the loss by a few 1e-6, under loss parity's band, and
``compare --probe`` needs a second (CPU) run to see it. Each op of an op-level dump
(``portspeed run --probe DIR --probe-level op``) already says what ran, on what: replaying it in
float64 on the CPU gives the result it should have had. Torch functions are replayed by their
recorded name and arguments, the portable Transformer Engine's operations (``Kernel.<op>``
entries) through their REFERENCE kernels (``portspeed.probe.replay``).

Inputs, per op (``--inputs``; ``auto`` takes the first that the dump allows):

- ``tensors``: the inputs and outputs ``--probe-tensors GLOB`` saved. The device's own recorded
  output is compared, element by element, with the float64 replay of its exact inputs.
- ``statistics``: inputs drawn from the recorded statistics (msprobe's ``acc_check``); the op then
  runs again, now, on the device through the implementation the run used (the active adapter,
  ``PORTSPEED_ACCELERATOR`` as for the run; a kernel by its recorded ``ps_impl``), and that result is
  compared with the float64 replay of the same inputs.

Judged as ``portspeed conformance`` judges a kernel: error = the largest |device - float64| over
the largest |float64| (NaN / Inf where the float64 result has them, integers exactly). Band =
``BANDS`` for the output's dtype, or ``CPU_RATIO`` times the error the CPU itself makes running the
op in the run's dtype (a reduction that cancels is no more exact on the CPU), whichever is wider.
docs/accuracy.md ("precheck") says what each input mode catches and misses, and how the bands were
calibrated.

Exit status: 0 every replayed op within its band, 1 some outside (listed worst first, then a
summary), 2 bad input (no dump, not an op-level dump, nothing replayable, the wrong adapter).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from portspeed.accelerator.kernel_ops import KERNEL_BANDS
from portspeed.probe.reading.dumps import ProbeInputError, read_dump
from portspeed.probe import replay as rp

__all__ = ["BANDS", "CPU_RATIO", "Result", "error", "precheck", "main"]

#: the band of a floating output, per dtype: error = max |device - float64| / max |float64|; fp32 and bf16 are
#: conformance's kernel bands (``KERNEL_BANDS``), checked on clean runs of the example trainer (docs/accuracy.md,
#: "precheck": the worst clean op 4.2e-7 in fp32, 3.4e-3 in bf16); fp16 scaled from bf16 by its unit roundoff.
#: Integer and boolean outputs must be equal.
BANDS: dict[torch.dtype, float] = {torch.float64: 1e-10, **KERNEL_BANDS, torch.float16: 4e-3}
#: a device error within this many times the CPU's own error in the run's dtype is the dtype's, not the device's
CPU_RATIO = 10.0


class BadInput(Exception):
    """One line: what is wrong with the input and what to do (exit 2)."""


@dataclasses.dataclass
class Result:
    """One replayed op: where it ran, its case, its error and band (``error / band > 1``: outside)."""

    key: str
    op: str
    module: str
    iteration: int
    rank: int
    impl: str | None
    case: str
    inputs: str  # "tensors" | "statistics"
    error: float
    band: float

    @property
    def ratio(self) -> float:
        return math.inf if self.band == 0 and self.error > 0 else (self.error / self.band if self.band else 0.0)

    def line(self) -> str:
        impl = f", {self.impl} kernel" if self.impl else ""
        return (f"{self.op}  {self.key}  in {self.module or '(no module)'} (iteration {self.iteration}, rank "
                f"{self.rank}{impl}; inputs: {self.inputs}): case {self.case}: error {self.error:.3g} > band "
                f"{self.band:.3g}")


def error(dev: torch.Tensor, gold: torch.Tensor) -> float:
    """max |dev - gold| / max |gold| over gold's finite elements; NaN / Inf must sit where gold has them; integer
    and boolean results must be equal (else inf)."""
    if tuple(dev.shape) != tuple(gold.shape):
        raise rp.NotReplayable("replayed shape differs")
    if not (gold.is_floating_point() and dev.is_floating_point()):
        return 0.0 if torch.equal(dev.to(torch.float64), gold.to(torch.float64)) else math.inf
    d, g = dev.to(torch.float64), gold.to(torch.float64)
    fin = torch.isfinite(g)
    if not torch.equal(torch.isnan(d), torch.isnan(g)) or not torch.equal(d[torch.isinf(g)], g[torch.isinf(g)]):
        return math.inf
    if not bool(fin.any()):
        return 0.0
    diff, scale = (d[fin] - g[fin]).abs().max().item(), g[fin].abs().max().item()
    if not math.isfinite(diff):
        return math.inf
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _flat(entry: dict[str, Any]) -> dict[str, Any]:
    """portspeed's keys as ``ps_*`` fields also where a dump nests them in one ``ps`` field (as reading.dumps reads)."""
    ps = entry.get("ps")
    if not isinstance(ps, dict):
        return entry
    return {**{k: v for k, v in entry.items() if k != "ps"},
            **{(k if k.startswith("ps_") else f"ps_{k}"): v for k, v in ps.items()}}


def _band(rec: dict[str, Any]) -> float:
    dt = rp.dtype_of(rec)
    return BANDS.get(dt, BANDS[torch.float32]) if dt.is_floating_point else 0.0


def _case(entry: dict[str, Any]) -> str:
    """``(float32[16, 2, 32], float32[32], 1e-05) -> float32[16, 2, 32]``: the arguments, shortened."""
    def show(v: Any) -> str:
        if v is None:
            return "None"
        if isinstance(v, list):
            return "[" + ", ".join(show(x) for x in v) + "]"
        if isinstance(v, dict) and v.get("type") == "torch.Tensor":
            return f"{str(v.get('dtype')).replace('torch.', '')}{list(v.get('shape', []))}"
        if isinstance(v, dict) and "value" in v:
            return repr(v["value"]) if v.get("type") == "str" else str(v["value"]).replace("torch.", "")
        return "?"
    args = [show(a) for a in entry.get("input_args", [])]
    args += [f"{k}={show(v)}" for k, v in entry.get("input_kwargs", {}).items()]
    text = f"({', '.join(args)}) -> {', '.join(show(o) for o in entry.get('output', []))}"
    return text if len(text) <= 200 else text[:197] + "..."


class _Device:
    """The active adapter and its device, made once, for replays from statistics; the dump's adapter checked."""

    def __init__(self, root: Path, recorded: str | None) -> None:
        self.root, self.recorded, self._device = root, recorded, None

    def get(self) -> torch.device:
        if self._device is None:
            from portspeed.accelerator import selection

            acc = selection.get_accelerator()
            if self.recorded and acc.name != self.recorded:
                raise BadInput(f"{self.root}: recorded on adapter {self.recorded!r}, this process runs {acc.name!r}: "
                               "set PORTSPEED_ACCELERATOR as the run did (replays from statistics run on its device), "
                               "or replay only saved tensors (--inputs tensors)")
            self._device = acc.device()
        return self._device


def _replay(key: str, entry: dict[str, Any], folder: str, mode: str, device: _Device) -> tuple[str, float, float]:
    """(inputs used, error, band) of one op, or NotReplayable."""
    op = rp.op_of(key, entry)
    outputs = entry.get("output", [])
    saved = all(r.get("data_name") for v in (entry.get("input_args", []), entry.get("input_kwargs", {}), outputs)
                for r in rp.tensor_records(v))
    used = "tensors" if mode == "tensors" or (mode == "auto" and saved) else "statistics"
    if used == "tensors":
        try:
            args, kwargs = rp.saved_inputs(entry, folder)
            dev = rp.saved_outputs(entry, folder)
        except rp.NotReplayable:
            if mode == "tensors":
                raise
            used = "statistics"  # a file missing: auto falls back
    if used == "statistics":
        used = "statistics"
        args, kwargs = rp.generated_inputs(entry, f"{folder}:{key}")
    try:
        gold = rp.run(op.reference, args, kwargs, "cpu", float64=True)
    except Exception as e:  # noqa: BLE001  (a replay that does not run is reported as such, not as a verdict)
        raise rp.NotReplayable(f"replay raised {type(e).__name__}") from None
    if used == "statistics":
        try:
            dev = rp.run(op.device(), args, kwargs, device.get(), float64=False)
        except (rp.NotReplayable, BadInput):
            raise
        except Exception as e:  # noqa: BLE001
            raise rp.NotReplayable(f"the device raised {type(e).__name__}") from None
    pairs = [(i, d, g) for i, (d, g) in enumerate(zip(dev, gold))
             if isinstance(d, torch.Tensor) and isinstance(g, torch.Tensor)]
    if len(gold) != len(outputs) or not pairs:
        raise rp.NotReplayable("replayed outputs differ")
    worst = (0.0, 0.0, 1.0)  # (ratio, error, band)
    bench: list[Any] | None = None
    for i, d, g in pairs:
        err, band = error(d, g), _band(outputs[i])
        if err > band:  # the dtype's own error? the CPU in the run's dtype on the same inputs
            if bench is None:
                bench = rp.run(op.reference, args, kwargs, "cpu", float64=False)
            if isinstance(bench[i], torch.Tensor):
                band = max(band, CPU_RATIO * error(bench[i], g))
        ratio = math.inf if band == 0 and err > 0 else (err / band if band else 0.0)
        if ratio >= worst[0]:
            worst = (ratio, err, band)
    return used, worst[1], worst[2]


def precheck(root: Path, *, inputs: str = "auto", ops: str = "*") -> tuple[list[Result], Counter, int]:
    """Replay every op entry of the dump at ``root``: (results, reasons not replayed -> count, op entries)."""
    try:
        dump = read_dump(root)
    except ProbeInputError as e:
        raise BadInput(str(e)) from None
    results: list[Result] = []
    skipped: Counter = Counter()
    seen = 0
    for (iteration, rank), rd in sorted(dump.ranks.items()):
        doc = json.loads((rd.path / "dump.json").read_text(encoding="utf-8"))
        level = rd.meta.get("level") if rd.meta else {"L1": "op", "mix": "op"}.get(doc.get("level"))
        if level != "op":
            raise BadInput(f"{rd.path}: a module-level dump (--probe-level {level or doc.get('level')}); precheck "
                           "replays ops: record with `portspeed run --probe DIR --probe-level op ...`")
        device = _Device(root, rd.meta.get("adapter"))
        for key, entry in doc["data"].items():
            if key.startswith("Module.") or not isinstance(entry, dict) or not fnmatch.fnmatchcase(key, ops):
                continue
            entry = _flat(entry)
            seen += 1
            try:
                used, err, band = _replay(key, entry, str(rd.path), inputs, device)
            except rp.NotReplayable as e:
                skipped[str(e)] += 1
                continue
            name = entry.get("ps_op") or key.split(".")[1]
            results.append(Result(key, name, entry.get("ps_module") or "", iteration, rank, entry.get("ps_impl"),
                                  _case(entry), used, err, band))
    if not results:
        why = ", ".join(f"{r}: {n}" for r, n in skipped.most_common())
        raise BadInput(f"{root}: nothing replayable among its {seen} op entries" + (f" ({why})" if why else "")
                       + ("" if ops == "*" else f" matching --ops {ops}"))
    return results, skipped, seen


def _summary(results: list[Result], bad: list[Result], skipped: Counter, device: str | None) -> str:
    used = Counter(r.inputs for r in results)
    how = [f"{used['tensors']} from saved tensors"] if used["tensors"] else []
    if used["statistics"]:
        how.append(f"{used['statistics']} from statistics, run on {device}")
    not_run = (f"; {sum(skipped.values())} not replayed ("
               + ", ".join(f"{r}: {n}" for r, n in skipped.most_common()) + ")") if skipped else ""
    if bad:
        ops = Counter(r.op for r in bad)
        head = (f"precheck: {len(bad)} of {len(results)} replayed ops outside their band ("
                + ", ".join(f"{op} {n}" for op, n in ops.most_common()) + f"; worst {bad[0].key}: error "
                f"{bad[0].error:.3g}, band {bad[0].band:.3g})")
    else:
        close = max(results, key=lambda r: r.ratio)
        head = (f"precheck: all {len(results)} replayed ops within their band (closest {close.key}: error "
                f"{close.error:.3g}, band {close.band:.3g})")
    return f"{head}; inputs: {', '.join(how)}{not_run}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``portspeed precheck DIR``."""
    p = argparse.ArgumentParser(prog="portspeed precheck", description=__doc__.split("\n\n")[0],
                                epilog="bands: " + ", ".join(f"{str(k).replace('torch.', '')} {v:g}"
                                                             for k, v in BANDS.items()))
    p.add_argument("dir", help="the folder of `portspeed run --probe DIR --probe-level op`")
    p.add_argument("--inputs", choices=("auto", "tensors", "statistics"), default="auto",
                   help="replay from the tensors --probe-tensors saved, or from inputs drawn from the statistics (run "
                        "on the active device adapter's device); auto: saved tensors where an op has them")
    p.add_argument("--ops", default="*", metavar="GLOB", help="only the entries whose key matches (e.g. 'Kernel.*')")
    p.add_argument("--show", type=int, default=20, metavar="N", help="list the N worst (0: all); default 20")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    root = Path(a.dir)
    try:
        results, skipped, _seen = precheck(root, inputs=a.inputs, ops=a.ops)
    except BadInput as e:
        print(f"portspeed precheck: {e}", file=sys.stderr)
        return 2
    bad = sorted((r for r in results if r.ratio > 1), key=lambda r: (-r.ratio, r.iteration, r.rank, r.key))
    shown = bad if a.show <= 0 else bad[:a.show]
    for r in shown:
        print(r.line())
    if len(bad) > len(shown):
        print(f"... and {len(bad) - len(shown)} more (--show 0 lists all)")
    device = None
    if any(r.inputs == "statistics" for r in results):
        from portspeed.accelerator import selection

        device = str(selection.get_accelerator().device())
    print(_summary(results, bad, skipped, device))
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
