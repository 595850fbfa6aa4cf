"""The warm Python (portspeed/testing/warm) against a fresh interpreter: the same child, both ways, must end alike.

Why: every multi-rank test of the suite runs its processes forked from the warm servers, so a difference from a
fresh process is a difference in what the tests prove. Each case below was a real difference once (2026-11-29):
a leak report printed at exit, a ``sitecustomize`` on the child's PYTHONPATH not run, ``sys.last_value`` unset
after an uncaught exception (portspeed's exit teardown reads it). Each snippet runs cold and warm, and the two
runs must give the same exit status, stdout and stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import launch



@pytest.fixture(autouse=True)
def _warm_session(request: pytest.FixtureRequest) -> None:
    if request.config.getoption("--cold-python"):
        pytest.skip("--cold-python: this session forks no child from a warm Python, so there is nothing to compare")


def _both(code: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, ...]:
    """(cold, warm) runs of ``python -c code``; the warm one is checked to have been forked, not started cold."""
    warm, extra = launch.python_for_children()
    if warm == sys.executable:
        pytest.fail("the session's warm Python is not running: tests/conftest.py starts it for every session")
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    runs = []
    for python in (sys.executable, warm):
        runs.append(subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                                   env={**base, **extra} if python == warm else base, cwd=launch.REPO))
    log = launch.WARM.log.read_text(errors="replace").splitlines()
    last = [ln for ln in log if ln.startswith("warm python: ") and "-c" in ln][-1]
    assert last.startswith("warm python: warm:"), last
    return tuple(runs)


def _same(cold: subprocess.CompletedProcess, warm: subprocess.CompletedProcess) -> None:
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr), \
        f"cold: {cold.returncode} {cold.stdout!r} {cold.stderr[-1500:]!r}\nwarm: {warm.returncode} {warm.stdout!r} " \
        f"{warm.stderr[-1500:]!r}"


def test_a_clean_exit_prints_nothing_more() -> None:
    """torch._dynamo imports Triton where it is installed (leg 2): frozen, its nanobind objects were reported as
    leaked at every warm child's exit."""
    _same(*_both("import torch._dynamo, torch.distributed; print('done')"))


def test_an_uncaught_exception_ends_alike_and_sets_last_value() -> None:
    code = '''
        import atexit, sys
        atexit.register(lambda: print("last_value at exit:", repr(getattr(sys, "last_value", None))))
        def fail():
            raise ValueError("planted")
        fail()
    '''
    cold, warm = _both(code)
    assert cold.returncode == 1 and "last_value at exit: ValueError('planted')" in cold.stdout, cold.stdout
    _same(cold, warm)


def test_a_sitecustomize_on_the_childs_pythonpath_runs_first(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_RAN = __file__\n")
    cold, warm = _both("import builtins, sys; print(builtins.SITE_RAN, sys.path[0] == '')",
                       env={"PYTHONPATH": str(tmp_path)})
    assert cold.returncode == 0 and cold.stdout.startswith(str(tmp_path)), cold.stderr[-2000:]
    _same(cold, warm)


def test_exit_status_and_signals_are_mirrored() -> None:
    _same(*_both("import sys; sys.exit(7)"))
    _same(*_both("import os, signal; os.kill(os.getpid(), signal.SIGTERM)"))
