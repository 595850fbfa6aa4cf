"""Link bandwidth of the conformance kit: each collective's algorithm and bus bandwidth by message and group size.

Why: `portspeed compare --perf` shows what a run's collectives achieved; whether that is slow needs what the
same link does with nothing else running. This suite measures it as nccl-tests does, on the adapter's CCL
through portspeed's router with ``"nccl"`` requested (the path Megatron's calls take): for all_reduce,
all_gather (``all_gather_into_tensor``), reduce_scatter (``reduce_scatter_tensor``), broadcast and all_to_all
(``all_to_all_single``), on groups of 2, 4, ... up to ``--nproc`` ranks, at message sizes from ``LO`` to ``HI``
(x4 steps; ``--bandwidth-bytes``, default 1 KiB to 64 MiB, to 1 MiB where the device is the host), float32.
Each size: ``WARMUP`` calls, then ``ITERATIONS`` calls between two synchronizations of the device; the time
is the slowest rank's mean per call; ``bytes`` is the largest buffer (as nccl-tests and the recording count);
``algbw = bytes / time``, ``busbw = algbw x`` nccl-tests' factor (``perf.reading.links.bus_factor``).

Rank 0 prints ``RESULTS <json>``; ``run_bandwidth_checks`` adds one check per row and writes the rows into the
link bandwidth table (``perf.reading.links``: one entry per adapter, backend and host) that `compare --perf`
reads. The ranks all run on this host (127.0.0.1): the table describes this host's link, not a network.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import sys
import time
from typing import Any, Callable

from portspeed.conformance.report import Report
from portspeed.errors import PortspeedError
from portspeed.perf.reading import links as perf_links

__all__ = ["parse_bytes", "rank_main", "run_bandwidth_checks", "sizes"]

SUITE = "bandwidth"
WARMUP, ITERATIONS = 5, 20
KIB = 1024
#: default message sizes: (lowest, highest) on a device, and where the device is the host
DEFAULT_BYTES, HOST_BYTES = (KIB, 64 * KIB * KIB), (KIB, KIB * KIB)
_UNITS = {"": 1, "K": KIB, "M": KIB ** 2, "G": KIB ** 3}
_SIZE = re.compile(r"^([0-9]+)([KMG]?)(?:I?B)?$")


def parse_bytes(text: str) -> tuple[int, int]:
    """``LO:HI`` with optional K/M/G (binary) suffixes; ValueError naming what is wrong."""
    got = [_SIZE.match(part.strip().upper()) for part in text.split(":")]
    if len(got) != 2 or not all(got):
        raise ValueError(f"--bandwidth-bytes {text!r} is not LO:HI; give two sizes in bytes, each with an optional K, "
                         "M or G (binary), e.g. 1K:64M")
    lo, hi = (int(m.group(1)) * _UNITS[m.group(2)] for m in got if m)
    if not 4 <= lo <= hi:
        raise ValueError(f"--bandwidth-bytes {text!r}: LO must be at least 4 bytes (one float32) and at most HI")
    return lo, hi


def sizes(lo: int, hi: int) -> list[int]:
    """LO, 4 LO, 16 LO, ... up to HI, and HI itself."""
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= 4
    return [*out, hi]


def _groups(n: int) -> list[int]:
    """The group sizes measured: 2, 4, 8, ... below ``n``, and ``n``."""
    out, g = [], 2
    while g < n:
        out.append(g)
        g *= 2
    return [*out, n]


def _calls(op: str, nbytes: int, g: int, group: Any, src: int, dev: Any) -> tuple[Callable[[], Any], int]:
    """The call that moves ``nbytes`` (its largest buffer) with ``op`` on ``group``, and the bytes it really moves."""
    import torch
    import torch.distributed as dist

    n = max(g, nbytes // 4 // g * g)  # float32 elements of the largest buffer, a multiple of the group size
    big, part = torch.ones(n, device=dev), torch.ones(n // g, device=dev)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(big, group=group)), n * 4
    if op == "all_gather":
        return (lambda: dist.all_gather_into_tensor(big, part, group=group)), n * 4
    if op == "reduce_scatter":
        return (lambda: dist.reduce_scatter_tensor(part, big, group=group)), n * 4
    if op == "broadcast":
        return (lambda: dist.broadcast(big, src=src, group=group)), n * 4
    out = torch.empty_like(big)
    return (lambda: dist.all_to_all_single(out, big, group=group)), n * 4


def _measure(acc: Any, lo: int, hi: int, rank: int, world: int) -> list[dict[str, Any]]:
    """Every (op, group size, message size) row; every rank takes part, rank 0 keeps the rows."""
    import torch
    import torch.distributed as dist

    dev, rows = acc.device(), []
    for g in _groups(world):
        ranks = list(range(g))
        group = dist.new_group(ranks)  # every rank makes every group, as torch requires
        if rank < g:
            for op in perf_links.FAMILIES:
                for size in sizes(lo, hi):
                    call, moved = _calls(op, size, g, group, ranks[0], dev)
                    for _ in range(WARMUP):
                        call()
                    acc.synchronize()
                    dist.barrier(group=group)
                    acc.synchronize()  # the barrier's own work done: the clock starts with an idle device
                    t0 = time.perf_counter()
                    for _ in range(ITERATIONS):
                        call()
                    acc.synchronize()
                    took = torch.tensor([(time.perf_counter() - t0) / ITERATIONS], device=dev)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time
                    t = float(took.item())
                    algbw = moved / t / 1e9 if t > 0 else 0.0
                    rows.append({"op": op, "ranks": g, "bytes": moved, "dtype": "float32", "time_us": round(t * 1e6, 3),
                                 "algbw_gbs": round(algbw, 6),
                                 "busbw_gbs": round(algbw * perf_links.bus_factor(op, g), 6)})
        dist.barrier()
    return rows


def rank_main(argv: list[str] | None = None) -> int:
    """One rank of the measurement; rank 0 prints ``RESULTS <json>`` (run by ``run_bandwidth_checks``)."""
    p = argparse.ArgumentParser(prog="python -m portspeed.conformance.bandwidth")
    p.add_argument("--bytes", required=True, type=parse_bytes, help="LO:HI message sizes")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    import portspeed
    from portspeed import comm
    from portspeed.accelerator.declarations import groups_backend
    from portspeed.integrations.patch_sets import load

    acc = portspeed.get_accelerator()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    acc.set_device(rank)
    if groups_backend(acc) == "staged":  # portspeed's own backend: registered for the device
        from portspeed.comm import staged

        staged.register(acc.device_type)
    manager = portspeed.PatchManager()
    manager.register(load("torch_distributed"))
    manager.apply()
    dist.init_process_group(backend="nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    rows = _measure(acc, *args.bytes, rank, world)
    link = {"adapter": acc.name, "device_type": acc.device_type, "backend": comm.real_backend(),
            "host": socket.gethostname(), "torch": torch.__version__.split("+")[0],
            "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "warmup": WARMUP, "iterations": ITERATIONS, "rows": rows}
    dist.destroy_process_group()
    manager.revert()
    if rank == 0:
        print("RESULTS " + json.dumps(link), flush=True)
    return 0


def run_bandwidth_checks(adapter: str, report: Report, nproc: int, path: str, limits: tuple[int, int] | None = None,
                         timeout: float = 600) -> None:
    """Start ``nproc`` ranks on 127.0.0.1 with ``PORTSPEED_ACCELERATOR=adapter``; one check per measured row; the
    rows written into the link bandwidth table at ``path``."""
    from portspeed.accelerator import adapter_class
    from portspeed.testing import run_ranks

    if limits is None:
        limits = HOST_BYTES if getattr(adapter_class(adapter), "device_is_host", False) else DEFAULT_BYTES
    argv = ["-m", "portspeed.conformance.bandwidth", "--bytes", f"{limits[0]}:{limits[1]}"]
    res = run_ranks(argv, nproc, timeout=timeout, env={"PORTSPEED_ACCELERATOR": adapter, "PORTSPEED_CCL_CHECK": "0"})
    failed = [r for r in res if r.returncode != 0]
    line = [ln for ln in res[0].stdout.splitlines() if ln.startswith("RESULTS ")]
    if failed or not line:
        r = failed[0] if failed else res[0]
        report.add(SUITE, f"rank {r.rank} ran to the end", False,
                   f"exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}")
        return
    link = json.loads(line[-1][len("RESULTS "):])
    for row in link["rows"]:
        report.add(SUITE, f"{row['op']:<14} {row['ranks']} ranks {row['bytes']:>10} bytes: {row['time_us']:>10.1f} us, "
                   f"algbw {row['algbw_gbs']:.4g} GB/s, busbw {row['busbw_gbs']:.4g} GB/s",
                   row["time_us"] > 0, "no time measured")
    try:
        perf_links.write_link(path, link)
    except (OSError, PortspeedError) as exc:
        report.add(SUITE, f"the link table written to {path}", False, f"{getattr(exc, 'strerror', None) or exc}; "
                   "give --bandwidth FILE in a folder this user can write")
    else:
        report.add(SUITE, f"the link table written to {path} (adapter {link['adapter']}, backend {link['backend']}, "
                   f"host {link['host']}): `portspeed compare --perf` reads it", True)


if __name__ == "__main__":
    sys.exit(rank_main())
