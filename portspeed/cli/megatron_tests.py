"""`portspeed megatron-tests`: Megatron-LM's own unit tests, launched as Megatron's CI launches them, under portspeed.

Why: a port is validated first with the framework's own tests. Megatron-LM's CI
(``tests/unit_tests/run_ci_test.sh``) runs each bucket of ``tests/unit_tests`` as
``torchrun --nproc_per_node 8 ... -m pytest -xvs -m "not experimental and ..." BUCKET``
from the checkout's root: every rank is a pytest process, and the tests' own
``tests/unit_tests/test_utilities.py`` initialises torch.distributed (``backend='nccl'``)
after ``torch.cuda.set_device(rank % torch.cuda.device_count())``. Under portspeed
three things must hold, and this command makes them hold for that run only:

1. every rank imports the adaptor before pytest imports any test module: the ranks are
   started through ``portspeed run`` (``-m pytest``), whose worker imports
   ``portspeed.megatron_adaptor`` first;
2. the ``tests`` package gets the torch.cuda translation that ``megatron.*`` gets: the
   ranks run with ``tests`` added to ``PORTSPEED_FRAMEWORK_MODULES`` (set here, in the
   children's environment, never globally: another project's ``tests`` package is not a
   framework module), and so do the test modules pytest imports under their bare names
   (those in folders without ``__init__.py``, such as ``distributed/``: ``rootless_modules``);
3. the checkout is the working directory and the first entry of ``PYTHONPATH``, as in
   Megatron's container, so ``import tests.unit_tests...`` and ``import megatron`` resolve
   to the checkout.

Each TARGET (a file or folder under ``tests/unit_tests``) is one launch, like one bucket in
Megatron's CI, so each gets its own wall time, exit status and counts (read from rank 0's
pytest summary; every rank's output is kept under ``--log-dir``). Unlike Megatron's CI
(``-x``), a failing test does not stop the file (``--maxfail`` is raised) and a module that
cannot be imported (one needing NVIDIA's Transformer Engine, say) does not stop its
folder (``--continue-on-collection-errors``; it counts as an error), so the counts cover
every file; the tests Megatron's CI leaves out (experimental, flaky) are left out (``--markers``); ``--timeout`` bounds
each launch and a launch that runs past it is killed and reported as such. Options after ``--`` go to pytest as they
are.

Example (the make target ``megatron-unit-tests`` installs the extra packages first)::

    portspeed megatron-tests --root $MEGATRON_LM_ROOT --nproc-per-node 8 \\
        test_parallel_state.py tensor_parallel/ -- -k "not fp8"
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from portspeed.translation.scope import FRAMEWORK_ENV
from portspeed.config import LATE_MODULES_ENV
from portspeed.errors import PortspeedError
from portspeed.testing.pytest_rank_report import REPORT_ENV

__all__ = ["CI_MARKERS", "EXTRA_MODULES", "MARKERS", "Outcome", "build_parser", "child_env", "launch_command",
           "main", "parse_counts", "pytest_pin_note", "resolve_targets", "rootless_modules"]

#: modules Megatron's unit-test conftest and fixtures import beyond megatron-core and pytest
#: (-> the ``megatron-tests`` extra): module name -> distribution
EXTRA_MODULES: dict[str, str] = {"click": "click", "requests": "requests", "pytest_mock": "pytest-mock"}
#: the default selection, Megatron CI's (run_ci_test.sh): no experimental tests (they need Megatron's
#: --experimental flag), none it marks flaky ("lts" environment) or flaky_in_dev ("dev"). A flaky test that
#: fails on some ranks leaves the others waiting in a collective until the launch's timeout.
CI_MARKERS = "not experimental and not flaky and not flaky_in_dev"
MARKERS = CI_MARKERS
UNIT_TESTS = Path("tests") / "unit_tests"
REPORT_PLUGIN = "portspeed.testing.pytest_rank_report"
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")
_SUMMARY = re.compile(r"^=+ .*\b(passed|failed|skipped|errors?|deselected|no tests ran)\b.* in [\d.]+s.*=+$", re.M)


class MegatronTestsError(PortspeedError, ValueError):
    """`portspeed megatron-tests` cannot start: no checkout, an unknown target, a missing package."""


@dataclasses.dataclass
class Outcome:
    """One launch (one TARGET): rank 0's pytest counts, the launcher's exit status, wall time."""

    target: str
    nproc: int
    returncode: int
    seconds: float
    counts: dict[str, int]
    timed_out: bool
    log_dir: str
    #: file -> {outcome: count, "seconds": its tests' time} on rank 0 (portspeed.testing.pytest_rank_report)
    files: dict = dataclasses.field(default_factory=dict)
    #: seconds rank 0's pytest session took, and of that, collecting (importing the test modules)
    session_seconds: float | None = None
    collect_seconds: float | None = None
    #: tests that failed or errored on any rank
    failed_tests: list = dataclasses.field(default_factory=list)

    def line(self) -> str:
        got = ", ".join(f"{n} {k}" for k, n in self.counts.items()) or "no pytest summary from rank 0"
        state = "TIMED OUT" if self.timed_out else ("ok" if self.returncode == 0 else f"exit {self.returncode}")
        head = f"{self.target:<55} {self.nproc} ranks {self.seconds:7.1f} s  {state:<10} {got}"
        if self.session_seconds is not None:
            head += (f"\n      start-up (launch to pytest's session end, minus the session) "
                     f"{self.seconds - self.session_seconds:.1f} s, collection {self.collect_seconds:.1f} s")
        for f, c in sorted(self.files.items()):
            per = ", ".join(f"{n} {k}" for k, n in c.items() if k != "seconds")
            head += f"\n      {f:<62} {c['seconds']:7.1f} s  {per}"
        return head


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="portspeed megatron-tests",
        description="Run Megatron-LM's tests/unit_tests under portspeed, one torchrun launch per TARGET "
        "(as Megatron's CI does), on the active device adapter (PORTSPEED_ACCELERATOR). Options after '--' go to "
        "pytest.")
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="a file or folder under tests/unit_tests (e.g. test_parallel_state.py, tensor_parallel/), "
                   "optionally with a ::test id")
    p.add_argument("--root", default=os.environ.get("MEGATRON_LM_ROOT"),
                   help="the Megatron-LM checkout (default: $MEGATRON_LM_ROOT)")
    p.add_argument("--nproc-per-node", type=int, default=8, metavar="N",
                   help="ranks per launch (Megatron's CI: 8, which most of its parallel tests assume)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="wall-clock limit per launch")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="every rank's stdout/stderr, per target (default: a fresh folder under /tmp)")
    p.add_argument("--markers", default=MARKERS,
                   help=f"pytest -m expression (default, as Megatron's CI: {MARKERS!r}); 'not experimental' "
                   "adds the tests Megatron marks flaky")
    p.add_argument("--json", default=None, metavar="FILE", help="write the outcomes as JSON")
    return p


def _check_root(root: str | None) -> Path:
    if not root:
        raise MegatronTestsError("no Megatron-LM checkout: set MEGATRON_LM_ROOT or pass --root PATH")
    path = Path(root).resolve()
    if not (path / UNIT_TESTS / "test_utilities.py").is_file():
        raise MegatronTestsError(
            f"{path} is not a Megatron-LM checkout with unit tests (no {UNIT_TESTS}/test_utilities.py); "
            "point --root / MEGATRON_LM_ROOT at the repository's root")
    return path


def _check_packages() -> None:
    missing = [dist for mod, dist in EXTRA_MODULES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise MegatronTestsError(
            f"Megatron's unit tests import {', '.join(missing)}, not installed for {sys.executable}; "
            "install portspeed's 'megatron-tests' extra (pip install -e '.[megatron-tests]' -c constraints.txt, "
            "or use `make megatron-unit-tests`)")


_PYTEST_PIN = re.compile(r"""["']pytest==([\w.]+)["']""")


def pytest_pin_note(root: Path, installed: str | None = None) -> str | None:
    """One line when the checkout pins another pytest than the one that will run its tests, else None.

    Why: Megatron-LM pins pytest for its tests (``pytest==8.3.5`` in core_v0.16.1's
    pyproject.toml), and some of its tests depend on it: pytest 9 also attaches ``caplog``'s
    handler to loggers that do not propagate, so torch's DCP debug records land in
    ``caplog.text`` and ``TestNonStrictLoad::test_missing_keys_raises_error_during_validation``
    fails under pytest 9 and passes under 8.3.5 (docs/megatron-unit-tests.md). A difference
    in the runner's own tool is said before the counts, not found in them.
    """
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    pin = _PYTEST_PIN.search(text)
    if pin is None:
        return None
    if installed is None:
        from importlib.metadata import version

        installed = version("pytest")
    if installed == pin.group(1):
        return None
    from packaging.version import InvalidVersion, Version

    try:
        crosses_9 = Version(pin.group(1)).major < 9 <= Version(installed).major
    except InvalidVersion:
        crosses_9 = False
    known = (" Known difference: pytest 9 also captures loggers that do not propagate, so dist_checkpointing's "
             "TestNonStrictLoad missing-keys tests fail on caplog.text." if crosses_9 else "")
    return (f"Megatron-LM pins pytest=={pin.group(1)} for its tests; pytest {installed} runs them here.{known} "
            f"To run with the pin: pip install --target DIR pytest=={pin.group(1)} and set PYTHONPATH=DIR")


def resolve_targets(root: Path, targets: list[str]) -> list[str]:
    """Each TARGET as a path relative to ``root`` (``tests/unit_tests/...``), checked to exist."""
    out = []
    for t in targets:
        path, sep, rest = t.partition("::")
        rel = Path(path)
        if rel.is_absolute():
            try:
                rel = rel.resolve().relative_to(root)
            except ValueError:
                raise MegatronTestsError(f"target {t!r} is outside the checkout {root}") from None
        elif not rel.parts or rel.parts[:2] != UNIT_TESTS.parts:
            rel = UNIT_TESTS / rel
        if not (root / rel).exists():
            raise MegatronTestsError(f"target {t!r}: {root / rel} does not exist; give a file or folder under "
                                     f"{root / UNIT_TESTS}")
        out.append(str(rel) + sep + rest)
    return out


def rootless_modules(root: Path, target: str) -> list[str]:
    """Names pytest gives the test modules of ``target`` that lie in a folder without ``__init__.py``.

    pytest's default import mode imports such a file under its bare name (``test_finalize_model_grads``,
    its folder put on sys.path), not under ``tests.``: Megatron's ``distributed/`` has no
    ``__init__.py``, so its modules must be named to be framework modules too.
    """
    path = root / target.partition("::")[0]
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    names = []
    for f in files:
        is_test = f.name.startswith("test_") or f.name.endswith("_test.py") or f.name == "conftest.py"
        if is_test and not (f.parent / "__init__.py").exists() and f.stem.isidentifier():
            names.append(f.stem)
    return list(dict.fromkeys(names))


def child_env(root: Path, base: dict[str, str] | None = None, modules: list[str] = ()) -> dict[str, str]:
    """The ranks' environment: the checkout first on PYTHONPATH, ``tests`` (and ``modules``) framework
    modules, one thread."""
    env = dict(os.environ if base is None else base)
    named = [n.strip() for n in env.get(FRAMEWORK_ENV, "").split(",") if n.strip()]
    env[FRAMEWORK_ENV] = ",".join(dict.fromkeys(named + ["tests", *modules]))
    env[LATE_MODULES_ENV] = ",".join(modules)  # imported by pytest from their folders: not on sys.path yet
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(target: str, nproc: int, log_dir: Path, markers: str, pytest_args: list[str]) -> list[str]:
    """``portspeed run`` (torchrun) with rank 0 teed to the console and every rank to ``log_dir``."""
    return [sys.executable, "-m", "portspeed.cli.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "--log-dir", str(log_dir), "--redirects", "3", "--tee", "0:3",
            "-m", "pytest", "-p", "no:cacheprovider", "-p", REPORT_PLUGIN, "--maxfail", "100000",
            "--continue-on-collection-errors", "-m", markers,
            *pytest_args, target]


def parse_counts(text: str) -> dict[str, int]:
    """The counts of pytest's last summary line in ``text`` ({} when there is none)."""
    lines = [m.group(0) for m in _SUMMARY.finditer(text)]
    if not lines:
        return {}
    counts: dict[str, int] = {}
    for n, kind in _COUNT.findall(lines[-1]):
        counts["errors" if kind.startswith("error") else kind] = int(n)
    return counts


def _rank0_output(log_dir: Path) -> str:
    logs = sorted(log_dir.glob("**/0/stdout.log"))
    return logs[-1].read_text(errors="replace") if logs else ""


def _rank_reports(report_dir: Path) -> list[dict]:
    out = []
    for f in sorted(report_dir.glob("rank*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except ValueError:
            continue
    return sorted(out, key=lambda r: r.get("rank", 0))


def run_target(root: Path, target: str, args: argparse.Namespace, pytest_args: list[str], log_root: Path) -> Outcome:
    """One launch; killed (its whole process group) when it runs past ``args.timeout``."""
    log_dir = log_root / re.sub(r"[^A-Za-z0-9_.-]+", "_", target)
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = launch_command(target, args.nproc_per_node, log_dir, args.markers, pytest_args)
    print(f"portspeed megatron-tests: {target} on {args.nproc_per_node} ranks (logs: {log_dir})", flush=True)
    start = time.monotonic()
    env = child_env(root, modules=rootless_modules(root, target))
    env[REPORT_ENV] = str(log_dir / "report")
    proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    seconds = time.monotonic() - start
    outcome = Outcome(target, args.nproc_per_node, rc, round(seconds, 1), parse_counts(_rank0_output(log_dir)),
                      timed_out, str(log_dir))
    reports = _rank_reports(log_dir / "report")
    if reports and reports[0].get("rank") == 0:
        outcome.files = reports[0]["files"]
        outcome.session_seconds, outcome.collect_seconds = reports[0]["session_seconds"], reports[0]["collect_seconds"]
    outcome.failed_tests = sorted({t for r in reports for t in r.get("failed_tests", [])})
    return outcome


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 0 when every launch passed, 1 when one failed or timed out, 2 on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    try:
        root = _check_root(args.root)
        targets = resolve_targets(root, args.targets)
        _check_packages()
        if args.nproc_per_node < 1:
            raise MegatronTestsError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    except MegatronTestsError as exc:
        print(f"portspeed megatron-tests: error: {exc}", file=sys.stderr)
        return 2
    import tempfile

    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="portspeed-megatron-tests-"))
    pin_note = pytest_pin_note(root)
    if pin_note:
        print(f"portspeed megatron-tests: note: {pin_note}", file=sys.stderr)
    outcomes = [run_target(root, t, args, pytest_args, log_root) for t in targets]
    print("\nportspeed megatron-tests: summary (rank 0's counts)")
    for o in outcomes:
        print("  " + o.line())
    print(f"  total {sum(o.seconds for o in outcomes):.1f} s")
    if pin_note:
        print(f"  note: {pin_note}")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1))
    return 0 if all(o.returncode == 0 and not o.timed_out for o in outcomes) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
