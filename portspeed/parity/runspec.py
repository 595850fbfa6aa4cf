"""Run specs: launch the runs to compare (commands x backends x layouts), collect their loss records.

A spec is a JSON file. Each run is a command (a list of arguments, no shell) with
environment variables; it must leave a loss record at ``{record}``, which portspeed also
passes as ``PORTSPEED_LOSS_LOG``. A run that writes no record but prints Megatron
iteration lines is read from its log instead, so stock Megatron-LM runs work too::

    {"timeout": 600,
     "env": {"PORTSPEED_ACCELERATOR": "cpu"},
     "runs": [{"name": "tp1", "command": ["{python}", "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                          "--master-addr", "127.0.0.1", "--master-port", "{port}",
                                          "examples/pretrain_gpt.py", "--loss-log", "{record}"]}],
     "matrix": {"name": "{backend}-tp{tp}-pp{pp}",
                "command": ["{python}", "-m", "torch.distributed.run", "--nproc-per-node", "{nproc}",
                            "--master-addr", "127.0.0.1", "--master-port", "{port}",
                            "examples/pretrain_gpt.py", "--tp", "{tp}", "--pp", "{pp}", "--loss-log", "{record}"],
                "env": {"PORTSPEED_BACKEND": "{backend}"},
                "axes": {"backend": ["gloo", "standin"],
                         "layout": [{"tp": 2, "pp": 1, "nproc": 2}, {"tp": 1, "pp": 2, "nproc": 2}]}}}

``setup`` (same form as ``runs``) lists commands run first whose output is not compared,
e.g. writing the checkpoint every layout loads. Runs listed under ``runs`` come first, then the matrix's product in axis
order; the first run is the reference unless ``"reference": NAME`` says otherwise. Placeholders:
``{python}`` (this interpreter), ``{record}``, ``{port}`` (a free 127.0.0.1 port), ``{name}``,
``{workdir}``, and the matrix axes (an axis whose values are objects contributes their keys).
Runs are started one after another (the test machines have two cores), each in its own
process group with ``OMP_NUM_THREADS=1`` unless the spec sets it, and killed at ``timeout``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, TextIO

from portspeed.errors import PortspeedError
from portspeed.parity.losslog import LossLogError, LossRecord, parse_megatron_log, read_record

__all__ = ["RunSpec", "Spec", "SpecError", "RunFailedError", "load_spec", "spec_from_json",
           "run_one", "run_spec", "free_port"]

_NAME = re.compile(r"^[A-Za-z0-9_.,=+\-]+$")
_KNOWN_KEYS = {"setup", "runs", "matrix", "timeout", "env", "reference", "cwd"}


class SpecError(PortspeedError, ValueError):
    """A run spec is malformed; the message names the field."""


class RunFailedError(PortspeedError):
    """A launched run exited non-zero, timed out, or left no losses; the message has its log tail."""


@dataclasses.dataclass
class RunSpec:
    """One command to launch: its name, argv template, env template, limits."""

    name: str
    command: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout: float = 600.0
    cwd: str | None = None
    record: str | None = None


@dataclasses.dataclass
class Spec:
    """Every run of a spec, in order (the first is the reference)."""

    runs: list[RunSpec]
    source: str = "<spec>"
    #: commands run first, in order, whose output is not compared (e.g. writing a shared checkpoint)
    setup: list[RunSpec] = dataclasses.field(default_factory=list)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _str_list(v: Any, where: str) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(x, (str, int, float)) for x in v):
        raise SpecError(f"{where} must be a non-empty list of strings (one per argument, no shell)")
    return [str(x) for x in v]


def _env(v: Any, where: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
        raise SpecError(f"{where} must be an object of NAME: value")
    return {k: str(x) for k, x in v.items()}


def _timeout(v: Any, where: str, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise SpecError(f"{where} = {v!r}: give a positive number of seconds")
    return float(v)


def spec_from_json(data: Any, source: str = "<spec>") -> Spec:
    """Validate a decoded spec and expand its matrix into runs."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{source}: a run spec is a JSON object with 'runs' and/or 'matrix'")
    unknown = set(data) - _KNOWN_KEYS
    if unknown:
        raise SpecError(f"{source}: unknown keys {sorted(unknown)}; allowed: {sorted(_KNOWN_KEYS)}")
    timeout = _timeout(data.get("timeout"), f"{source}: timeout", 600.0)
    common_env = _env(data.get("env"), f"{source}: env")
    cwd = data.get("cwd")
    setup = _plain_runs(data.get("setup"), f"{source}: setup", common_env, timeout, cwd, "setup")
    runs = _plain_runs(data.get("runs"), f"{source}: runs", common_env, timeout, cwd, "run")
    m = data.get("matrix")
    if m is not None:
        runs.extend(_expand_matrix(m, f"{source}: matrix", common_env, timeout, cwd))
    if len(runs) < 2:
        raise SpecError(f"{source}: lists {len(runs)} run(s); a comparison needs at least two")
    names = [r.name for r in runs]
    for n in names + [r.name for r in setup]:
        if not _NAME.match(n):
            raise SpecError(f"{source}: run name {n!r} may only use letters, digits and _.,=+- (it names files)")
    every = names + [r.name for r in setup]
    dup = sorted({n for n in every if every.count(n) > 1})
    if dup:
        raise SpecError(f"{source}: duplicate run names {dup}; give each run its own name")
    ref = data.get("reference")
    if ref is not None:
        if ref not in names:
            raise SpecError(f"{source}: reference {ref!r} is not a run name; runs are {names}")
        runs.insert(0, runs.pop(names.index(ref)))
    return Spec(runs, source, setup)


def _plain_runs(items: Any, where: str, common_env: dict[str, str], timeout: float, cwd: Any,
                prefix: str) -> list[RunSpec]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise SpecError(f"{where} must be a list of objects with 'command'")
    out = []
    for i, r in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(r, Mapping) or "command" not in r:
            raise SpecError(f"{w} must be an object with 'command' (and optionally name, env, timeout, record)")
        out.append(RunSpec(str(r.get("name") or f"{prefix}{i}"), _str_list(r["command"], f"{w}.command"),
                           {**common_env, **_env(r.get("env"), f"{w}.env")}, {},
                           _timeout(r.get("timeout"), f"{w}.timeout", timeout), r.get("cwd", cwd), r.get("record")))
    return out


def _expand_matrix(m: Any, where: str, common_env: dict[str, str], timeout: float, cwd: Any) -> list[RunSpec]:
    if not isinstance(m, Mapping) or "command" not in m or "axes" not in m:
        raise SpecError(f"{where} must be an object with 'command' and 'axes'")
    axes = m["axes"]
    if not isinstance(axes, Mapping) or not axes or not all(isinstance(v, list) and v for v in axes.values()):
        raise SpecError(f"{where}.axes must map each axis name to a non-empty list of values")
    command = _str_list(m["command"], f"{where}.command")
    env = {**common_env, **_env(m.get("env"), f"{where}.env")}
    name_t = m.get("name")
    out = []
    for combo in itertools.product(*axes.values()):
        values: dict[str, Any] = {}
        for axis, v in zip(axes, combo):
            if isinstance(v, Mapping):
                values.update(v)
            else:
                values[axis] = v
        if name_t:
            name = _fill(str(name_t), values, f"{where}.name", allow_runtime=False)
        else:  # default: every value, e.g. "backend=gloo,tp=2"
            name = ",".join(f"{k}={v}" for k, v in values.items())
        out.append(RunSpec(name, command, env, values, _timeout(m.get("timeout"), f"{where}.timeout", timeout),
                           m.get("cwd", cwd), None))
    return out


_RUNTIME = ("python", "record", "port", "name", "workdir")


def _fill(template: str, values: Mapping[str, Any], where: str, allow_runtime: bool = True) -> str:
    try:
        return template.format_map(dict(values))
    except KeyError as e:
        known = sorted(set(values) | (set(_RUNTIME) if allow_runtime else set()))
        raise SpecError(f"{where}: unknown placeholder {{{e.args[0]}}} in {template!r}; known: {known}") from None
    except (ValueError, IndexError) as e:
        raise SpecError(f"{where}: bad template {template!r} ({e}); write literal braces as {{{{ }}}}") from None


def load_spec(path: str | os.PathLike[str]) -> Spec:
    """Read and validate a JSON run spec."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecError(f"{p}: cannot read the spec ({e})") from e
    except json.JSONDecodeError as e:
        raise SpecError(f"{p}: not valid JSON ({e})") from e
    return spec_from_json(data, str(p))


def _tail(path: Path, limit: int = 80) -> str:
    """The log for an error message: whole if short, else its head and tail (a worker's own
    message often comes before the launcher's long failure dump)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    if len(lines) <= limit:
        return "\n".join(lines)
    head, tail = lines[:15], lines[-(limit - 15):]
    return "\n".join(head + [f"... ({len(lines) - len(head) - len(tail)} lines omitted) ..."] + tail)


def run_one(run: RunSpec, workdir: str | os.PathLike[str], want_record: bool = True) -> LossRecord | None:
    """Launch one run, wait at most its timeout, and return its loss record (meta.name = run name).

    ``want_record=False`` (setup steps): only the exit status matters; returns None.
    """
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    record = Path(run.record).resolve() if run.record else wd / f"{run.name}.json"
    logfile = wd / f"{run.name}.log"
    record.unlink(missing_ok=True)  # never read a stale record from an earlier launch
    values = {**run.values, "python": sys.executable, "record": str(record), "port": free_port(),
              "name": run.name, "workdir": str(wd)}
    argv = [_fill(a, values, f"run {run.name}: command") for a in run.command]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({k: _fill(v, values, f"run {run.name}: env {k}") for k, v in run.env.items()})
    env["PORTSPEED_LOSS_LOG"] = str(record)
    with open(logfile, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run.cwd,
                                    start_new_session=True)
        except OSError as e:
            raise RunFailedError(f"run {run.name}: cannot start {argv[0]!r} ({e}); check the spec's command") from e
        try:
            rc = proc.wait(timeout=run.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise RunFailedError(f"run {run.name}: still running after {run.timeout:g}s, killed. "
                                 f"Log {logfile}:\n{_tail(logfile)}") from None
    if rc != 0:
        raise RunFailedError(f"run {run.name}: exited with status {rc}. Log {logfile}:\n{_tail(logfile)}")
    if not want_record:
        return None
    if record.exists():
        rec = read_record(record)
    else:
        try:
            rec = parse_megatron_log(logfile.read_text(encoding="utf-8", errors="replace"), str(logfile))
        except LossLogError:
            raise RunFailedError(
                f"run {run.name}: exited 0 but wrote no loss record at {record} (PORTSPEED_LOSS_LOG) and its log "
                f"{logfile} has no Megatron iteration lines; make the script write the record") from None
    rec.meta.setdefault("name", run.name)
    return rec


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the run's whole process group (torchrun's workers too), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_spec(spec: Spec, workdir: str | os.PathLike[str], progress: TextIO | None = None) -> list[LossRecord]:
    """Launch every run of ``spec`` in order; the first failure stops and raises RunFailedError."""
    for run in spec.setup:
        if progress is not None:
            print(f"  [setup] {run.name} ...", file=progress, flush=True)
        run_one(run, workdir, want_record=False)
    out = []
    for i, run in enumerate(spec.runs, 1):
        if progress is not None:
            print(f"  [{i}/{len(spec.runs)}] {run.name} ...", file=progress, flush=True)
        rec = run_one(run, workdir)
        assert rec is not None
        out.append(rec)
    return out
