"""Which adapter is active: selected once per process, or injected.

Selection (``get_accelerator``), first match wins:
1. an adapter injected with ``set_accelerator(obj)``;
2. ``PORTSPEED_ACCELERATOR=<name>`` (or ``module:Class``, ``path/to/file.py:Class``: an adapter
   that is not installed); an unknown name raises listing the known ones, a known adapter whose
   vendor package is missing raises naming the package to install;
3. auto-detection: third-party adapters from the entry-point group ``portspeed.adapters``,
   then the built-ins in ``DETECTION_ORDER`` (vendor devices that ship their own torch
   module first, since some of them also answer to ``torch.cuda``; then ``cuda``; ``cpu``
   always matches).

``PORTSPEED_BACKEND=<ccl>`` overrides the adapter's collective backend.
"""

from __future__ import annotations

import logging
import threading

from portspeed import config
from portspeed.accelerator.contract import Accelerator, check_adapter
from portspeed.accelerator.registry import (BUILTIN_ADAPTERS, DETECTION_ORDER, adapter_class, entry_point_adapters,
                                            forget_entry_points)
from portspeed.errors import ConfigError, UnknownAcceleratorError

__all__ = ["get_accelerator", "set_accelerator", "reset_accelerator", "selection_reason"]

log = logging.getLogger("portspeed.accelerator")

_lock = threading.RLock()
_selected: Accelerator | None = None
_reason: str = ""
#: bumped whenever the active adapter may change (set / reset): caches keyed on the adapter compare it
_generation: int = 0


def _check_kernels(acc: Accelerator) -> None:
    """Refuse an adapter without a required member, or whose declared vendor kernel does not fit its contract
    (naming the member, or the adapter and the op)."""
    from portspeed.accelerator.kernel_ops import check_declared

    check_adapter(acc)
    check_declared(acc.name, acc.kernels())


def _backend_override() -> str | None:
    b = config.settings().backend
    if b is None:
        return None
    from portspeed.accelerator.capabilities import check_backend_name
    from portspeed.errors import UnknownBackendError

    try:
        check_backend_name(b)
    except UnknownBackendError as exc:
        raise ConfigError(f"PORTSPEED_BACKEND={b!r} is not usable: {exc}") from exc
    return b


def _make(name: str, reason: str) -> Accelerator:
    cls = adapter_class(name)
    cls.load_vendor()
    acc = cls(backend=_backend_override())
    _check_kernels(acc)
    from portspeed.accelerator.param_identity import ensure

    ensure(acc)  # a device without PrivateUse1 shallow-copy kernel keeps Parameters through module.to (detected)
    from portspeed.accelerator import host_rung

    host_rung.ensure(acc)  # torch ops declared wrong on the device (wrong_torch_ops) computed on the host
    global _reason
    _reason = reason
    return acc


def get_accelerator() -> Accelerator:
    """The active adapter (selected once per process; see the module docstring for the order)."""
    global _selected
    if _selected is not None:
        return _selected
    with _lock:
        if _selected is not None:
            return _selected
        requested = config.settings().accelerator
        if requested:
            _selected = _make(requested, "PORTSPEED_ACCELERATOR")
            return _selected
        eps = entry_point_adapters()
        for name in sorted(eps):
            if name in BUILTIN_ADAPTERS:
                continue
            try:
                cls = adapter_class(name)
                if cls.detect():
                    _selected = _make(name, f"auto-detected (entry point {name!r})")
                    return _selected
            except Exception as exc:
                log.warning("portspeed: adapter entry point %r failed to load: %s", name, exc)
        for name in DETECTION_ORDER:
            cls = adapter_class(name)
            if cls.detect():
                _selected = _make(name, "auto-detected")
                return _selected
        raise UnknownAcceleratorError("no adapter detected, not even 'cpu'")  # pragma: no cover


def set_accelerator(accelerator: Accelerator) -> None:
    """Inject an adapter instance (the official hook, like DeepSpeed's set_accelerator)."""
    global _selected, _reason, _generation
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator() takes an Accelerator instance, got {type(accelerator).__name__}")
    _check_kernels(accelerator)
    with _lock:
        _generation += 1
        _selected = accelerator
        _reason = "set_accelerator()"


def reset_accelerator() -> None:
    """Forget the selection and the entry-point scan (tests); the next get_accelerator() selects again."""
    global _selected, _reason, _generation
    with _lock:
        _generation += 1
        _selected = None
        _reason = ""
        forget_entry_points()


def selection_reason() -> str:
    """Why the active adapter was chosen ('' before selection)."""
    return _reason
