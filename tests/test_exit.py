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
    """32 jobs, 56 processes: two ranks on Gloo, two on a Gloo group the job itself holds (as DeepSpeed holds its
    own: 8 of 30 such jobs aborted before the exit waited for the works in flight), two on the test device's
    testccl, and the one-process vendor adapter launch that aborted in CI; each leaves through the interpreter's
    exit without destroy_process_group."""
    res = run_python([str(REPO / "tests" / "helpers" / "exit_stress.py"), "--runs", "32", "--cases",
                      "gloo-two,held-two,testdev-two,acme-one", "--out", str(tmp_path)], timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "32 jobs (gloo-two, held-two, testdev-two, acme-one), 0 failed" in res.stdout, res.stdout[-2000:]


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


def test_leftover_groups_are_destroyed_at_the_interpreters_own_exit() -> None:
    """At the real exit, not called by hand: Python 3.12 refuses new threads once shutdown has begun, atexit
    included, so the handler works on the exiting thread (leg 2 runs this on 3.12, leg 1 on 3.11)."""
    res = run_snippet('''
        import atexit, datetime, sys
        import torch, torch.distributed as dist
        atexit.register(lambda: print("left at exit:", dist.is_initialized(), flush=True))  # runs after portspeed's
        import portspeed
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        dist.all_reduce(torch.ones(4))
    ''', timeout=300)
    assert res.returncode == 0 and "left at exit: False" in res.stdout, res.stdout[-1000:] + res.stderr[-2000:]
    assert "Exception ignored" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_a_group_still_busy_at_exit_ends_the_process_after_the_bound_with_its_stack() -> None:
    """Rank 0 leaves a collective rank 1 never joins: the exit waits at most the bound (3 s here), then prints the
    stacks, the handler's frame named, and exits 1, rather than hanging or reporting a clean exit."""
    res = run_snippet('''
        import atexit, datetime, os, sys, time
        import torch, torch.distributed as dist
        import portspeed
        from portspeed import teardown
        from portspeed.testing import free_port
        port = free_port()
        rank = 0 if os.fork() else 1
        if rank == 1:  # a peer that stays alive and never joins; its streams closed so the launcher does not wait
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        dist.barrier()
        if rank == 1:
            time.sleep(15)
            os._exit(0)
        dist.all_reduce(torch.ones(4), async_op=True)
        atexit.unregister(teardown.destroy_leftover_groups)
        atexit.register(teardown.destroy_leftover_groups, 3.0)
        print("rank 0 done", flush=True)
    ''', timeout=300)
    assert res.returncode == 1 and "rank 0 done" in res.stdout, res.stdout[-1000:] + res.stderr[-2000:]
    assert "Timeout (0:00:03)!" in res.stderr and "teardown.py" in res.stderr, res.stderr[-2000:]
