"""pytest plugin (entry point ``pytest11``): fixtures to launch runs and check their losses.

Fixtures:

``portspeed_launch(script, *args, nproc=2, timeout=None, env=None, name=None, adaptor=None, probe=None) -> LossRecord``
    Runs ``script`` under ``torch.distributed.run`` with ``nproc`` ranks on 127.0.0.1 and a
    free port (``nproc=None``: one plain process; ``adaptor="megatron"`` etc.: through
    ``portspeed run --adaptor``, so an unmodified script gets the adaptor in every worker), ``OMP_NUM_THREADS=1``,
    killed after ``timeout`` seconds (default: PORTSPEED_TIMEOUT, 300). The script writes its loss record
    to ``PORTSPEED_LOSS_LOG`` (also substituted for ``{record}`` in ``args``) or prints
    Megatron iteration lines (literal braces in ``args`` are written ``{{ }}``). Logs are kept under pytest's temporary
    directory; a failed or hung run fails the test with the log's last lines and its path. ``probe=True`` (a fresh
    folder) or ``probe=DIR`` records a probe dump (``PORTSPEED_PROBE_DIR``; also read from ``env``); the
    returned record remembers where (``probe_dir``).

``assert_losses_match(actual, expected, *, atol=None, rtol=None, dtype=None, metric="lm_loss", probes=None)``
    Records or paths; fails with the comparison table when any iteration leaves the band
    (defaults from the dtype, as `portspeed compare`). Where both runs were probed (``probe_dir``
    of a launched record, or ``meta["probe_dir"]``), the failure starts with `compare --probe`'s
    first-divergence line; ``probes=True`` also fails when the losses agree but the probes do not
    (a wrong shard can move the loss by less than its band).

``loss_golden(record, path, **tolerance)``
    Compares ``record`` to a golden file (relative paths are relative to the test file;
    ``{backend}``, ``{accelerator}``, ``{dtype}`` are filled from the record's meta, so one
    golden per backend). ``pytest --update-golden`` rewrites the golden file instead, on
    purpose, and the terminal summary lists what was rewritten.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import pytest

if TYPE_CHECKING:  # keep pytest start-up free of portspeed's heavier modules
    from portspeed.parity.losslog import LossRecord
    from portspeed.parity.tolerance import Comparison

__all__ = ["portspeed_launch", "assert_losses_match", "loss_golden", "probe_dir"]

_UPDATED = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("portspeed")
    group.addoption("--update-golden", action="store_true", default=False,
                    help="rewrite portspeed golden loss files instead of comparing against them")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_UPDATED] = []


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    updated = config.stash.get(_UPDATED, [])
    if updated:
        terminalreporter.write_sep("-", f"portspeed: rewrote {len(updated)} golden loss file(s)")
        for p in updated:
            terminalreporter.write_line(f"  {p}")


def _as_record(x: "LossRecord | str | os.PathLike[str]") -> "LossRecord":
    from portspeed.parity.losslog import LossRecord, read_record
    return x if isinstance(x, LossRecord) else read_record(x)


def _check(actual: Any, expected: Any, atol: float | None, rtol: float | None, dtype: str | None,
           metric: str, what: str, probes: bool | None = None) -> "Comparison":
    __tracebackhide__ = True
    from portspeed.parity.compare import format_table
    from portspeed.parity.tolerance import compare, pick_tolerance
    exp, act = _as_record(expected), _as_record(actual)
    tol, origin = pick_tolerance([exp, act], dtype, atol, rtol)
    result = compare(exp, act, tol, metric)
    if not result.ok:
        line = _probe_line(exp, act)
        raise AssertionError((f"{line[1]}\n" if line else "") + f"losses do not match {what}:\n"
                             + format_table([result], tol, origin, limit=40))
    if probes:
        line = _probe_line(exp, act)
        if line is None:
            raise AssertionError("assert_losses_match(probes=True): neither run was probed; launch them with "
                                 "portspeed_launch(..., probe=True)")
        if not line[0]:
            raise AssertionError(f"losses match {what}, the probes do not:\n{line[1]}")
    return result


def probe_dir(record: "LossRecord") -> str | None:
    """Where a run's probe dump is: set by portspeed_launch, or the record's ``meta["probe_dir"]``."""
    return getattr(record, "probe_dir", None) or record.meta.get("probe_dir")


def _probe_line(exp: "LossRecord", act: "LossRecord") -> tuple[bool, str] | None:
    """(the probes agree, the first line of `compare --probe`), or None when neither run was probed."""
    a, b = probe_dir(exp), probe_dir(act)
    if not (a or b):
        return None
    if not (a and b):
        return False, (f"probe: only the {'expected' if a else 'actual'} run was probed ({a or b}); probe both to "
                       "name where they part")
    from portspeed.errors import PortspeedError
    from portspeed.probe.reading.compare import compare_dumps, first_line
    try:
        report = compare_dumps(a, b)
    except PortspeedError as e:
        return False, f"probe: the dumps cannot be compared: {e}"
    return report.exit_code == 0, first_line(report)


@pytest.fixture
def assert_losses_match() -> Callable[..., "Comparison"]:
    """A function asserting that a run's losses match an expected record within tolerance."""

    def check(actual: Any, expected: Any, *, atol: float | None = None, rtol: float | None = None,
              dtype: str | None = None, metric: str = "lm_loss", probes: bool | None = None) -> "Comparison":
        __tracebackhide__ = True
        return _check(actual, expected, atol, rtol, dtype, metric, "the expected run", probes)

    return check


@pytest.fixture
def loss_golden(request: pytest.FixtureRequest) -> Callable[..., None]:
    """A function comparing a record to a golden file, or rewriting it under --update-golden."""
    update = request.config.getoption("--update-golden")

    def golden(record: Any, path: str | os.PathLike[str], *, atol: float | None = None,
               rtol: float | None = None, dtype: str | None = None, metric: str = "lm_loss") -> None:
        __tracebackhide__ = True
        from portspeed.parity.losslog import write_record
        rec = _as_record(record)
        target = _golden_path(str(path), rec.meta, Path(request.node.path).parent)
        if update:
            write_record(rec, target)
            request.config.stash[_UPDATED].append(str(target))
            return
        if not target.exists():
            pytest.fail(f"golden loss file {target} does not exist; create it on purpose with "
                        "`pytest --update-golden` and commit it", pytrace=False)
        _check(rec, target, atol, rtol, dtype, metric, f"golden file {target} (rewrite with --update-golden)")

    return golden


def _golden_path(template: str, meta: Mapping[str, Any], base: Path) -> Path:
    fields = {k: meta.get(k) for k in ("backend", "accelerator", "dtype", "name")}
    try:
        filled = template.format_map({k: v for k, v in fields.items() if v is not None})
    except KeyError as e:
        raise pytest.UsageError(
            f"loss_golden path {template!r} uses {{{e.args[0]}}} but the record's meta has no "
            f"{e.args[0]!r}; write it into the record's meta or use a fixed path") from None
    p = Path(filled)
    return p if p.is_absolute() else base / p


@pytest.fixture
def portspeed_launch(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., "LossRecord"]:
    """A function launching an N-rank torchrun run of a script and returning its loss record."""
    from portspeed.config import settings

    default_timeout = settings().timeout
    counter = [0]

    def launch(script: str | os.PathLike[str], *args: Any, nproc: int | None = 2, timeout: float | None = None,
               env: Mapping[str, str] | None = None, name: str | None = None,
               adaptor: str | None = None, probe: bool | str | os.PathLike[str] | None = None) -> "LossRecord":
        __tracebackhide__ = True
        from portspeed.parity.runspec import RunFailedError, RunSpec, run_one
        if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
            raise pytest.UsageError(f"portspeed_launch(nproc={nproc!r}): give a positive number of ranks or None")
        if not Path(script).is_file():
            raise pytest.UsageError(f"portspeed_launch: script {script} does not exist")
        counter[0] += 1
        run_name = name or f"{Path(script).stem}-{counter[0]}"
        if adaptor is not None and nproc is None:
            raise pytest.UsageError("portspeed_launch(adaptor=...) goes through `portspeed run`; give nproc too")
        if nproc is None:
            cmd = ["{python}", str(script)]
        else:
            launcher = ["-m", "torch.distributed.run"] if adaptor is None else \
                ["-m", "portspeed.cli", "run", "--adaptor", adaptor]
            cmd = ["{python}", *launcher, "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", "{port}", str(script)]
        cmd += [str(a) for a in args]
        full_env = {"OMP_NUM_THREADS": "1", **dict(env or {})}
        workdir = tmp_path_factory.mktemp("portspeed-launch", numbered=True)
        if probe:
            full_env["PORTSPEED_PROBE_DIR"] = str(workdir / "probe" if probe is True else Path(probe).resolve())
        run = RunSpec(run_name, cmd, full_env, {}, float(timeout or default_timeout), None, None)
        try:
            rec = run_one(run, workdir)
        except RunFailedError as e:
            pytest.fail(f"portspeed_launch: {e}\n(logs kept in {workdir})", pytrace=False)
        if full_env.get("PORTSPEED_PROBE_DIR"):
            rec.probe_dir = full_env["PORTSPEED_PROBE_DIR"]  # type: ignore[union-attr]  (not in the record's JSON)
        return rec

    return launch

