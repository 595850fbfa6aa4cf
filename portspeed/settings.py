"""Every PORTSPEED_* setting, declared once: its variable, its ``Settings`` field, its parser, its default, its
meaning and the command-line switch that sets it.

Why one table: ``portspeed.config.Settings`` and its reading, the preflight's list of names
(``portspeed.accelerator.preflight.SETTINGS``), the table in docs/usage.md (``python -m portspeed.settings
--markdown``; tests/test_config.py compares) and `portspeed run`'s probe switches are all derived from it, so a
setting cannot be read one way by the launcher and another by its ranks. Every parser takes ``(name, value)``:
``name`` is the variable or the switch, and a refusal names it (``VAR='v'``, ``--switch 'v'``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Any, Callable

from portspeed.errors import ConfigError

__all__ = ["Setting", "TABLE", "BY_ENV", "BY_FIELD", "markdown", "parse_bool", "parse_accelerator", "parse_names",
           "parse_seconds", "parse_te_kernels", "parse_probe_iterations", "writable_folder", "TE_KERNEL_OPS",
           "TE_KERNEL_IMPLS", "PROBE_LEVELS", "PERF_LEVELS", "HANG_TRACE_ENTRIES"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")
_PATCH_NAME = re.compile(r"^[A-Za-z0-9_.\-*]+$")
_PREFIX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_COUNT = re.compile(r"\+?[0-9]+")  # ASCII digits: "²" passes str.isdigit(), then int() fails
#: the operations of the vendor kernel slot, the one list: ``portspeed.accelerator.kernel_ops`` gives each its
#: contract, ``portspeed.portable_te.kernels`` its implementations, PORTSPEED_TE_KERNELS names them
TE_KERNEL_OPS = ("attention", "attention_lse", "attention_lse_backward", "rms_norm", "layer_norm", "rope", "swiglu",
                 "grouped_mm")
#: the implementations, in the order of preference
TE_KERNEL_IMPLS = ("vendor", "torch", "reference")
PROBE_LEVELS = ("module", "op")
PERF_LEVELS = ("module", "op")
#: the recorder's entries when a hang timeout turns it on and PORTSPEED_TRACE is unset
HANG_TRACE_ENTRIES = 2000


@dataclasses.dataclass(frozen=True)
class Setting:
    """One PORTSPEED_* setting. ``switch``: the option of ``command`` that sets it; ``blank``: an empty value is read
    too (a boolean's empty is false), else an empty or unset variable keeps the default; ``needs``: the variable
    without which this one is refused."""

    env: str
    field: str
    parse: Callable[[str, str], Any]
    default: Any
    values: str
    describe: str
    switch: str | None = None
    blank: bool = False
    needs: str | None = None
    command: str = "portspeed run"


def _shown(name: str, value: str) -> str:
    """How a refusal names what was given: ``VAR='v'`` for a variable, ``--switch 'v'`` for an option."""
    return f"{name} {value!r}" if name.startswith("-") else f"{name}={value!r}"


def parse_bool(var: str, value: str) -> bool:
    """Parse a boolean environment value or raise naming the variable and the accepted spellings."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{var}={value!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


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
        raise ConfigError(f"{_shown(name, value)} is not a positive number of seconds{'; ' + hint if hint else ''}")
    return s


def parse_te_kernels(value: str, var: str = "PORTSPEED_TE_KERNELS") -> tuple[tuple[str, str], ...]:
    """``PORTSPEED_TE_KERNELS``: ``(op, impl)`` pairs (``op`` ``"*"`` for a bare value); ConfigError names the bad
    part."""
    pairs: list[tuple[str, str]] = []
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


def parse_probe_iterations(name: str, value: str) -> tuple[int, int]:
    """``A:B`` (or ``A``), 1-based, A <= B, in ASCII digits; ConfigError naming ``name`` (a variable or an option)."""
    a, colon, b = value.strip().partition(":")
    if not colon:
        b = a
    if _COUNT.fullmatch(a.strip()) and _COUNT.fullmatch(b.strip()) and 1 <= int(a) <= int(b) < 10**9:
        return int(a), int(b)
    raise ConfigError(f"{_shown(name, value)} is not a range of iterations; give A:B with 1 <= A <= B (training "
                      "iterations, 1-based, as Megatron prints them), e.g. 3:5, or one iteration, e.g. 3")


def writable_folder(name: str, folder: str, hint: str = "") -> str:
    """The absolute folder, or ConfigError when it (or the nearest existing folder above it, where it gets created)
    cannot be written; the one permission check of every folder setting."""
    path = os.path.abspath(folder)
    above = path
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above) or not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"{_shown(name, folder)} is not a writable folder ({above!r} is "
                          f"{'not a folder' if not os.path.isdir(above) else 'not writable'}); give a folder this "
                          f"user can write{hint}")
    return path


def _accelerator(name: str, value: str) -> str:
    return parse_accelerator(value, f"{name} " if name.startswith("-") else f"{name}=")


def _backend(name: str, value: str) -> str:
    if not _NAME.match(value.lower()):
        raise ConfigError(f"{_shown(name, value)} is not a backend name; expected one name such as 'gloo', 'nccl', "
                          "'hccl', 'xccl' (no device prefixes, no commas)")
    return value.lower()


def _disable(name: str, value: str) -> tuple[str, ...]:
    return parse_names(name, value, _PATCH_NAME, "patch names",
                       "give comma-separated names as listed by `portspeed patches` (a trailing '*' matches a prefix)")


def _log_level(name: str, value: str) -> str:
    if value.upper() not in _LEVELS:
        raise ConfigError(f"{_shown(name, value)} is not a logging level; use one of {', '.join(_LEVELS)}")
    return value.upper()


def parse_framework_modules(name: str, value: str) -> tuple[str, ...]:
    """Comma-separated importable module prefixes, torch (and its submodules) refused."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    bad = [n for n in names if not _PREFIX.match(n) or n == "torch" or n.startswith("torch.")]
    if bad:
        raise ConfigError(f"{name} has invalid module names {bad} (value {value!r}); accepted: comma-separated "
                          "importable module prefixes other than torch, e.g. 'megatron,my_project.models'")
    return names


def _te_kernels(name: str, value: str) -> tuple[tuple[str, str], ...]:
    return parse_te_kernels(value, name)


def _trace(name: str, value: str) -> int:
    if not _COUNT.fullmatch(value.strip()) or int(value) > 10_000_000:
        raise ConfigError(f"{_shown(name, value)} is not a non-negative integer; give the number of entries each rank "
                          f"keeps in ASCII digits (0: off; {HANG_TRACE_ENTRIES} is plenty to find a hang)")
    return int(value)


def _hang_timeout(name: str, value: str) -> float:
    return parse_seconds(name, value, "give how long no rank may complete a collective before the job is dumped "
                                      "and ended")


def _trace_dir(name: str, value: str) -> str:
    return writable_folder(name, value, ", or unset it for a new one under the temporary directory")


def _probe_level(name: str, value: str) -> str:
    if value.strip().lower() not in PROBE_LEVELS:
        raise ConfigError(f"{_shown(name, value)} is not a probe level; use module (every module's outputs, "
                          "gradients, parameters) or op (also every torch function and collective inside them)")
    return value.strip().lower()


def _perf_level(name: str, value: str) -> str:
    if value.strip().lower() not in PERF_LEVELS:
        raise ConfigError(f"{_shown(name, value)} is not a perf level; use module (each module's forward and backward "
                          "time) or op (also each operator's time inside them)")
    return value.strip().lower()


def _bandwidth_file(name: str, value: str) -> str:
    path = os.path.abspath(os.path.expanduser(value.strip()))
    if os.path.isdir(path):
        raise ConfigError(f"{_shown(name, value)} is a folder; give the path of the link bandwidth table's JSON file "
                          "(created if missing)")
    writable_folder(name, os.path.dirname(path), " (the table's folder; conformance writes the table there)")
    return path


def _probe_ranks(name: str, value: str) -> tuple[int, ...]:
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts or not all(_COUNT.fullmatch(p) for p in parts):
        raise ConfigError(f"{_shown(name, value)} is not a list of ranks; give global ranks in ASCII digits "
                          "separated by commas, e.g. 0,3")
    return tuple(sorted({int(p) for p in parts}))


def _glob(example: str) -> Callable[[str, str], str]:
    def parse(name: str, value: str) -> str:
        if not value.strip():
            raise ConfigError(f"{name} is empty; give a glob such as {example}")
        return value.strip()
    return parse


def _text(name: str, value: str) -> str:
    return value.strip()


_PROBE = "PORTSPEED_PROBE_DIR"
_PERF = "PORTSPEED_PERF"
_B01 = "0/1, true/false, yes/no, on/off"
#: the settings, in the order they are read (the first refusal is the one reported) and documented
TABLE: tuple[Setting, ...] = (
    Setting("PORTSPEED_ACCELERATOR", "accelerator", _accelerator, None,
            "adapter name (`cpu`, `cuda`, `npu`, `xpu`, `mlu`, `musa`, `hpu`, `standin`, `testdev`, an entry-point "
            "adapter), `module:Class` or `path/to/file.py:Class`",
            "skip auto-detection (unset: npu, mlu, musa, hpu, xpu, cuda, cpu, entry-point adapters first); the last "
            "two forms name an adapter that is not installed (a relative path is taken from where the command "
            "started; every rank gets the same file)", switch="--adapter",
            command="portspeed info / conformance"),
    Setting("PORTSPEED_BACKEND", "backend", _backend, None, "c10d backend name (`gloo`, `nccl`, `hccl`, ...)",
            "override the adapter's collective backend"),
    Setting("PORTSPEED_STRICT", "strict", parse_bool, False, _B01,
            "any skipped (drifted) or failed patch raises at apply time", blank=True),
    Setting("PORTSPEED_DISABLE", "disable", _disable, (), "comma-separated patch names or `prefix*`",
            "block those patches"),
    Setting("PORTSPEED_LOG_LEVEL", "log_level", _log_level, "WARNING", "DEBUG, INFO, WARNING (default), ERROR",
            "portspeed's logger level"),
    Setting("PORTSPEED_TIMEOUT", "timeout", parse_seconds, 300.0, "seconds (positive number; default 300)",
            "collective / rendezvous timeout used by launchers and tests"),
    Setting("PORTSPEED_LOSS_LOG", "loss_log", _text, None, "file path",
            "where a training script writes its JSON loss record (`open_loss_log`, used by the example trainers; "
            "stock scripts print losses, which `portspeed compare` reads)"),
    Setting("PORTSPEED_FRAMEWORK_MODULES", "framework_modules", parse_framework_modules, (),
            "comma-separated module prefixes (`__main__` for the entry script)",
            "extra modules that get the translated `torch.cuda` besides `megatron`; each must be importable, else "
            "refused at the adaptor's import (see megatron-core-loop.md)"),
    Setting("PORTSPEED_GLOO_LAZY_INIT", "gloo_lazy_init", parse_bool, True, f"{_B01} (default 1)",
            "Gloo groups connect their ranks at their first collective, not when created (torch >= 2.8; an "
            "explicit TORCH_GLOO_LAZY_INIT wins)", blank=True),
    Setting("PORTSPEED_TE_KERNELS", "te_kernels", _te_kernels, (),
            "`vendor`, `torch` or `reference` for every operation, and/or `op=value` per operation "
            "(`attention=reference,rms_norm=torch`)",
            "where the portable Transformer Engine starts its preference vendor -> torch -> reference (unset: vendor)"),
    Setting("PORTSPEED_HANG_TIMEOUT", "hang_timeout", _hang_timeout, None, "seconds (positive number)",
            "how long no rank may complete a recorded call before `portspeed run` dumps and ends the job; it turns "
            "recording on (a rank that never starts recording is named with the reason; see reliability.md)",
            switch="--hang-timeout"),
    Setting("PORTSPEED_TRACE", "trace", _trace, 0,
            f"entries, ASCII digits (default 0: off; {HANG_TRACE_ENTRIES} when a hang timeout is set)",
            "the per-rank collective / point-to-point flight recorder (see reliability.md, \"When it hangs\")"),
    Setting("PORTSPEED_TRACE_DIR", "trace_dir", _trace_dir, None, "a writable folder (created if missing)",
            "where each rank writes its trace dump; unset: a new folder under the temporary directory, named in one "
            "log line"),
    Setting("PORTSPEED_TRACE_ON_EXIT", "trace_on_exit", parse_bool, False, f"{_B01} (default 0)",
            "every rank dumps its trace buffer when it exits normally too", blank=True),
    Setting("PORTSPEED_NAN_CHECK", "nan_check", parse_bool, False, f"{_B01} (default 0)",
            "a NaN in a collective's input or output is raised at that collective, naming the rank, op, group and "
            "call site (see reliability.md)", blank=True),
    Setting("PORTSPEED_CCL_CHECK", "ccl_check", parse_bool, True, f"{_B01} (default 1)",
            "when the job's default group is made, its CCL's collectives (all_reduce, broadcast, all_gather, "
            "reduce_scatter, all_to_all_single, send/recv) are checked on small tensors (milliseconds); a wrong "
            "value ends the job naming the collective and the line to paste (skipped on Gloo, and for an adapter "
            "that declares ccl_verified = True)", blank=True),
    Setting("PORTSPEED_PROBE_DIR", "probe_dir", writable_folder, None,
            "a writable folder holding no probe dump (created if missing)",
            "the accuracy probe: module (or op) statistics in msprobe's layout (see accuracy.md); unset: no probe",
            switch="--probe"),
    Setting("PORTSPEED_PROBE_ITERATIONS", "probe_iterations", parse_probe_iterations, (1, 1),
            "`A:B` or `A` (1-based, default `1:1`)", "the training iterations recorded", "--probe-iterations",
            needs=_PROBE),
    Setting("PORTSPEED_PROBE_LEVEL", "probe_level", _probe_level, "module", "`module` (default) or `op`",
            "modules' outputs, gradients and parameters; `op` adds every torch function and collective inside them",
            "--probe-level", needs=_PROBE),
    Setting("PORTSPEED_PROBE_RANKS", "probe_ranks", _probe_ranks, None, "comma-separated global ranks (default: all)",
            "the ranks that record", "--probe-ranks", needs=_PROBE),
    Setting("PORTSPEED_PROBE_MODULES", "probe_modules", _glob("decoder.layers.1*"), None,
            "a glob over canonical module paths (`decoder.layers.1*`)", "the modules recorded (default: all)",
            "--probe-modules", needs=_PROBE),
    Setting("PORTSPEED_PROBE_TENSORS", "probe_tensors", _glob("Module.decoder.layers.1.*"), None,
            "a glob over entry keys (`Module.decoder.layers.1.*`)",
            "also save those entries' full tensors, inputs included", "--probe-tensors", needs=_PROBE),
    Setting("PORTSPEED_PROBE_INPUTS", "probe_inputs", parse_bool, False, f"{_B01} (default 0)",
            "also record modules' inputs", "--probe-inputs", needs=_PROBE),
    Setting("PORTSPEED_PROBE_NAN", "probe_nan", parse_bool, False, f"{_B01} (default 0)",
            "on every iteration, find the first module (op) whose output or gradient turned non-finite; write that "
            "iteration's dump and stop the job", "--probe-nan", needs=_PROBE),
    Setting("PORTSPEED_PERF", "perf_dir", writable_folder, None,
            "a writable folder holding no perf recording (created if missing)",
            "where a port is slow: per rank and iteration, each module's forward and backward time, host syncs, CPU "
            "fallbacks and collectives (see performance.md); unset: nothing installed", switch="--perf"),
    Setting("PORTSPEED_PERF_ITERATIONS", "perf_iterations", parse_probe_iterations, (2, 4),
            "`A:B` or `A` (1-based, default `2:4`: the first iteration warms up)", "the training iterations timed",
            "--perf-iterations", needs=_PERF),
    Setting("PORTSPEED_PERF_RANKS", "perf_ranks", _probe_ranks, None, "comma-separated global ranks (default: all)",
            "the ranks that record timings", "--perf-ranks", needs=_PERF),
    Setting("PORTSPEED_PERF_LEVEL", "perf_level", _perf_level, "module", "`module` (default) or `op`",
            "each module's forward and backward time; `op` adds each operator's time inside them", "--perf-level",
            needs=_PERF),
    Setting("PORTSPEED_BANDWIDTH", "bandwidth_file", _bandwidth_file, None,
            "a JSON file in a writable folder (default `~/.cache/portspeed/bandwidth.json`, under `XDG_CACHE_HOME` "
            "when set)",
            "the link bandwidth table: `portspeed conformance --suites bandwidth` writes each collective's measured "
            "bus bandwidth there, `portspeed compare --perf` reads it beside the achieved one (see performance.md)",
            switch="--bandwidth", command="portspeed conformance / compare"),
)
BY_ENV: dict[str, Setting] = {s.env: s for s in TABLE}
BY_FIELD: dict[str, Setting] = {s.field: s for s in TABLE}


def markdown() -> str:
    """The settings table of docs/usage.md, generated from ``TABLE`` (tests/test_config.py compares the two)."""
    rows = ["| variable | values | meaning | command-line switch |", "|---|---|---|---|"]
    for s in TABLE:
        switch = f"`{s.command} {s.switch}`" if s.switch else ""
        rows.append(f"| `{s.env}` | {s.values} | {s.describe} | {switch} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m portspeed.settings --markdown
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m portspeed.settings --markdown")
    sys.stdout.write(markdown())
