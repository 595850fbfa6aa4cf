"""The stand-in vendor backend on its own (no router): a real c10d backend with real gaps.

One 3-rank process group checks: registration and identity, values of its own ring
algorithms against a float64 reference, that its reduction order is not Gloo's (bf16
sums differ bit-wise somewhere, both within rounding of the reference), that every
declared gap really raises, and point-to-point with user tags (pipeline parallelism).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Callable

import pytest

import portspeed.testing.standin_ccl as standin
from portspeed.accelerator import ENTRY_POINT_GROUP, available_adapters


# ---------------------------------------------------------------------- rank side
def _main() -> int:
    import torch.distributed as dist

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, rank == 0, timeout=timeout)
    dist.init_process_group("standin", store=dist.PrefixStore("s", store), rank=rank, world_size=n, timeout=timeout)
    results: list[dict] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        results.append({"check": name, "ok": bool(ok), "detail": "" if ok else detail})

    pg = dist.group.WORLD
    check("default group is the Python StandinProcessGroup", isinstance(pg, standin.StandinProcessGroup), repr(pg))
    check("get_backend() is 'standin'", dist.get_backend() == "standin", dist.get_backend())
    _values(check, rank, n)
    _declared_gaps_raise(check, n)
    _point_to_point(check, rank, n)
    dist.destroy_process_group()
    print("RESULTS " + json.dumps({"rank": rank, "results": results}))
    return 0


def _values(check: Callable[..., None], rank: int, n: int) -> None:
    """Random data against a float64 reference, through the stand-in's own ring; odd sizes; the other collectives."""
    import torch
    import torch.distributed as dist

    R = dist.ReduceOp
    gloo = dist.new_group(list(range(n)), backend="gloo")
    g = torch.Generator().manual_seed(1234)
    everyone = torch.randn(n, 1000, generator=g, dtype=torch.float64)
    mine = everyone[rank].clone()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        x = mine.to(dtype)
        dist.all_reduce(x)
        err = (x.double() - everyone.to(dtype).double().sum(0)).abs().max().item()
        check(f"ring all_reduce SUM {dtype} within rounding", err < tol * n * 4, f"max error {err}")
        y = mine.to(dtype)
        dist.all_reduce(y, group=gloo)
        if dtype is torch.bfloat16 and n >= 3:
            check("bf16 sums differ from Gloo's bit-wise somewhere (another reduction order)",
                  not torch.equal(x, y), "identical to Gloo on every element")
    for op, fn in ((R.MAX, lambda s: s.amax(0)), (R.MIN, lambda s: s.amin(0))):
        x = mine.float()
        dist.all_reduce(x, op=op)
        check(f"ring all_reduce {op.name}", torch.equal(x, fn(everyone).float()))
    x = torch.tensor([1 << rank], dtype=torch.int64)
    dist.all_reduce(x, op=R.BOR)
    check("ring all_reduce BOR int64", x.item() == (1 << n) - 1, str(x))
    # odd sizes: fewer elements than ranks, and sizes not divisible by the world
    for numel in (1, n + 1, 7):
        x = torch.full((numel,), float(rank + 1))
        dist.all_reduce(x)
        check(f"ring all_reduce with {numel} elements", torch.equal(x, torch.full((numel,), n * (n + 1) / 2)))
    x = torch.full((3,), float(rank))
    dist.broadcast(x, src=n - 1)
    check("chain broadcast from the last rank", torch.equal(x, torch.full((3,), float(n - 1))))
    out = torch.empty(n * 2)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    check("ring all_gather_into_tensor", torch.equal(out, torch.arange(n).repeat_interleave(2).float()))
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(n * 2.0))
    check("ring reduce_scatter_tensor SUM", torch.equal(out, n * torch.arange(rank * 2.0, rank * 2.0 + 2)))
    x = torch.full((2,), float(rank + 1))
    dist.reduce(x, dst=1)
    if rank == 1:
        check("reduce to rank 1", torch.equal(x, torch.full((2,), n * (n + 1) / 2)))
    dist.barrier()
    check("barrier", True)


def _declared_gaps_raise(check: Callable[..., None], n: int) -> None:
    """The declared gaps raise, like a vendor CCL's, and the group works after them."""
    import torch
    import torch.distributed as dist

    def raises(fn) -> bool:
        try:
            fn()
        except RuntimeError as exc:
            return "standin CCL" in str(exc)
        return False

    R = dist.ReduceOp
    check("AVG raises", raises(lambda: dist.all_reduce(torch.ones(2), op=R.AVG)))
    check("PREMUL_SUM raises", raises(lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))))
    check("bf16 reduce_scatter_tensor raises", raises(
        lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.bfloat16),
                                           torch.ones(n * 2, dtype=torch.bfloat16))))
    check("bf16 list reduce_scatter raises", raises(
        lambda: dist.reduce_scatter(torch.empty(2, dtype=torch.bfloat16),
                                    [torch.ones(2, dtype=torch.bfloat16)] * n)))
    check("list all_to_all raises", raises(
        lambda: dist.all_to_all([torch.empty(1) for _ in range(n)], [torch.ones(1) for _ in range(n)])))
    x = torch.ones(2)
    dist.all_reduce(x)  # the group still works after the refusals
    check("group usable after refused calls", torch.equal(x, torch.full((2,), float(n))))


def _point_to_point(check: Callable[..., None], rank: int, n: int) -> None:
    """Point to point with user tags, as pipeline stages use it, and batch_isend_irecv around the ring."""
    import torch
    import torch.distributed as dist

    right, left = (rank + 1) % n, (rank - 1) % n
    got_a, got_b = torch.empty(3), torch.empty(3)
    reqs = [dist.isend(torch.full((3,), 10.0 + rank), right, tag=7),
            dist.isend(torch.full((3,), 20.0 + rank), right, tag=8),
            dist.irecv(got_b, left, tag=8), dist.irecv(got_a, left, tag=7)]
    for r in reqs:
        r.wait()
    check("isend/irecv matched by tag", torch.equal(got_a, torch.full((3,), 10.0 + left))
          and torch.equal(got_b, torch.full((3,), 20.0 + left)), f"{got_a} {got_b}")
    got = torch.empty(3)
    for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank)), right),
                                     dist.P2POp(dist.irecv, got, left)]):
        r.wait()
    check("batch_isend_irecv ring", torch.equal(got, torch.full((3,), float(left))))


# ---------------------------------------------------------------------- pytest side
@pytest.mark.multiproc
def test_standin_backend_is_a_real_backend_with_real_gaps() -> None:
    """3 ranks on the stand-in backend alone: values, reduction order, raised gaps, p2p."""
    from portspeed.testing import run_ranks

    failures = []
    for r in run_ranks([__file__], 3, timeout=300):
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")]
        assert r.returncode == 0 and line, f"rank {r.rank} exit {r.returncode}:\n{r.stderr[-4000:]}"
        rep = json.loads(line[-1][len("RESULTS "):])
        failures += [f"rank {r.rank}: {c['check']}: {c['detail']}" for c in rep["results"] if not c["ok"]]
        assert len(rep["results"]) >= 20
    assert not failures, "\n".join(failures)


def test_register_is_idempotent_and_the_backend_is_known_to_torch() -> None:
    """Importing the module registers 'standin'; registering again changes nothing."""
    import torch.distributed as dist

    standin.register()
    standin.register()
    assert dist.Backend.backend_list.count("standin") == 1


def test_adapter_is_never_auto_detected_and_uses_the_standin_backend() -> None:
    """StandinAccelerator: CPU device, backend 'standin', detect() False, not verified on hardware."""
    acc = standin.StandinAccelerator()
    assert standin.StandinAccelerator.detect() is False
    assert acc.name == "standin" and acc.communication_backend == "standin"
    assert acc.device().type == "cpu" and acc.verified_on_hardware is False
    assert acc.capabilities().gap("all_to_all") is not None


def test_adapter_entry_point_is_installed() -> None:
    """pyproject declares the 'standin' entry point: a packaging regression that drops it fails here."""
    import importlib_metadata

    eps = {ep.name: ep for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert "standin" in eps, (f"the {ENTRY_POINT_GROUP!r} entry point 'standin' is missing from the installed "
                              "metadata: pyproject.toml must declare it (then reinstall: pip install -e .)")
    assert eps["standin"].load() is standin.StandinAccelerator
    assert "standin" in available_adapters()


if __name__ == "__main__":
    sys.exit(_main())
