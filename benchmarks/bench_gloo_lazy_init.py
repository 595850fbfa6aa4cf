"""A/B: Megatron's process-group set-up on Gloo with groups connected eagerly vs lazily (portspeed's default).

Why: Megatron's ``initialize_model_parallel`` creates dozens of groups; an eager Gloo group
connects all pairs of its members before ``new_group`` returns. portspeed creates Gloo
groups with torch's lazy initialisation (``portspeed.comm.gloo_init``), so a pair connects
at its first collective. This measures what that changes, with the arms alternating in
one run (``PORTSPEED_GLOO_LAZY_INIT=0`` eager, ``=1`` lazy; a third arm, lazy with the patch
``megatron.core.parallel_state.destroy_host_groups`` disabled, shows what leaving Megatron's
dropped groups alive costs) so load from other jobs hits every arm:

- ``init``: ``init_process_group("nccl")`` (routed to Gloo) on every rank;
- ``mp``: ``initialize_model_parallel(tp, pp)`` (all of Megatron's groups);
- ``first``: the first all_reduce on the TP, PP and DP groups and a world barrier (where a
  lazy group pays its connections);
- ``again``: ``destroy_model_parallel`` then ``initialize_model_parallel`` again in another
  order, as Megatron's unit tests do between tests;
- ``reinitN``: N more initialize / first all_reduce / destroy cycles (a unit-test file's pattern);
  then ``threads`` per rank and ``idle_cpu_s_per_s``, CPU seconds a rank burns per second while idle;

each the slowest rank's time, median over ``--repeats`` launches per arm; plus each launch's
wall time (start-up included). With ``--megatron-test NODEID`` (and MEGATRON_LM_ROOT), each
arm also runs that Megatron unit test through ``portspeed megatron-tests`` and reports its
launch's wall time and pytest's session time.

    python benchmarks/bench_gloo_lazy_init.py --world 8 --tp 2 --pp 2 --repeats 2 \\
        --megatron-test "test_parallel_state.py::test_virtual_pipeline_model_parallel_rank"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads")).split()[1])


def _worker(tp: int, pp: int, reinit: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    dist.init_process_group("nccl")
    times["init"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ps.initialize_model_parallel(tp, pp)
    times["mp"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    x = torch.ones(16)
    for g in (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
              ps.get_data_parallel_group()):
        dist.all_reduce(x, group=g)
    dist.barrier()
    times["first"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, order="tp-pp-dp")
    dist.barrier()
    times["again"] = time.perf_counter() - t0
    ps.destroy_model_parallel()
    t0 = time.perf_counter()
    for i in range(reinit):  # what a unit-test file does: re-initialise for (almost) every test
        ps.initialize_model_parallel(tp, pp)
        dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
        ps.destroy_model_parallel()
    dist.barrier()
    times[f"reinit{reinit}"] = time.perf_counter() - t0
    times["threads"] = float(_threads())
    c0 = time.process_time()
    time.sleep(2.0)
    times["idle_cpu_s_per_s"] = (time.process_time() - c0) / 2.0
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({k: max(t[k] for t in gathered) for k in times}))
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: arm -> (lazy Gloo groups, destroy_model_parallel destroys the Gloo groups it drops)
ARMS = {"eager": (False, True), "lazy": (True, True), "lazy_no_teardown": (True, False)}
TEARDOWN_PATCH = "megatron.core.parallel_state.destroy_host_groups"


def _launch(world: int, tp: int, pp: int, reinit: int, arm: str) -> dict[str, float]:
    lazy, teardown = ARMS[arm]
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PORTSPEED_GLOO_LAZY_INIT="1" if lazy else "0",
               PORTSPEED_ACCELERATOR="cpu")
    if not teardown:
        env["PORTSPEED_DISABLE"] = TEARDOWN_PATCH
    env.pop("TORCH_GLOO_LAZY_INIT", None)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "portspeed.cli", "run", "--nproc-per-node", str(world),
                    "--master-port", str(_free_port()), __file__, "--worker", "--tp", str(tp), "--pp", str(pp),
                    "--reinit", str(reinit), "--out", out],
                   env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    got = json.loads(Path(out).read_text())
    got["wall"] = time.perf_counter() - t0
    os.unlink(out)
    return got


def _unit_test(nodeid: str, world: int, arm: str) -> dict[str, float]:
    lazy, teardown = ARMS[arm]
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, PORTSPEED_GLOO_LAZY_INIT="1" if lazy else "0")
        if not teardown:
            env["PORTSPEED_DISABLE"] = TEARDOWN_PATCH
        env.pop("TORCH_GLOO_LAZY_INIT", None)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "portspeed.cli", "megatron-tests", "--nproc-per-node", str(world),
                        "--timeout", "1200", "--log-dir", d, "--json", f"{d}/o.json", nodeid],
                       env=env, timeout=1300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        [o] = json.loads(Path(f"{d}/o.json").read_text())
        return {"test_wall": wall, "test_session": o["session_seconds"] or float("nan"),
                "test_ok": float(o["returncode"] == 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--reinit", type=int, default=10, help="initialize/destroy cycles timed after the first")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--megatron-test", default=None, metavar="NODEID")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.tp, args.pp, args.reinit, args.out)
        return
    if args.megatron_test and not os.environ.get("MEGATRON_LM_ROOT"):
        raise SystemExit("--megatron-test needs MEGATRON_LM_ROOT (a Megatron-LM checkout)")
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    arms: dict[str, list[dict[str, float]]] = {a: [] for a in names}
    for i in range(args.repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            got = _launch(args.world, args.tp, args.pp, args.reinit, name)
            if args.megatron_test:
                got.update(_unit_test(args.megatron_test, args.world, name))
            got["load1"] = os.getloadavg()[0]
            arms[name].append(got)
            print(name, {k: round(v, 3) for k, v in got.items()}, flush=True)
    print(f"\nworld {args.world}, tp {args.tp}, pp {args.pp}, {args.repeats} launch(es) per arm; "
          "slowest rank, median [min..max], seconds")
    base = names[0]
    for key in arms[base][0]:
        cells = []
        for name in names:
            v = [r[key] for r in arms[name]]
            m = statistics.median(v)
            ref = statistics.median([r[key] for r in arms[base]])
            ratio = f" ({m / ref:.2f}x)" if name != base and ref else ""
            cells.append(f"{name} {m:9.3f} [{min(v):.3f}..{max(v):.3f}]{ratio}")
        print(f"  {key:<17} " + "   ".join(cells))


if __name__ == "__main__":
    main()
