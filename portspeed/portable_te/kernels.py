"""One table of operations: which kernel serves each of the portable Transformer Engine's fused operations.

Why: the portable TE must be fast on any device without knowing any device. Each operation of the
vendor kernel slot (``portspeed.accelerator.kernel_ops``: attention and its log-sum-exp forms,
rms_norm, layer_norm, rope, swiglu, grouped_mm) has up to three implementations, tried in order:

- ``vendor``: the active adapter's own kernel, declared by ``Accelerator.kernels()`` (checked against
  the contract at activation; an import path is imported, and checked, here at first use);
- ``torch``: torch's fused operator (``F.scaled_dot_product_attention``, ``F.rms_norm``,
  ``F.grouped_mm`` ...), which reaches a vendor kernel registered with torch's dispatcher; chosen only
  where torch has it (and, for ``grouped_mm``, where the adapter declares ``has_grouped_mm``);
- ``reference``: the plain arithmetic the portable TE always had: the fallback and the oracle
  (``portspeed conformance`` compares every vendor kernel with it).

``PORTSPEED_TE_KERNELS`` moves where the preference starts (``reference`` for every op, or
``attention=torch,rms_norm=reference``); a forced choice that is unavailable falls back to the next
one, with a warning, rather than refusing (one value must work for every op of every adapter).

The choice is made once per operation per process (and again only after the active adapter changes
or ``reset()``), logged once on the ``portspeed`` logger; ``kernel(op)`` is then one dict lookup.
Implementations are named by import path and imported at first use, so this module imports none of
them (``norms``, ``rope``, ``grouped`` and ``sdpa`` import it).
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from portspeed import config
from portspeed.accelerator import selection
from portspeed.accelerator.kernel_ops import resolve_kernel

__all__ = ["Choice", "IMPLS", "TABLE", "kernel", "served", "choice", "choices", "plan", "reset", "import_path"]

log = logging.getLogger("portspeed")

IMPLS = config.TE_KERNEL_IMPLS  # ("vendor", "torch", "reference")
_SDPA = "portspeed.portable_te.sdpa"


class Choice(NamedTuple):
    """Which implementation serves ``op`` (``"vendor"``, ``"torch"`` or ``"reference"``) and why, in words."""

    op: str
    impl: str
    why: str


class _Row(NamedTuple):
    torch: str | None       # import path of the torch-fused implementation (None: torch has no fused form)
    what: str               # what the torch implementation runs, for the reports
    reference: str          # import path of the reference implementation


#: op -> its implementations (each with the contract's signature: portspeed.accelerator.kernel_ops), for each
#: operation of the one list, ``config.TE_KERNEL_OPS`` (which the contracts and PORTSPEED_TE_KERNELS follow too)
_ROWS: dict[str, _Row] = {
    "attention": _Row(f"{_SDPA}:attention_torch", "torch.nn.functional.scaled_dot_product_attention",
                      f"{_SDPA}:attention_reference"),
    "attention_lse": _Row(f"{_SDPA}:attention_lse_torch", "torch's per-device SDPA ops that return the log-sum-exp",
                          f"{_SDPA}:attention_lse_reference"),
    "attention_lse_backward": _Row(f"{_SDPA}:attention_lse_backward_torch", "torch's per-device SDPA backward ops",
                                   f"{_SDPA}:attention_lse_backward_reference"),
    "rms_norm": _Row("portspeed.portable_te.norms:rms_norm_torch", "torch.nn.functional.rms_norm",
                     "portspeed.portable_te.norms:rms_norm_reference"),
    "layer_norm": _Row("portspeed.portable_te.norms:layer_norm_torch",
                       "torch.nn.functional.layer_norm in the input's dtype (fp32 accumulation in the kernel)",
                       "portspeed.portable_te.norms:layer_norm_reference"),
    "rope": _Row("portspeed.portable_te.rope:rope_torch",
                 "the rotation written into one output (torch has no fused RoPE)",
                 "portspeed.portable_te.rope:rope_reference"),
    "swiglu": _Row(None, "", "portspeed.portable_te.swiglu:swiglu_reference"),
    "grouped_mm": _Row("portspeed.portable_te.grouped:grouped_mm_torch",
                       "torch.nn.functional.grouped_mm for the dtypes the adapter declares (has_grouped_mm), "
                       "else the loop", "portspeed.portable_te.grouped:grouped_mm_reference"),
}
if set(_ROWS) != set(config.TE_KERNEL_OPS):  # pragma: no cover  (a row added here must be an operation there)
    raise ImportError(f"portable_te.kernels has rows for {sorted(_ROWS)}, the operations are {config.TE_KERNEL_OPS}")
TABLE: dict[str, _Row] = {op: _ROWS[op] for op in config.TE_KERNEL_OPS}

_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_lock = threading.RLock()
_chosen: dict[str, Callable] = {}
_choices: dict[str, Choice] = {}
_generation = -1


def import_path(path: str) -> Callable:
    """The object ``"package.module:attr"`` names (imported now)."""
    mod, attr = path.split(":")
    fn: Any = importlib.import_module(mod)
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn


def _has_grouped_mm_op() -> bool:
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _torch_unavailable(op: str, device_type: Any, grouped: Callable[[], bool]) -> str | None:
    """Why torch's fused form of ``op`` cannot serve (None: it can); torch's own checks only. ``grouped()``: whether
    the adapter declares a grouped-GEMM kernel (asked only for ``grouped_mm``)."""
    row = TABLE[op]
    if row.torch is None:
        return "torch has no fused form"
    if op.startswith("attention"):
        if not hasattr(F, "scaled_dot_product_attention"):
            return f"torch {torch.__version__} has no scaled_dot_product_attention"
        return _sdpa_unavailable(op, device_type) if isinstance(device_type, str) else None
    if op == "rms_norm" and not hasattr(F, "rms_norm"):
        return f"torch {torch.__version__} has no torch.nn.functional.rms_norm (torch >= 2.4)"
    if op == "grouped_mm":
        if not _has_grouped_mm_op():
            return f"torch {torch.__version__} has no grouped_mm (torch >= 2.8)"
        if not grouped():
            return "no grouped-GEMM kernel declared (has_grouped_mm)"
    return None


def _named(kernel: Any) -> str:
    """A declared vendor kernel as the reports show it: its import path, or the function's name."""
    return kernel if isinstance(kernel, str) else getattr(kernel, "__qualname__", repr(kernel))


def _ladder(op: str, start: str, adapter: str, declared: Any, torch_unavailable: Callable[[], str | None]) -> Choice:
    """The one walk down vendor -> torch -> reference from ``start``: the first implementation that can serve ``op``,
    and why the ones above it cannot. ``declared``: the adapter's vendor kernel (None: none)."""
    forced = [] if start == "vendor" else [f"PORTSPEED_TE_KERNELS: {start}"]
    skipped: list[str] = []
    for impl in IMPLS[IMPLS.index(start):]:
        if impl == "vendor":
            if declared is not None:
                return Choice(op, "vendor", f"adapter {adapter!r} declares {_named(declared)}")
            skipped.append(f"adapter {adapter!r} declares no vendor kernel")
        elif impl == "torch":
            why_not = torch_unavailable()
            if why_not is None:
                return Choice(op, "torch", "; ".join([TABLE[op].what, *forced, *skipped]))
            skipped.append(why_not)
    return Choice(op, "reference", "; ".join([*forced, *skipped]))


def _decide(op: str, acc: Any) -> tuple[Choice, Callable]:
    """The ladder on the active adapter, and the function it chose (a vendor kernel checked against its contract)."""
    declared = acc.kernels().get(op)
    c = _ladder(op, config.settings().te_kernel_start(op), acc.name, declared,
                lambda: _declared_wrong(op, acc) or _torch_unavailable(
                    op, acc.device_type, lambda: any(acc.has_grouped_mm(dt) for dt in _GROUPED_DTYPES)))
    if c.impl == "vendor":
        return c, resolve_kernel(acc.name, op, declared)
    return c, import_path(getattr(TABLE[op], c.impl))


def _note(c: Choice) -> None:
    given = dict(config.settings().te_kernels)
    start = given.get(c.op, given.get("*"))  # None: not forced (the default preference)
    if start is not None and c.impl != start:
        log.warning("portspeed: PORTSPEED_TE_KERNELS asks for the %s %s, which is unavailable (%s): the %s runs",
                    start, c.op, c.why, c.impl)
    else:
        log.info("portspeed: the portable Transformer Engine's %s runs the %s implementation (%s)", c.op, c.impl, c.why)


def _choose(op: str) -> Callable:
    global _generation
    if op not in TABLE:
        raise KeyError(f"{op!r} is not a kernel operation; operations: {', '.join(TABLE)}")
    with _lock:
        if _generation != selection._generation:
            _chosen.clear()
            _choices.clear()
            _generation = selection._generation
        if op not in _chosen:
            c, fn = _decide(op, selection.get_accelerator())
            _choices[op], _chosen[op] = c, fn
            _note(c)
        return _chosen[op]


#: ``(op, impl, fn) -> wrapper`` while an op-level probe records (``portspeed.probe.kernel_calls``: each call becomes
#: one ``Kernel.<op>`` entry), else None; ``served(fn)`` is the kernel under such a wrapper
observer: Callable[[str, str, Callable], Callable] | None = None


def kernel(op: str) -> Callable:
    """The function serving ``op`` in this process (chosen on the first call; then a dict lookup)."""
    fn = _chosen.get(op) if _generation == selection._generation else None
    if fn is None:
        fn = _choose(op)
    return fn if observer is None else observer(op, _choices[op].impl, fn)


def served(fn: Callable) -> Callable:
    """The kernel itself under a probe's recording wrapper (identity checks compare this), else ``fn``."""
    return getattr(fn, "__ps_served__", fn)


def choice(op: str) -> Choice:
    """Which implementation serves ``op`` and why (choosing it now if not yet chosen)."""
    _choose(op)
    return _choices[op]


def choices() -> list[Choice]:
    """Every operation's choice in this process (resolving them all: imports the implementations)."""
    return [choice(op) for op in TABLE]


def plan(adapter_cls: type, settings: config.Settings | None = None) -> list[Choice]:
    """What each operation would run on ``adapter_cls``, from declarations only (for ``portspeed info``).

    The same ladder as at first use, asked of the class: no vendor kernel is imported, no adapter is made
    and no device runtime loads: vendor kernels are taken as declared, torch's forms by their presence in
    this torch and the attention module's per-device-type check; ``grouped_mm`` by whether the adapter
    overrides ``has_grouped_mm`` (its per-dtype answer needs the device: decided at first use).
    """
    settings = settings or config.settings()
    declared = adapter_cls.kernels()
    name = getattr(adapter_cls, "name", "") or adapter_cls.__name__
    grouped = lambda: getattr(adapter_cls, "has_grouped_mm") is not _base_has_grouped_mm()  # noqa: E731
    return [_ladder(op, settings.te_kernel_start(op), name, declared.get(op),
                    lambda op=op: _declared_wrong(op, adapter_cls) or _torch_unavailable(
                        op, getattr(adapter_cls, "device_type", None), grouped))
            for op in TABLE]


def _declared_wrong(op: str, adapter: Any) -> str | None:
    """Why torch's form of ``op`` may not serve because the adapter (class or instance) declares it wrong."""
    if op in getattr(adapter, "wrong_torch_ops", ()):
        return f"adapter {getattr(adapter, 'name', '')!r} declares torch's form wrong on its device (wrong_torch_ops)"
    return None


def _sdpa_unavailable(op: str, device_type: str) -> str | None:
    """The attention module's own per-device check (plain torch: no device runtime), if it has one."""
    try:
        check = getattr(importlib.import_module(_SDPA), "torch_unavailable", None)
    except ImportError as exc:
        return f"{_SDPA} does not import ({exc})"
    return check(op, device_type) if check is not None else None


def _base_has_grouped_mm() -> Callable:
    from portspeed.accelerator.contract import Accelerator

    return Accelerator.has_grouped_mm


def reset() -> None:
    """Forget every choice (tests; after changing PORTSPEED_TE_KERNELS): the next ``kernel(op)`` chooses again."""
    global _generation
    with _lock:
        _chosen.clear()
        _choices.clear()
        _generation = -1
