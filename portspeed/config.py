"""Environment settings (PORTSPEED_*), read once and validated, so a typo fails loudly.

Every variable is optional and declared once, in ``portspeed.settings.TABLE`` (the values each accepts, its
meaning, the switch that sets it; ``python -m portspeed.settings --markdown`` prints the table of docs/usage.md).
``Settings`` has one field per declaration; ``Settings.from_env`` reads them with the declared parsers. Values are
read when first needed, not at import of portspeed, and `reload()` re-reads them (tests change the environment).
This module and ``portspeed.settings`` are the only readers of user settings in os.environ (tests/test_config.py).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any, Iterable, Mapping

from portspeed.errors import ConfigError
from portspeed.settings import (BY_ENV, BY_FIELD, HANG_TRACE_ENTRIES, PROBE_LEVELS, TABLE, TE_KERNEL_IMPLS,
                                TE_KERNEL_OPS, Setting, parse_accelerator, parse_bool, parse_names,
                                parse_probe_iterations, parse_seconds, parse_te_kernels, writable_folder)

__all__ = ["Settings", "settings", "reload", "use", "read", "parse_accelerator", "parse_bool", "parse_names",
           "parse_te_kernels", "TE_KERNEL_OPS", "TE_KERNEL_IMPLS", "check_findable_modules", "note_entry_script",
           "LATE_MODULES_ENV",
           "parse_seconds", "TRACE_ENV", "TRACE_DIR_ENV", "TRACE_ON_EXIT_ENV", "HANG_TIMEOUT_ENV",
           "HANG_TRACE_ENTRIES", "PROBE_ENV", "PERF_ENV", "PROBE_LEVELS", "parse_probe_iterations", "writable_folder",
           "Setting", "TABLE", "BY_ENV", "BY_FIELD"]

#: the flight recorder's settings (``portspeed.trace.flight_recorder``); ``portspeed.trace.files`` names them, with the
#: recorder's files, for the recorder and `portspeed run`'s watchdog
TRACE_ENV = BY_FIELD["trace"].env
TRACE_DIR_ENV = BY_FIELD["trace_dir"].env
TRACE_ON_EXIT_ENV = BY_FIELD["trace_on_exit"].env
#: set by `portspeed run --hang-timeout S` for its workers (and readable by a user's own launcher)
HANG_TIMEOUT_ENV = BY_FIELD["hang_timeout"].env
#: the probe's settings (``portspeed.probe``): short name -> variable
PROBE_ENV = {s.field.removeprefix("probe_"): s.env for s in TABLE if s.field.startswith("probe_")}
#: the perf recording's settings (``portspeed.perf``): short name -> variable
PERF_ENV = {s.field.removeprefix("perf_"): s.env for s in TABLE if s.field.startswith("perf_")}


def _given(s: Setting, env: Mapping[str, str]) -> bool:
    """Whether ``env`` sets ``s`` (a ``blank`` setting counts when present, any other when not empty)."""
    return s.env in env if s.blank else bool(env.get(s.env, "").strip())


def _parse(s: Setting, env: Mapping[str, str]) -> Any:
    """``s`` as ``env`` sets it, by its declared parser (a ``blank`` setting's value as given, any other stripped)."""
    return s.parse(s.env, env[s.env] if s.blank else env[s.env].strip())


def _read(env: Mapping[str, str]) -> dict[str, Any]:
    """The fields ``env`` sets, parsed by their declarations; ConfigError naming the first refused one."""
    for s in TABLE:
        if s.needs and _given(s, env) and not _given(BY_ENV[s.needs], env):
            needed = BY_ENV[s.needs]
            raise ConfigError(f"{s.env} is set but {s.needs} is not; give the folder it writes "
                              f"(portspeed run {needed.switch} DIR), or unset it")
    kw = {s.field: _parse(s, env) for s in TABLE if _given(s, env)}
    if "hang_timeout" in kw:
        kw.setdefault("trace", HANG_TRACE_ENTRIES)  # a hang timeout turns the recorder on
    return kw


def _from_env(cls: type, env: Mapping[str, str] | None = None) -> Any:
    """The settings ``env`` (default os.environ) gives."""
    return cls(**_read(os.environ if env is None else env))


def _te_kernel_start(self: Any, op: str) -> str:
    """Where the preference vendor -> torch -> reference starts for ``op`` (PORTSPEED_TE_KERNELS; default vendor)."""
    given = dict(self.te_kernels)
    return given.get(op, given.get("*", "vendor"))


def _is_disabled(self: Any, patch_name: str) -> bool:
    """True when PORTSPEED_DISABLE names this patch or a prefix ending in '*'."""
    for n in self.disable:
        if n.endswith("*"):
            if patch_name.startswith(n[:-1]):
                return True
        elif n == patch_name:
            return True
    return False


#: The validated PORTSPEED_* environment: one field per declaration of ``portspeed.settings.TABLE``.
Settings = dataclasses.make_dataclass(
    "Settings", [(s.field, Any, dataclasses.field(default=s.default)) for s in TABLE], frozen=True,
    namespace={"from_env": classmethod(_from_env), "te_kernel_start": _te_kernel_start, "is_disabled": _is_disabled,
               "__doc__": "The validated PORTSPEED_* environment (one field per ``portspeed.settings.TABLE`` row)."},
)
Settings.__module__ = __name__  # make_dataclass's own argument for it is Python >= 3.12


def read(field: str, env: Mapping[str, str] | None = None) -> Any:
    """One setting read afresh (not the cached reading) from ``env`` (default os.environ): for the few readers
    that must follow the environment as it changes (``portspeed.translation.scope``)."""
    s = BY_FIELD[field]
    env = os.environ if env is None else env
    return _parse(s, env) if _given(s, env) else s.default


#: names (comma-separated) that a launcher of portspeed's own adds to PORTSPEED_FRAMEWORK_MODULES and
#: that become importable only later (`portspeed megatron-tests`: test modules pytest imports under
#: their bare names after putting their folder on sys.path); check_findable_modules leaves them alone
LATE_MODULES_ENV = "PORTSPEED_RUN_LATE_MODULES"


def _findable(name: str, beside: list[str]) -> bool:
    """Whether a finder locates module ``name`` (top level: also in the folders ``beside``), importing nothing new."""
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0]) or importlib.machinery.PathFinder.find_spec(parts[0], beside)
        for i in range(1, len(parts)):
            if spec is None:
                return False
            parent, full = ".".join(parts[:i]), ".".join(parts[:i + 1])
            if parent in sys.modules:
                spec = importlib.util.find_spec(full)  # the parent is imported: nothing new runs
            elif spec.submodule_search_locations is None:
                return False  # a plain module has no submodules
            else:
                spec = importlib.machinery.PathFinder.find_spec(full, list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return False
    return spec is not None


#: the folder of the script a `portspeed run` worker is about to run (``note_entry_script``), or none
_entry_folders: list[str] = []


def note_entry_script(path: str | None) -> None:
    """Say which script this process is about to run as ``__main__`` (None: none, or a module): `portspeed run`'s
    worker imports the adaptor before it puts the script's folder on sys.path, and the modules a setting names
    may live beside the script. A call, not a variable in ``os.environ``: it is this process's own fact."""
    _entry_folders[:] = [os.path.dirname(os.path.abspath(path))] if path else []


def check_findable_modules(var: str, names: Iterable[str], env: Mapping[str, str] | None = None) -> None:
    """Refuse module names no finder locates (a typo in ``var``), naming them; ``__main__`` always exists.

    Run at the adaptor's import, in the process whose sys.path the modules are imported from
    (not by `portspeed run`'s launcher, whose sys.path is not the script's); the entry script's folder
    (``note_entry_script``) counts as on sys.path.
    """
    env = os.environ if env is None else env
    late = {n.strip() for n in env.get(LATE_MODULES_ENV, "").split(",") if n.strip()}
    beside = list(_entry_folders)
    missing = [n for n in names if n != "__main__" and n not in late and not _findable(n, beside)]
    if missing:
        raise ConfigError(
            f"{var} names modules that cannot be imported here: {missing}; give importable module names "
            f"(check the spelling and that the package is installed or on PYTHONPATH; the entry script is '__main__')")


_settings: Any = None


def settings() -> Any:
    """The current settings (a ``Settings``), read from the environment on first use."""
    global _settings
    if _settings is None:
        _settings = Settings.from_env()
    return _settings


def reload() -> Any:
    """Re-read the environment (for tests and launchers that change it)."""
    global _settings
    _settings = None
    return settings()


def use(current: Any) -> Any:
    """Make ``current`` (a ``Settings``) this process's settings until the next ``reload()``: a value resolved
    further than the environment holds it (a relative adapter file made absolute), without writing it back."""
    global _settings
    _settings = current
    return current
