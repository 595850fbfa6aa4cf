"""Many short jobs that end without tearing down their process groups, to count aborts at interpreter exit.

Why: a rank that finished its work and then died at exit (``terminate called without an active
exception``, SIGABRT) was seen about once per few hundred processes, in CI only. One process cannot
show a fault that rare; a thousand can. Python, torch and portspeed are imported once here, then each
job is a forked child that runs a short job the suite runs (one process with a world of 1, or two
ranks on 127.0.0.1) and leaves through the interpreter's normal exit, as a script does; what its
exit does is what is counted. A child that aborts leaves a core file, read by gdb into the native
backtrace of every thread (``abort_<n>.txt`` in ``--out``).

    python tests/helpers/exit_stress.py --runs 1000 --out /tmp/exit-stress        # make stress-exit
    python tests/helpers/exit_stress.py --runs 50 --cases gloo-two --no-portspeed   # the bare torch control

Cases (``--cases``, comma-separated; each run takes the next in turn):
``gloo-one``   the CPU adapter's Gloo, world 1: blocking and asynchronous collectives, one never waited;
``gloo-two``   the same with two ranks;
``held-two``   the same on a group the job keeps a reference to (as DeepSpeed keeps its own groups);
``testdev-one`` / ``testdev-two``  the test device and its CCL (testccl, staged through Gloo);
``acme-one``   the one-file vendor adapter (examples/vendor_adapter.py) with the portable TE's ring
               attention and grouped GEMM: the launch that aborted in CI.
``--no-portspeed`` runs the same jobs with torch alone (no adaptor, so no exit handling of
portspeed's): the control that shows the abort is torch's teardown order, not portspeed's code.
Exit status: 0 when no child failed, 1 otherwise. By hand only (tests/test_exit.py runs 50).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from portspeed.testing import cores, free_port

__all__ = ["CASES", "main", "run_case"]

_REPO = Path(__file__).resolve().parents[2]
#: elements of the last, never-waited all_reduce (8M float32: without portspeed's exit teardown about one
#: rank in six of ``gloo-two`` aborted on the 2-core machine)
DROPPED_NUMEL = 8 * 1024 * 1024
_ACME = _REPO / "examples" / "vendor_adapter.py"


#: groups held by the job itself, as DeepSpeed holds its own: destroying the registered groups at exit does not
#: stop their backend threads (torch stops them when the last reference goes)
_HELD: list = []


def _collectives(device: str, held: bool = False) -> None:
    """What the suite's short jobs do: blocking and asynchronous collectives, the last one never waited; with
    ``held``, on a group of every rank that the job keeps a reference to."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    group = None
    if held:
        group = dist.new_group(list(range(world)))
        _HELD.append(group)
    x = torch.ones(64, device=device)
    dist.all_reduce(x, group=group)
    out = torch.empty(64 * world, device=device)
    dist.all_gather_into_tensor(out, x, group=group)
    work = dist.all_reduce(torch.ones(1024, device=device), async_op=True, group=group)
    work.wait()
    dist.broadcast(torch.zeros(8, device=device), src=0, group=group)
    # dropped: its Work is never waited, so the backend's thread may still be finishing it (and freeing its
    # 32 MB input) while the interpreter exits; the window the abort needs, made wide
    dist.all_reduce(torch.ones(DROPPED_NUMEL, device=device), async_op=True, group=group)


def _acme_job() -> None:
    """tests/test_vendor_example.py's child: the vendor adapter's kernels through the portable TE."""
    import torch
    import torch.distributed as dist

    from portspeed.portable_te.grouped import GroupedLinear
    from portspeed.portable_te.ring import ring_attention

    dev = _device()
    q, k, v = (torch.randn(1, 2, 8, 16, device=dev, requires_grad=True) for _ in range(3))
    ring_attention(q, k, v, dist.group.WORLD, causal=True, scale=0.25).sum().backward()
    experts = GroupedLinear(4, 8, 6, bias=False, params_dtype=torch.float32, device=dev,
                            init_method=torch.nn.init.normal_)
    experts(torch.randn(10, 8, device=dev, requires_grad=True), [3, 0, 4, 3]).sum().backward()


def _device() -> str:
    if os.environ.get("PORTSPEED_ACCELERATOR", "cpu") == "cpu":
        return "cpu"
    import portspeed

    return str(portspeed.get_accelerator().device(0))


#: case -> (PORTSPEED_ACCELERATOR, world size, job)
CASES: dict[str, tuple[str, int, Callable[[], None]]] = {
    "gloo-one": ("cpu", 1, lambda: _collectives("cpu")),
    "gloo-two": ("cpu", 2, lambda: _collectives("cpu")),
    "held-two": ("cpu", 2, lambda: _collectives("cpu", held=True)),
    "testdev-one": ("testdev", 1, lambda: _collectives(_device())),
    "testdev-two": ("testdev", 2, lambda: _collectives(_device())),
    "acme-one": (f"{_ACME}:AcmeAccelerator", 1, _acme_job),
}


def run_case(case: str, rank: int, port: int, use_portspeed: bool) -> None:
    """One rank of one job, in this (forked) process; returns to leave through the interpreter's exit."""
    import torch.distributed as dist

    accel, world, job = CASES[case]
    os.environ["PORTSPEED_ACCELERATOR"] = accel
    import portspeed

    if use_portspeed:
        import portspeed.megatron_adaptor

        portspeed.megatron_adaptor.activate()  # what a Megatron job gets: the torch.distributed patches
    else:
        _without_teardown()  # the control; selecting the adapter below loads the device and its CCL only
    backend = portspeed.get_accelerator().communication_backend
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    job()


def _without_teardown() -> None:
    """The control: leave through exit as torch alone does (``import portspeed`` registered the teardown)."""
    import atexit

    teardown = sys.modules.get("portspeed.teardown")
    if teardown is not None:
        atexit.unregister(teardown.destroy_leftover_groups)


def _child(case: str, rank: int, port: int, use_portspeed: bool, folder: Path) -> None:
    os.chdir(folder)  # the core file (kernel.core_pattern 'core') lands here
    cores.enable_cores()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    err = os.open(folder / f"stderr_{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    run_case(case, rank, port, use_portspeed)


def _wait(pids: dict[int, int], bound: float) -> dict[int, int]:
    """rank -> wait status of every pid; kill what is left at ``bound`` seconds (status -9)."""
    end = time.monotonic() + bound
    status: dict[int, int] = {}
    while len(status) < len(pids):
        for rank, pid in pids.items():
            if rank in status:
                continue
            got, st = os.waitpid(pid, os.WNOHANG)
            if got:
                status[rank] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
        if time.monotonic() > end:
            for rank, pid in pids.items():
                if rank not in status:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status[rank] = -9
        time.sleep(0.01)
    return status


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python tests/helpers/exit_stress.py", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=1000, help="jobs to run (default 1000)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--out", type=Path, default=Path("/tmp/portspeed-exit-stress"), help="backtraces and logs")
    p.add_argument("--no-portspeed", action="store_true", help="torch alone: the control")
    p.add_argument("--keep-backtraces", type=int, default=5, help="abort backtraces to keep (default 5)")
    p.add_argument("--bound", type=float, default=120.0, help="seconds before a job is killed (default 120)")
    args = p.parse_args(argv)
    args.case_list = [c for c in args.cases.split(",") if c]
    bad = [c for c in args.case_list if c not in CASES]
    if bad or not args.case_list or args.runs < 1:
        p.error(f"--cases: unknown {', '.join(bad)} (known: {', '.join(CASES)})" if bad or not args.case_list
                else "--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int | None:
    """Run the jobs; print one line per failure and a closing count. None in a child (it leaves through exit)."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    import torch  # noqa: F401 - paid once, before the first fork
    import torch.distributed  # noqa: F401

    if not args.no_portspeed:
        import portspeed  # noqa: F401

    args.out.mkdir(parents=True, exist_ok=True)
    failed: dict[str, int] = {}
    kept = 0
    start = time.monotonic()
    for n in range(args.runs):
        case = args.case_list[n % len(args.case_list)]
        world = CASES[case][1]
        folder = args.out / f"run_{n}"
        folder.mkdir(exist_ok=True)
        port = free_port()
        pids: dict[int, int] = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _child(case, rank, port, not args.no_portspeed, folder)
                return None
            pids[rank] = pid
        status = _wait(pids, args.bound)
        bad = {r: s for r, s in status.items() if s != 0}
        if bad:
            failed[case] = failed.get(case, 0) + 1
            print(f"run {n} ({case}): exit status {bad}", flush=True)
            core = folder / "core"
            if core.exists() and kept < args.keep_backtraces and -signal.SIGABRT in bad.values():
                (args.out / f"abort_{n}.txt").write_text(
                    "".join((folder / f"stderr_{r}").read_text() for r in status) + cores.native_backtrace(core))
                kept += 1
            if core.exists():
                core.unlink()
            shutil.copytree(folder, args.out / f"failed_{n}", dirs_exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    total = sum(failed.values())
    per = ", ".join(f"{c} {k}" for c, k in failed.items()) or "none"
    print(f"exit stress: {args.runs} jobs ({', '.join(args.case_list)}), {total} failed ({per}), "
          f"{time.monotonic() - start:.0f} s{'; torch alone' if args.no_portspeed else ''}; backtraces in {args.out}")
    return 1 if total else 0


if __name__ == "__main__":
    code = main()
    if code is not None:
        sys.exit(code)
