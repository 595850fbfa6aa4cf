"""Per-layer activation and gradient statistics, to find *where* two runs start to differ.

When `portspeed compare` says the losses diverge, record layer statistics for the first
diverging iteration in both runs and compare them: the first module (in forward order)
whose output statistics leave the band is where the difference enters; if every
activation agrees, the first gradient (in backward order) that differs is reported.

Contract: `LayerStatsRecorder` adds a forward hook on each leaf module (or the modules a
``select`` predicate accepts); during an iteration being recorded, each hook stores
shape, mean, std, absolute max and L2 norm of the module's output (computed in float64)
and registers a tensor hook on that output for the gradient's statistics. Nothing is
recorded, and no tensor hook is added, outside recorded iterations. Hooks are removed by
``close()`` (or leaving the ``with`` block).

Limits: statistics of a tensor-parallel shard are not those of the full tensor, so
compare runs with the same TP layout (typical use: backend A vs backend B). A module
called several times per iteration (micro-batches, shared weights) is keyed by call index.

Example::

    with LayerStatsRecorder(model, iterations={7}, path="stats.rank{rank}.json") as rec:
        for it in range(1, 11):
            with rec.iteration(it):
                loss = model(batch).sum(); loss.backward()
    # portspeed compare --layers gloo/stats.rank0.json standin/stats.rank0.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TextIO

from portspeed.errors import PortspeedError

__all__ = ["LayerStatsRecorder", "LayerStatsError", "LayerDifference", "compare_layers", "load_layer_stats",
           "main_compare_layers", "STATS"]

#: the statistics recorded per tensor
STATS = ("mean", "std", "absmax", "norm")
#: defaults for comparing layer statistics (relative: norms scale with tensor size)
DEFAULT_ATOL, DEFAULT_RTOL = 1e-6, 1e-4


class LayerStatsError(PortspeedError, ValueError):
    """A layer-statistics file is missing or malformed, or two files cannot be compared."""


def _stats(t: Any) -> dict[str, Any]:
    import torch
    x = t.detach().to(torch.float64)
    n = x.numel()
    return {
        "shape": list(t.shape),
        "mean": x.mean().item() if n else 0.0,
        "std": x.std().item() if n > 1 else 0.0,
        "absmax": x.abs().max().item() if n else 0.0,
        "norm": x.norm().item() if n else 0.0,
    }


def _first_tensor(out: Any) -> Any:
    import torch
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    return None


class LayerStatsRecorder:
    """Forward/backward statistics of every selected module, for chosen iterations."""

    def __init__(self, model: Any, iterations: Iterable[int], path: str | os.PathLike[str] | None = None,
                 select: Callable[[str, Any], bool] | None = None, meta: dict[str, Any] | None = None) -> None:
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        self.iterations = set(int(i) for i in iterations)
        if not self.iterations:
            raise LayerStatsError("LayerStatsRecorder(iterations=...) is empty; name the iterations to record")
        self.path = None if path is None else str(path)
        self.meta = dict(meta or {})
        self.data: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self._current: int | None = None
        self._calls: dict[str, int] = {}
        self._handles: list[Any] = []
        for mi, m in enumerate(models):
            prefix = f"model{mi}." if len(models) > 1 else ""
            for name, mod in m.named_modules():
                keep = select(name, mod) if select else (next(iter(mod.children()), None) is None)
                if keep:
                    self._handles.append(mod.register_forward_hook(self._hook(prefix + (name or "<root>"))))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if self._current is None:
                return
            t = _first_tensor(output)
            if t is None:
                return
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            rec = self.data[str(self._current)]
            rec["forward"].append({"module": name, "call": call, **_stats(t)})
            if t.requires_grad:
                it = self._current

                def grad_hook(g: Any) -> None:
                    self.data[str(it)]["backward"].append({"module": name, "call": call, **_stats(g)})
                t.register_hook(grad_hook)
        return hook

    @contextlib.contextmanager
    def iteration(self, n: int) -> Iterator[None]:
        """Wrap one iteration's forward and backward; records only if ``n`` was asked for."""
        if n in self.iterations:
            self._current = n
            self._calls = {}
            self.data[str(n)] = {"forward": [], "backward": []}
        try:
            yield
        finally:
            self._current = None
        if n in self.iterations and n == max(self.iterations) and self.path:
            self.save()

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the statistics as JSON; ``{rank}`` in the path is this process's rank."""
        target = str(path or self.path or "")
        if not target:
            raise LayerStatsError("LayerStatsRecorder.save(): no path given here or to the constructor")
        rank = 0
        with contextlib.suppress(Exception):
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
        p = Path(target.replace("{rank}", str(rank)))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"meta": {**self.meta, "rank": rank}, "iterations": self.data},
                                indent=1, allow_nan=True))
        return p

    def close(self) -> None:
        """Remove every hook."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "LayerStatsRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------------------- comparison

@dataclasses.dataclass
class LayerDifference:
    """Where two layer-statistics files first disagree (``module`` None: they agree)."""

    iteration: int | None
    phase: str | None  # 'forward' (activation) or 'backward' (gradient)
    module: str | None
    call: int | None
    stat: str | None
    ref: Any = None
    value: Any = None
    compared: int = 0

    @property
    def ok(self) -> bool:
        return self.module is None


def load_layer_stats(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file written by LayerStatsRecorder.save()."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise LayerStatsError(f"{p}: cannot read ({e})") from e
    except json.JSONDecodeError as e:
        raise LayerStatsError(f"{p}: not JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("iterations"), dict):
        raise LayerStatsError(f"{p}: not a layer-statistics file (written by portspeed.parity.layerstats.LayerStatsRecorder)")
    return data


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(a)


def compare_layers(ref: dict[str, Any], run: dict[str, Any], atol: float = DEFAULT_ATOL,
                   rtol: float = DEFAULT_RTOL) -> LayerDifference:
    """The first (iteration, forward-then-backward, module) whose statistics differ beyond the band."""
    common = sorted(set(ref["iterations"]) & set(run["iterations"]), key=int)
    if not common:
        raise LayerStatsError(f"no iteration recorded in both files (reference has {sorted(ref['iterations'])}, "
                              f"run has {sorted(run['iterations'])}); record the same iteration in both runs")
    compared = 0
    for it in common:
        for phase in ("forward", "backward"):
            a_list = ref["iterations"][it][phase]
            b_map = {(e["module"], e["call"]): e for e in run["iterations"][it][phase]}
            for a in a_list:
                key = (a["module"], a["call"])
                b = b_map.get(key)
                if b is None:
                    return LayerDifference(int(it), phase, a["module"], a["call"], "missing", None, None, compared)
                if a["shape"] != b["shape"]:
                    return LayerDifference(int(it), phase, a["module"], a["call"], "shape", a["shape"], b["shape"], compared)
                for s in STATS:
                    if not _close(float(a[s]), float(b[s]), atol, rtol):
                        return LayerDifference(int(it), phase, a["module"], a["call"], s, a[s], b[s], compared)
                compared += 1
    return LayerDifference(None, None, None, None, None, compared=compared)


def main_compare_layers(paths: Sequence[str], atol: float | None, rtol: float | None, out: TextIO) -> int:
    """`portspeed compare --layers A.json B.json`: 0 all layers agree, 1 a layer differs, 2 bad input."""
    if len(paths) != 2:
        raise LayerStatsError(f"--layers compares exactly two files (reference, run); got {len(paths)}")
    a, b = load_layer_stats(paths[0]), load_layer_stats(paths[1])
    at = DEFAULT_ATOL if atol is None else atol
    rt = DEFAULT_RTOL if rtol is None else rtol
    d = compare_layers(a, b, at, rt)
    print(f"layer statistics: {paths[1]} vs reference {paths[0]}  (band {at:g} + {rt:g}*|ref|)", file=out)
    if d.ok:
        print(f"MATCH: {d.compared} module outputs/gradients agree", file=out)
        return 0
    what = "activation (output)" if d.phase == "forward" else "gradient (of the output)"
    print(f"DIFFERS at iteration {d.iteration}: first differing {what} is module {d.module!r} (call {d.call}): "
          f"{d.stat} ref {d.ref} vs run {d.value}; {d.compared} earlier entries agreed", file=out)
    return 1
