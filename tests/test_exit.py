"""A job that finished its work exits 0: the groups a script leaves are torn down at exit (portspeed.teardown).

The abort this guards against (docs/reliability.md, "The abort at exit") needs a backend thread to finish a
collective while the interpreter finalizes, so one process rarely shows it; the exit stress
(tests/helpers/exit_stress.py, ``make stress-exit`` for the thousand by hand) makes the window wide: every
job drops an 8M-element asynchronous all_reduce just before it leaves. Without the teardown (``--no-portspeed``,
by hand) about 6 ``gloo-two`` jobs in 10 aborted on the 2-core machine; here 50 exits must all be clean.
A child that does abort carries every thread's native backtrace (portspeed.testing.cores), checked below.
"""

from __future__ import annotations

import pytest

from helpers.launch import REPO, child_json, run_python, run_snippet

pytestmark = pytest.mark.multiproc


@pytest.mark.testdev
def test_fifty_exits_leave_no_abort(tmp_path) -> None:
    """30 jobs, 50 processes: two ranks on Gloo, two on the test device's testccl, and the one-process vendor
    adapter launch that aborted in CI; each leaves through the interpreter's exit without destroy_process_group."""
    res = run_python([str(REPO / "tests" / "helpers" / "exit_stress.py"), "--runs", "30", "--cases",
                      "gloo-two,testdev-two,acme-one", "--out", str(tmp_path)], timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "30 jobs (gloo-two, testdev-two, acme-one), 0 failed" in res.stdout, res.stdout[-2000:]


def test_an_aborted_child_carries_every_threads_native_backtrace() -> None:
    """The launchers' core capture: a child that aborts (here on purpose, with a second thread waiting) has its
    threads' native stacks read from its core file by gdb, so a CI failure names the thread that aborted."""
    res = run_snippet('''
        import os, threading
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        os.abort()
    ''', timeout=300)
    assert res.returncode == -6, res.stderr[-2000:]
    assert "thread apply all bt" not in res.native and "Thread 2" in res.native and "abort" in res.native, \
        res.native[-3000:]


def test_exit_teardown_is_installed_by_import_and_leaves_failing_ranks_alone() -> None:
    """``import portspeed`` registers the handler once; it destroys leftover groups, and not when the process ends
    on an uncaught exception (a failing rank's peers may never join its pending collective)."""
    got = child_json('''
        import atexit, datetime, json, sys
        import torch, torch.distributed as dist
        before = atexit._ncallbacks()
        import portspeed
        from portspeed import teardown
        teardown.install()
        registered = atexit._ncallbacks() - before
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        dist.all_reduce(torch.ones(4))
        sys.last_value = ValueError("failing")
        kept = teardown.destroy_leftover_groups()
        del sys.last_value
        destroyed = teardown.destroy_leftover_groups()
        print(json.dumps({"registered": registered, "kept": kept, "destroyed": destroyed,
                          "left": dist.is_initialized()}))
    ''', timeout=300)
    assert got == {"registered": 1, "kept": False, "destroyed": True, "left": False}
