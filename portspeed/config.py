"""Environment settings (PORTSPEED_*), read once and validated, so a typo fails loudly.

Every variable is optional. Values are read when first needed, not at import of
portspeed, and `reload()` re-reads them (tests change the environment).

| variable | values | meaning |
|---|---|---|
| PORTSPEED_ACCELERATOR | adapter name (`cpu`, `cuda`, `npu`, ...), `module:Class` or `path/to/file.py:Class` | skip auto-detection; the last two forms name an adapter that is not installed (a relative path is taken from where the command started) |
| PORTSPEED_BACKEND | c10d backend name (`gloo`, `nccl`, `hccl`, ...) | override the adapter's default backend |
| PORTSPEED_STRICT | 0/1, true/false, yes/no, on/off | any skipped or failed patch raises |
| PORTSPEED_DISABLE | comma-separated patch names or name prefixes | block those patches |
| PORTSPEED_LOG_LEVEL | DEBUG, INFO, WARNING, ERROR | portspeed's logger level |
| PORTSPEED_TIMEOUT | seconds (positive number) | collective / rendezvous timeout used by launchers and tests |
| PORTSPEED_GLOO_LAZY_INIT | 0/1 (default 1) | Gloo groups connect their ranks at their first collective, not when created (torch >= 2.8; an explicit TORCH_GLOO_LAZY_INIT wins; see ``portspeed.comm.gloo_init``) |
| PORTSPEED_TE_KERNELS | `vendor`, `torch` or `reference` for every operation, and/or `op=value` per operation (`attention=reference,rms_norm=torch`) | where the portable Transformer Engine starts its preference vendor -> torch -> reference (``portspeed.portable_te.kernels``); unset: vendor |
| PORTSPEED_TRACE | non-negative integer in ASCII digits (default 0: off; 2000 when a hang timeout is set) | entries of the per-rank collective / point-to-point ring buffer (``portspeed.comm.trace``; docs/reliability.md, "When it hangs") |
| PORTSPEED_HANG_TIMEOUT | seconds (positive number; `portspeed run --hang-timeout S` sets it for the workers) | how long no rank may complete a recorded call before `portspeed run` dumps and ends the job; it turns recording on, and the ranks keep heartbeat files for the launcher (``portspeed.cli.hang_watch``) |
| PORTSPEED_TRACE_DIR | a writable folder (created if missing) | where each rank writes its trace dump; unset: a new folder under the system's temporary directory, named in one log line |
| PORTSPEED_TRACE_ON_EXIT | 0/1 (default 0) | every rank dumps its trace buffer when it exits normally too |
| PORTSPEED_NAN_CHECK | 0/1 (default 0) | a NaN in a collective's input or output is raised at that collective, naming the rank, op, group and caller (``portspeed.comm.nan_check``; on torch >= 2.15 torch's NanCheckHook checks the inputs of C++ backends) |
| PORTSPEED_PROBE_DIR | a writable folder holding no probe dump (created if missing) | record module (or op) statistics into it in msprobe's layout (``portspeed.probe``; docs/probe-format.md); unset: no probe, no hook. `portspeed run --probe DIR` sets it and the variables below |
| PORTSPEED_PROBE_ITERATIONS | `A:B` or `A` (1-based, default `1:1`) | the training iterations recorded |
| PORTSPEED_PROBE_LEVEL | `module` (default) or `op` | modules' outputs, gradients and parameters; `op` adds every torch function and collective inside them |
| PORTSPEED_PROBE_RANKS | comma-separated global ranks (default: all) | the ranks that record |
| PORTSPEED_PROBE_MODULES | a glob over canonical module paths (`decoder.layers.1*`) | the modules recorded (default: all) |
| PORTSPEED_PROBE_TENSORS | a glob over entry keys (`Module.decoder.layers.1.*`) | also save those entries' full tensors, inputs included |
| PORTSPEED_PROBE_INPUTS | 0/1 (default 0) | also record modules' inputs |
| PORTSPEED_PROBE_NAN | 0/1 (default 0) | on every iteration, find the first module (op) whose output or gradient turned non-finite; write that iteration's dump and stop the job |
| PORTSPEED_LOSS_LOG | file path | where a training script writes its JSON loss record (`portspeed.megatron_adaptor.open_loss_log`, used by examples/pretrain_gpt.py; the stock scripts print losses instead, which `portspeed compare` parses) |
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import re
import sys
from typing import Iterable, Mapping

from portspeed.errors import ConfigError

__all__ = ["Settings", "settings", "reload", "parse_accelerator", "parse_bool", "parse_names", "parse_te_kernels",
           "TE_KERNEL_OPS", "TE_KERNEL_IMPLS", "check_findable_modules", "LATE_MODULES_ENV", "parse_seconds", "TRACE_ENV",
           "TRACE_DIR_ENV", "TRACE_ON_EXIT_ENV", "HANG_TIMEOUT_ENV", "HANG_TRACE_ENTRIES", "PROBE_ENV",
           "PROBE_LEVELS", "parse_probe_iterations", "check_probe_dir"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")
_PATCH_NAME = re.compile(r"^[A-Za-z0-9_.\-*]+$")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: the operations of the vendor kernel slot, the one list: ``portspeed.accelerator.kernel_ops`` gives each its
#: contract, ``portspeed.portable_te.kernels`` its implementations, PORTSPEED_TE_KERNELS names them
TE_KERNEL_OPS = ("attention", "attention_lse", "attention_lse_backward", "rms_norm", "layer_norm", "rope", "swiglu",
                 "grouped_mm")
#: the implementations, in the order of preference
TE_KERNEL_IMPLS = ("vendor", "torch", "reference")


def parse_bool(var: str, value: str) -> bool:
    """Parse a boolean environment value or raise naming the variable and the accepted spellings."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(
        f"{var}={value!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off"
    )


def parse_accelerator(value: str, var: str = "PORTSPEED_ACCELERATOR=") -> str:
    """An adapter name (lower-cased), ``module:Class`` or ``path/to/file.py:Class`` (kept as written), by form only;
    ConfigError names ``var`` (``"PORTSPEED_ACCELERATOR="``, ``"--adapter "``) and the accepted forms."""
    acc = value.strip()
    target, colon, qualname = acc.rpartition(":")
    if not colon:
        if _NAME.match(acc.lower()):
            return acc.lower()
    elif (all(p.isidentifier() for p in qualname.split("."))
          and (target.endswith(".py") and len(os.path.basename(target)) > 3
               or all(p.isidentifier() for p in target.split(".")))):
        return acc
    raise ConfigError(
        f"{var}{value!r} is not an adapter name, module:Class or path/to/file.py:Class; expected something like "
        "'cpu', 'npu', 'acme_torch.adapter:AcmeAccelerator' or 'acme.py:AcmeAccelerator' (no device index; "
        "`portspeed info` lists the adapters)")


def parse_names(var: str, value: str, pattern: re.Pattern[str], kind: str, hint: str) -> tuple[str, ...]:
    """Split a comma-separated list of names, or raise naming the variable, the bad names and ``hint``."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    bad = [n for n in names if not pattern.match(n)]
    if bad:
        raise ConfigError(f"{var} has invalid {kind} {bad}; {hint}")
    return names


def parse_seconds(name: str, value: str, hint: str = "") -> float:
    """A positive number of seconds (ASCII, below 1e7), or ConfigError naming ``name`` (a variable or an option)."""
    raw = value.strip()
    try:
        s = float(raw) if raw.isascii() else -1.0  # float() also reads other scripts' digits
    except ValueError:
        s = -1.0
    if not (0 < s < 1e7):
        shown = f"{name} {value!r}" if name.startswith("-") else f"{name}={value!r}"
        raise ConfigError(f"{shown} is not a positive number of seconds{'; ' + hint if hint else ''}")
    return s


def parse_te_kernels(value: str) -> tuple[tuple[str, str], ...]:
    """``PORTSPEED_TE_KERNELS``: ``(op, impl)`` pairs (``op`` ``"*"`` for a bare value); ConfigError names the bad
    part."""
    var, pairs = "PORTSPEED_TE_KERNELS", []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        op, sep, impl = part.partition("=")
        op, impl = (op.strip(), impl.strip().lower()) if sep else ("*", op.strip().lower())
        if op != "*" and op not in TE_KERNEL_OPS:
            raise ConfigError(f"{var}={value!r}: {op!r} is not an operation; operations: {', '.join(TE_KERNEL_OPS)}")
        if impl not in TE_KERNEL_IMPLS:
            raise ConfigError(f"{var}={value!r}: {impl!r} is not an implementation; use one of "
                              f"{', '.join(TE_KERNEL_IMPLS)}, for every operation or per operation "
                              "('attention=reference,rms_norm=torch')")
        if any(o == op for o, _ in pairs):
            raise ConfigError(f"{var}={value!r} sets {'the default' if op == '*' else repr(op)} twice")
        pairs.append((op, impl))
    return tuple(pairs)


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


def check_findable_modules(var: str, names: Iterable[str], env: Mapping[str, str] | None = None) -> None:
    """Refuse module names no finder locates (a typo in ``var``), naming them; ``__main__`` always exists.

    Run at the adaptor's import, in the process whose sys.path the modules are imported from
    (not by `portspeed run`'s launcher, whose sys.path is not the script's).
    """
    env = os.environ if env is None else env
    late = {n.strip() for n in env.get(LATE_MODULES_ENV, "").split(",") if n.strip()}
    # `portspeed run`'s worker imports the adaptor before it puts the script's folder on sys.path
    target = env.get("PORTSPEED_RUN_TARGET", "")
    beside = [os.path.dirname(target[5:])] if target.startswith("path:") else []
    missing = [n for n in names if n != "__main__" and n not in late and not _findable(n, beside)]
    if missing:
        raise ConfigError(
            f"{var} names modules that cannot be imported here: {missing}; give importable module names "
            f"(check the spelling and that the package is installed or on PYTHONPATH; the entry script is '__main__')")


#: the flight recorder's settings (``portspeed.comm.trace``), read here and nowhere else; ``portspeed.comm.trace_files``
#: names them, with the recorder's files, for the recorder and `portspeed run`'s watchdog
TRACE_ENV = "PORTSPEED_TRACE"
TRACE_DIR_ENV = "PORTSPEED_TRACE_DIR"
TRACE_ON_EXIT_ENV = "PORTSPEED_TRACE_ON_EXIT"
#: set by `portspeed run --hang-timeout S` for its workers (and readable by a user's own launcher)
HANG_TIMEOUT_ENV = "PORTSPEED_HANG_TIMEOUT"
#: the recorder's entries when a hang timeout turns it on and PORTSPEED_TRACE is unset
HANG_TRACE_ENTRIES = 2000
_COUNT = re.compile(r"\+?[0-9]+")  # ASCII digits: "²" passes str.isdigit(), then int() fails


def _trace_settings(env: Mapping[str, str]) -> dict:
    """PORTSPEED_TRACE / _TRACE_DIR / _TRACE_ON_EXIT / _HANG_TIMEOUT, or ConfigError naming the bad one.

    One reading for the launcher and every rank: an unset PORTSPEED_TRACE is 0 (off), or 2000 entries
    when a hang timeout is set; ``00`` is 0, ``+5`` is 5, `` 7 `` is 7; anything but ASCII digits is refused.
    """
    kw: dict = {}
    hang = env.get(HANG_TIMEOUT_ENV, "").strip()
    if hang:
        kw["hang_timeout"] = parse_seconds(HANG_TIMEOUT_ENV, hang, "give how long no rank may complete a "
                                           "collective before the job is dumped and ended")
        kw["trace"] = HANG_TRACE_ENTRIES
    raw = env.get(TRACE_ENV, "").strip()
    if raw:
        if not _COUNT.fullmatch(raw) or int(raw) > 10_000_000:
            raise ConfigError(f"{TRACE_ENV}={env[TRACE_ENV]!r} is not a non-negative integer; give the number of "
                              f"entries each rank keeps in ASCII digits (0: off; {HANG_TRACE_ENTRIES} is plenty to "
                              "find a hang)")
        kw["trace"] = int(raw)
    folder = env.get(TRACE_DIR_ENV, "").strip()
    if folder:
        path = os.path.abspath(folder)
        probe = path
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)  # the nearest existing ancestor is where the folder gets created
        if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
            raise ConfigError(f"{TRACE_DIR_ENV}={folder!r} is not a writable folder ({probe!r} is "
                              f"{'not a folder' if not os.path.isdir(probe) else 'not writable'}); give a folder "
                              "this user can write, or unset it for a new one under the temporary directory")
        kw["trace_dir"] = path
    if TRACE_ON_EXIT_ENV in env:
        kw["trace_on_exit"] = parse_bool(TRACE_ON_EXIT_ENV, env[TRACE_ON_EXIT_ENV])
    return kw


#: the probe's settings (``portspeed.probe``), read here and nowhere else: field -> variable
PROBE_ENV = {"dir": "PORTSPEED_PROBE_DIR", "iterations": "PORTSPEED_PROBE_ITERATIONS", "level": "PORTSPEED_PROBE_LEVEL",
             "ranks": "PORTSPEED_PROBE_RANKS", "modules": "PORTSPEED_PROBE_MODULES",
             "tensors": "PORTSPEED_PROBE_TENSORS", "inputs": "PORTSPEED_PROBE_INPUTS", "nan": "PORTSPEED_PROBE_NAN"}
PROBE_LEVELS = ("module", "op")


def parse_probe_iterations(name: str, value: str) -> tuple[int, int]:
    """``A:B`` (or ``A``), 1-based, A <= B, in ASCII digits; ConfigError naming ``name`` (a variable or an option)."""
    a, colon, b = value.strip().partition(":")
    if not colon:
        b = a
    if _COUNT.fullmatch(a.strip()) and _COUNT.fullmatch(b.strip()) and 1 <= int(a) <= int(b) < 10**9:
        return int(a), int(b)
    shown = f"{name} {value!r}" if name.startswith("-") else f"{name}={value!r}"
    raise ConfigError(f"{shown} is not a range of iterations; give A:B with 1 <= A <= B (training iterations, "
                      "1-based, as Megatron prints them), e.g. 3:5, or one iteration, e.g. 3")


def check_probe_dir(name: str, folder: str) -> str:
    """The absolute folder, or ConfigError when it (or the nearest existing folder above it) cannot be written."""
    path = os.path.abspath(folder)
    above = path
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)  # the nearest existing ancestor is where the folder gets created
    if not os.path.isdir(above) or not os.access(above, os.W_OK | os.X_OK):
        shown = f"{name} {folder!r}" if name.startswith("-") else f"{name}={folder!r}"
        raise ConfigError(f"{shown} is not a writable folder ({above!r} is "
                          f"{'not a folder' if not os.path.isdir(above) else 'not writable'}); give a folder this "
                          "user can write")
    return path


def _probe_settings(env: Mapping[str, str]) -> dict:
    """PORTSPEED_PROBE_*, or ConfigError naming the bad one; any of them without PORTSPEED_PROBE_DIR is refused."""
    given = {f: env[v].strip() for f, v in PROBE_ENV.items() if env.get(v, "").strip()}
    if not given:
        return {}
    if "dir" not in given:
        other = PROBE_ENV[next(iter(given))]
        raise ConfigError(f"{other} is set but PORTSPEED_PROBE_DIR is not; give the folder the probe writes "
                          "(portspeed run --probe DIR), or unset it")
    kw: dict = {"probe_dir": check_probe_dir(PROBE_ENV["dir"], given["dir"])}
    if "iterations" in given:
        kw["probe_iterations"] = parse_probe_iterations(PROBE_ENV["iterations"], given["iterations"])
    if "level" in given:
        if given["level"].lower() not in PROBE_LEVELS:
            raise ConfigError(f"{PROBE_ENV['level']}={given['level']!r} is not a probe level; use module (every "
                              "module's outputs, gradients, parameters) or op (also every torch function and "
                              "collective inside them)")
        kw["probe_level"] = given["level"].lower()
    if "ranks" in given:
        parts = [p.strip() for p in given["ranks"].split(",") if p.strip()]
        if not parts or not all(_COUNT.fullmatch(p) for p in parts):
            raise ConfigError(f"{PROBE_ENV['ranks']}={given['ranks']!r} is not a list of ranks; give global ranks "
                              "in ASCII digits separated by commas, e.g. 0,3")
        kw["probe_ranks"] = tuple(sorted({int(p) for p in parts}))
    for field in ("modules", "tensors"):
        if field in given:
            kw[f"probe_{field}"] = given[field]
    for field in ("inputs", "nan"):
        if field in given:
            kw[f"probe_{field}"] = parse_bool(PROBE_ENV[field], given[field])
    return kw


@dataclasses.dataclass(frozen=True)
class Settings:
    """The validated PORTSPEED_* environment."""

    accelerator: str | None = None
    backend: str | None = None
    strict: bool = False
    disable: tuple[str, ...] = ()
    log_level: str = "WARNING"
    timeout: float = 300.0
    loss_log: str | None = None
    gloo_lazy_init: bool = True
    te_kernels: tuple[tuple[str, str], ...] = ()
    trace: int = 0
    trace_dir: str | None = None
    trace_on_exit: bool = False
    hang_timeout: float | None = None
    nan_check: bool = False
    #: the probe (portspeed.probe): None = off
    probe_dir: str | None = None
    probe_iterations: tuple[int, int] = (1, 1)
    probe_level: str = "module"
    probe_ranks: tuple[int, ...] | None = None
    probe_modules: str | None = None
    probe_tensors: str | None = None
    probe_inputs: bool = False
    probe_nan: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        kw: dict = {}
        acc = env.get("PORTSPEED_ACCELERATOR", "").strip()
        if acc:
            kw["accelerator"] = parse_accelerator(acc)
        backend = env.get("PORTSPEED_BACKEND", "").strip()
        if backend:
            if not _NAME.match(backend.lower()):
                raise ConfigError(
                    f"PORTSPEED_BACKEND={backend!r} is not a backend name; expected one name such as "
                    "'gloo', 'nccl', 'hccl', 'xccl' (no device prefixes, no commas)"
                )
            kw["backend"] = backend.lower()
        if "PORTSPEED_STRICT" in env:
            kw["strict"] = parse_bool("PORTSPEED_STRICT", env["PORTSPEED_STRICT"])
        disable = env.get("PORTSPEED_DISABLE", "").strip()
        if disable:
            kw["disable"] = parse_names(
                "PORTSPEED_DISABLE", disable, _PATCH_NAME, "patch names",
                "give comma-separated names as listed by `portspeed patches` (a trailing '*' matches a prefix)")
        level = env.get("PORTSPEED_LOG_LEVEL", "").strip()
        if level:
            if level.upper() not in _LEVELS:
                raise ConfigError(
                    f"PORTSPEED_LOG_LEVEL={level!r} is not a logging level; use one of {', '.join(_LEVELS)}"
                )
            kw["log_level"] = level.upper()
        timeout = env.get("PORTSPEED_TIMEOUT", "").strip()
        if timeout:
            kw["timeout"] = parse_seconds("PORTSPEED_TIMEOUT", timeout)
        if "PORTSPEED_GLOO_LAZY_INIT" in env:
            kw["gloo_lazy_init"] = parse_bool("PORTSPEED_GLOO_LAZY_INIT", env["PORTSPEED_GLOO_LAZY_INIT"])
        te_kernels = env.get("PORTSPEED_TE_KERNELS", "").strip()
        if te_kernels:
            kw["te_kernels"] = parse_te_kernels(te_kernels)
        kw.update(_trace_settings(env))
        if "PORTSPEED_NAN_CHECK" in env:
            kw["nan_check"] = parse_bool("PORTSPEED_NAN_CHECK", env["PORTSPEED_NAN_CHECK"])
        kw.update(_probe_settings(env))
        loss_log = env.get("PORTSPEED_LOSS_LOG", "").strip()
        if loss_log:
            kw["loss_log"] = loss_log
        return cls(**kw)

    def te_kernel_start(self, op: str) -> str:
        """Where the preference vendor -> torch -> reference starts for ``op`` (PORTSPEED_TE_KERNELS; default
        vendor)."""
        given = dict(self.te_kernels)
        return given.get(op, given.get("*", "vendor"))

    def is_disabled(self, patch_name: str) -> bool:
        """True when PORTSPEED_DISABLE names this patch or a prefix ending in '*'."""
        for n in self.disable:
            if n.endswith("*"):
                if patch_name.startswith(n[:-1]):
                    return True
            elif n == patch_name:
                return True
        return False


_settings: Settings | None = None


def settings() -> Settings:
    """The current settings, read from the environment on first use."""
    global _settings
    if _settings is None:
        _settings = Settings.from_env()
    return _settings


def reload() -> Settings:
    """Re-read the environment (for tests and launchers that change it)."""
    global _settings
    _settings = None
    return settings()
