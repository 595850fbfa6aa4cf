"""Checks that refuse a bad PORTSPEED_* setting before anything starts, in two tiers by what they cost.

Why: a typo in ``PORTSPEED_ACCELERATOR`` used to surface only at Megatron's first import,
as a traceback from deep inside, and ``portspeed run`` started every worker before each
one failed the same way. Each check here raises a portspeed exception whose one-line
message names the variable (or option), the bad value and what is accepted.

- ``check_settings()`` (names and values; no adapter module, no vendor runtime, no device):
  every ``PORTSPEED_*`` variable parses (``portspeed.config``), a misspelt variable name
  close to a real one is refused, the accelerator is a built-in or entry-point adapter name
  (read from package metadata only) or a ``module:Class`` / ``path/to/file.py:Class`` whose class
  loads and has the contract's required members (the adapter module, not its vendor runtime; a
  relative file path is made absolute in the settings returned, which become this process's: the class is
  loaded once, and ``portspeed run`` hands the absolute path to its workers: ``check_adapter_spec``), the
  backend is one portspeed or torch knows or one an entry-point adapter declares, and the framework module
  prefixes are module names. Run by ``import portspeed.megatron_adaptor`` / ``deepspeed_adaptor`` and by
  ``portspeed run``.
- ``check_device(ranks_on_node)`` (needs the device runtime): the adapter's vendor package
  imports, and a node's ranks fit its device count (host adapters share the host: any count).
  Run by the adaptors' activation (for this rank's ``LOCAL_RANK``) and by ``portspeed run``
  before it spawns (for ``--nproc-per-node``).
- ``check_layout(world, tp, pp)``: the world size is a multiple of TP x PP (``portspeed run``
  reads them from the script's own flags before it spawns).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Mapping

from portspeed import config
from portspeed.accelerator import registry
from portspeed.errors import ConfigError, UnknownAcceleratorError, UnknownBackendError

__all__ = ["SETTINGS", "check_adapter_spec", "check_settings", "check_device", "check_layout"]

#: every PORTSPEED_* variable a user sets, in the order of their declarations (``portspeed.settings.TABLE``);
#: internal ones portspeed sets itself are in _INTERNAL_PREFIXES
SETTINGS: tuple[str, ...] = tuple(s.env for s in config.TABLE)
#: variables set by portspeed for its own processes (`portspeed run` workers, the test device's build)
_INTERNAL_PREFIXES = ("PORTSPEED_RUN_", "PORTSPEED_TESTDEV_")


def _check_variable_names(env: Mapping[str, str]) -> None:
    """A variable that is not a setting but is spelt like one (PORTSPEED_ACCELERATER) is a typo: refuse it."""
    for name in sorted(env):
        if not name.startswith("PORTSPEED_") or name in SETTINGS or name.startswith(_INTERNAL_PREFIXES):
            continue
        close = difflib.get_close_matches(name, SETTINGS, n=1, cutoff=0.85)
        if close:
            raise ConfigError(f"{name}={env[name]!r} is not a portspeed setting; did you mean {close[0]}? "
                              f"(settings: {', '.join(SETTINGS)})")


def check_adapter_spec(value: str, var: str = "PORTSPEED_ACCELERATOR=") -> str:
    """``value`` as every process resolves it: a known adapter name, or ``module:Class`` / ``file.py:Class`` whose
    class loads and fits the contract, a relative file made absolute (from this working directory).

    Raises a portspeed error, one line, starting with ``var`` and the value (``"--adapter "`` for an option).
    """
    from portspeed.errors import PortspeedError

    name = config.parse_accelerator(value, var)
    if not registry.is_spec(name):
        known = registry.available_adapters()
        if name not in known:
            raise UnknownAcceleratorError(
                f"{var}{value!r} is not an adapter; accepted: {', '.join(known)} (third-party adapters register in "
                f"the entry-point group {registry.ENTRY_POINT_GROUP!r}, or are named as module:Class or "
                "path/to/file.py:Class; unset it to auto-detect)")
        return name
    try:  # loaded as written, so that its messages name the file so (a relative file: the same module as absolute)
        registry.adapter_class(name)
    except PortspeedError as exc:
        raise type(exc)(f"{var}{value!r}: {str(exc).removeprefix(f'adapter {name!r}: ')}") from None
    target, _, qualname = name.rpartition(":")
    return f"{os.path.abspath(target)}:{qualname}" if target.endswith(".py") else name


def _entry_point_backends() -> set[str]:
    """Backends declared by entry-point adapters (their classes load; their vendor runtimes do not)."""
    found = set()
    for name in registry.entry_point_adapters():
        try:
            cls = registry.adapter_class(name)
        except Exception:  # a broken third-party adapter is reported when it is selected, not here
            continue
        if cls.backend:
            found.add(cls.backend.lower())
    return found


def _check_backend(backend: str, accelerator: str | None) -> None:
    from portspeed.accelerator.capabilities import check_backend_name

    try:
        check_backend_name(backend)
        return
    except UnknownBackendError as exc:
        declared = _entry_point_backends()
        if accelerator is not None and registry.is_spec(accelerator):
            declared.add(registry.adapter_class(accelerator).backend.lower())
        if backend in declared:
            return
        from portspeed.accelerator.capabilities import KNOWN_BACKENDS

        accepted = sorted(set(KNOWN_BACKENDS) | declared)
        raise UnknownBackendError(
            f"PORTSPEED_BACKEND={backend!r} is not a known collective backend; accepted: {', '.join(accepted)} "
            "(or a backend registered with torch.distributed.Backend.register_backend)") from exc


def check_settings(env: Mapping[str, str] | None = None) -> config.Settings:
    """Validate every PORTSPEED_* setting by name and value (cheap: nothing device-side loads); return them.

    ``env`` defaults to ``os.environ`` (then the cached settings are re-read, and a relative adapter file, made
    absolute, becomes this process's setting without being written back to the environment).
    """
    real = env is None
    env = os.environ if env is None else env
    settings = config.reload() if real else config.Settings.from_env(env)
    _check_variable_names(env)
    if settings.accelerator is not None:
        resolved = check_adapter_spec(settings.accelerator)
        if resolved != settings.accelerator:  # a relative file, made absolute: the same file wherever it is read
            settings = dataclasses.replace(settings, accelerator=resolved)
            if real:
                config.use(settings)
    if settings.backend is not None:
        _check_backend(settings.backend, settings.accelerator)
    return settings


def check_device(ranks_on_node: int | None = None) -> None:
    """Load the selected adapter's vendor runtime and check that this node's ranks have devices.

    ``ranks_on_node`` defaults to this process's ``LOCAL_RANK`` + 1 (activation in a worker).
    Raises MissingVendorPackageError or ConfigError naming what to change.
    """
    from portspeed.accelerator.selection import get_accelerator

    acc = get_accelerator()  # loads the vendor package, or raises naming it
    if acc.device_is_host:
        return
    local = os.environ.get("LOCAL_RANK")
    if ranks_on_node is None:
        if local is None or not local.strip().isdigit():
            return
        ranks_on_node = int(local) + 1
    count = int(acc.device_count())
    if ranks_on_node > count:
        where = (f"LOCAL_RANK={local} needs device index {int(local)}" if local is not None and ranks_on_node ==
                 int(local) + 1 else f"{ranks_on_node} ranks on this node need {ranks_on_node} devices")
        raise ConfigError(
            f"PORTSPEED_ACCELERATOR={acc.name!r}: {where}, but the adapter sees {count} device(s); "
            f"start at most {count} ranks per node (--nproc-per-node {count})")


def check_layout(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> None:
    """Refuse a world size that TP x PP (x CP) does not divide, naming the flags."""
    for flag, v in (("tensor-parallel size", tp), ("pipeline-parallel size", pp), ("context-parallel size", cp)):
        if v < 1:
            raise ConfigError(f"{flag} {v} must be at least 1")
    if world % (tp * pp * cp):
        raise ConfigError(
            f"world size {world} (nodes x --nproc-per-node) is not divisible by tensor-parallel {tp} x "
            f"pipeline-parallel {pp}{f' x context-parallel {cp}' if cp > 1 else ''} = {tp * pp * cp}; "
            "change the layout or the number of ranks")
