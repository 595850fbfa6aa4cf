"""The test device behaves like an accelerator that is not the host (it is a test device, not hardware).

Registering a PrivateUse1 device cannot be undone in a process, so every check runs in a
fresh Python process (``run_python``) that imports ``portspeed.testing.testdev.runtime`` first,
as a program imports a vendor's torch extension. A check prints ``OK`` last; anything
else (an exception, a failed assert) fails the test with the child's output.
The extension is built by ``make test`` before pytest starts; if it cannot be built,
these tests fail (they never skip).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from helpers.launch import REPO, run_ok, run_python

pytestmark = [pytest.mark.testdev]

PRELUDE = "import torch\nimport portspeed.testing.testdev.runtime as testdev\n"


def _run(code: str, timeout: float = 180, **env: str) -> str:
    return run_ok(PRELUDE + textwrap.dedent(code), timeout=timeout, env=env)


def test_build_command_reports_the_extension() -> None:
    """`python -m portspeed.testing.testdev build` builds or loads the extension and says it is a test device."""
    res = run_python(["-m", "portspeed.testing.testdev", "build"], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "a test device, not hardware" in res.stdout


def test_never_registered_unless_chosen_by_name() -> None:
    """Auto-detection loads every adapter entry point; the test device must not register itself then."""
    res = run_python(["-c", "import torch, portspeed\n"
                            "assert portspeed.get_accelerator().name == 'cpu'\n"
                            # a CUDA wheel reports 'cuda' here even with no GPU; never the test device
                            "acc = torch.accelerator.current_accelerator()\n"
                            "assert acc is None or acc.type == 'cuda', acc\n"
                            "assert torch._C._get_privateuse1_backend_name() == 'privateuseone'\n"
                            "assert 'portspeed.testing.testdev.runtime' not in __import__('sys').modules\n"
                            "print('OK')"], timeout=120, env={"PORTSPEED_ACCELERATOR": ""})
    assert res.returncode == 0 and res.stdout.strip() == "OK", res.stderr[-3000:]


def test_registers_as_the_accelerator_with_its_own_module() -> None:
    """torch.accelerator, torch.get_device_module and Tensor.testdev() answer for the test device."""
    _run("""
        assert torch.accelerator.current_accelerator().type == "testdev"
        assert torch.accelerator.device_count() == 8 == torch.testdev.device_count()
        assert torch.get_device_module() is torch.testdev is torch.get_device_module("testdev")
        assert "test device" in torch.testdev.get_device_name()
        x = torch.ones(2).testdev()
        assert x.is_testdev and x.device == torch.device("testdev", 0)
    """)
    _run("assert torch.testdev.device_count() == 2", PORTSPEED_TESTDEV_DEVICES="2")


def test_host_and_device_tensors_do_not_mix() -> None:
    """An op on a host and a device tensor fails as on CUDA; 0-dim host scalars and host index tensors pass."""
    _run("""
        d = torch.arange(6.).to("testdev")
        for bad in (lambda: d + torch.ones(6), lambda: torch.ones(6) * d,
                    lambda: torch.mm(d.view(2, 3), torch.ones(3, 2))):
            try:
                bad()
                raise AssertionError("mixed host/device op did not raise")
            except RuntimeError as e:
                assert "same device" in str(e), e
        assert (d + torch.tensor(1.0)).cpu().tolist() == [1., 2., 3., 4., 5., 6.]
        assert d[torch.tensor([0, 5])].cpu().tolist() == [0., 5.]
        try:
            d + torch.ones(6, device="testdev:1")
            raise AssertionError("ops across device indices did not raise")
        except RuntimeError as e:
            assert "testdev:0" in str(e) and "testdev:1" in str(e), e
        try:
            d.numpy()
            raise AssertionError("numpy() of a device tensor did not raise")
        except TypeError:
            pass
    """)


def test_moves_between_host_and_device_are_copies() -> None:
    """.to(device) and .cpu() copy: changing one side never changes the other."""
    _run("""
        x = torch.arange(4.)
        d = x.to("testdev")
        x[0] = 100.
        assert d.cpu().tolist() == [0., 1., 2., 3.]
        h = d.cpu()
        h[1] = -1.
        assert d[1].item() == 1.
        assert h.data_ptr() != d.data_ptr()
        e = d.to("testdev:1")
        e[2] = 7.
        assert d[2].item() == 2. and e.device.index == 1
        assert d.to(torch.float64).dtype == torch.float64 and d.to(torch.float64).device == d.device
        s = d.t() if d.dim() == 2 else d.view(2, 2).t()
        assert s.cpu().tolist() == [[0., 2.], [1., 3.]]
    """)


def test_views_alias_device_memory() -> None:
    """Views share storage (Megatron's gradient buffers rely on it); .data = keeps Parameter attributes."""
    _run("""
        d = torch.zeros(4, 3, device="testdev")
        v = d.view(-1)
        v[0] = 5.
        d.t()[1, 0] = 6.
        d.narrow(0, 2, 1).fill_(7.)
        d.as_strided((2,), (3,), 1).add_(1.)
        # t()[1, 0] is d[0, 1]; as_strided((2,), (3,), 1) is d[0, 1] and d[1, 1]
        assert d.cpu().tolist() == [[5., 7., 0.], [0., 1., 0.], [7., 7., 7.], [0., 0., 0.]], d.cpu()
        assert v.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
        lin = torch.nn.Linear(2, 2)
        lin.weight.tensor_model_parallel = True
        w = lin.weight
        lin.to("testdev")
        assert lin.weight is w and lin.weight.tensor_model_parallel and lin.weight.is_testdev
        p = torch.nn.Parameter(torch.ones(2))
        p.data = p.data.to("testdev")
        assert p.is_testdev
    """)


def test_fresh_device_memory_is_not_zero() -> None:
    """Fresh device memory holds NaN (like a real device's garbage), so reading it unwritten shows."""
    _run("""
        assert torch.empty(8, device="testdev").isnan().all().item()
        assert torch.zeros(8, device="testdev").eq(0).all().item()
    """)


def test_device_generator_is_separate_from_the_host_generator() -> None:
    """Random ops on the device draw from the device's generator; host draws neither see nor move it."""
    _run("""
        def draws():
            x = torch.ones(64, device="testdev")
            return torch.cat([torch.nn.functional.dropout(x, 0.5), torch.rand(8, device="testdev"),
                              torch.randn(8, device="testdev"), torch.randint(0, 9, (8,), device="testdev").float(),
                              torch.randperm(8, device="testdev").float()]).cpu()
        torch.testdev.manual_seed(7)
        a = draws()
        torch.testdev.manual_seed(7)
        torch.rand(1000)                        # host draws in between
        host_before = torch.get_rng_state()
        b = draws()
        assert torch.equal(a, b), "device draws changed with host draws"
        assert torch.equal(host_before, torch.get_rng_state()), "device random ops moved the host generator"
        state = torch.testdev.get_rng_state()
        c = draws()
        torch.testdev.set_rng_state(state)
        assert torch.equal(draws(), c), "restoring the device state did not replay the draws"
        torch.testdev.manual_seed(7)
        torch.testdev.set_device(1)
        torch.testdev.manual_seed(8)
        torch.testdev.set_device(0)
        assert torch.equal(draws(), a), "seeding device 1 changed device 0's generator"
        g = torch.Generator(device="testdev")
        g.manual_seed(3)
        r1 = torch.rand(4, device="testdev", generator=g).cpu()
        g.manual_seed(3)
        assert torch.equal(torch.rand(4, device="testdev", generator=g).cpu(), r1)
        try:
            torch.rand(4, device="testdev", generator=torch.Generator())
            raise AssertionError("a host generator was accepted for a device op")
        except RuntimeError as e:
            assert "generator" in str(e), e
    """)


def test_streams_events_and_synchronize() -> None:
    """torch.Stream / torch.Event / synchronize follow PyTorch's semantics on the device."""
    _run("""
        dev = torch.device("testdev", 0)
        s = torch.Stream(device=dev)
        assert s.device == dev and s.stream_id != 0
        assert torch.testdev.default_stream().stream_id == 0 == torch.accelerator.current_stream().stream_id
        with torch.testdev.stream(s):
            assert torch.accelerator.current_stream().stream_id == s.stream_id
            y = torch.ones(3, device=dev) * 2
        assert torch.accelerator.current_stream().stream_id == 0
        start = torch.Event(device="testdev", enable_timing=True)
        end = torch.Event(device="testdev", enable_timing=True)
        start.record(s)
        z = y @ y
        end.record(s)
        end.synchronize()
        assert end.query() and start.elapsed_time(end) >= 0.0
        torch.accelerator.current_stream().wait_stream(s)
        torch.testdev.synchronize()
        torch.accelerator.synchronize()
        assert z.item() == 12.0
    """)


def test_pin_memory_autocast_and_memory_statistics() -> None:
    """pin_memory(), bf16 autocast and memory statistics work on the device."""
    _run("""
        h = torch.randn(16)
        assert not h.is_pinned() and h.pin_memory().is_pinned()
        a = torch.randn(4, 4, device="testdev")
        with torch.autocast("testdev", dtype=torch.bfloat16):
            assert (a @ a).dtype == torch.bfloat16
            assert torch.nn.functional.linear(a, a).dtype == torch.bfloat16
            assert torch.softmax(a, -1).dtype == torch.float32
        base = torch.testdev.memory_allocated()
        big = torch.empty(1 << 20, dtype=torch.uint8, device="testdev")
        assert torch.testdev.memory_allocated() - base == 1 << 20
        assert torch.accelerator.memory_allocated() == torch.testdev.memory_allocated()
        del big
        assert torch.testdev.memory_allocated() == base
        assert torch.testdev.max_memory_allocated() >= base + (1 << 20)
    """)


def test_set_device_places_new_tensors() -> None:
    """set_device(local_rank) decides where new tensors go, as on a node of accelerators."""
    _run("""
        torch.testdev.set_device(3)
        assert torch.empty(1, device="testdev").device == torch.device("testdev", 3)
        assert torch.accelerator.current_device_index() == 3
        with torch.testdev.device(5):
            assert torch.ones(1, device="testdev").device.index == 5
        assert torch.testdev.current_device() == 3
        try:
            torch.testdev.set_device(8)
            raise AssertionError("device 8 of 8 was accepted")
        except RuntimeError as e:
            assert "invalid device index" in str(e), e
    """)


# ---------------------------------------------------------------------- the CCL, raw (no portspeed router)
_CCL_RANK = """
import json, os, time
import torch, torch.distributed as dist
import portspeed.testing.testdev.runtime
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.testdev.set_device(rank)
dist.init_process_group("testccl")
dev = torch.device("testdev", rank)
out = {}
x = torch.full((4,), float(rank + 1), device=dev); dist.all_reduce(x); out["all_reduce"] = x.cpu().tolist()
b = torch.arange(4., device=dev) + rank; dist.broadcast(b, src=1); out["broadcast"] = b.cpu().tolist()
g = torch.empty(2 * n, device=dev); dist.all_gather_into_tensor(g, torch.full((2,), float(rank), device=dev))
out["all_gather_into_tensor"] = g.cpu().tolist()
r = torch.empty(2, device=dev); dist.reduce_scatter_tensor(r, torch.arange(2. * n, device=dev))
out["reduce_scatter_tensor"] = r.cpu().tolist()
a = torch.empty(n, device=dev); dist.all_to_all_single(a, torch.arange(float(n), device=dev) + 10 * rank)
out["all_to_all_single"] = a.cpu().tolist()
peer = (rank + 1) % n
got = torch.empty(3, device=dev)
for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank), device=dev), peer),
                                 dist.P2POp(dist.irecv, got, (rank - 1) % n)]):
    w.wait()
out["batch_isend_irecv"] = got.cpu().tolist()
# the received data lands in the device tensor inside wait(), not before
late = torch.zeros(2, device=dev)
if rank == 0:
    w = dist.irecv(late, 1)
    time.sleep(0.5)
    out["before_wait"] = late.cpu().tolist()
    w.wait()
    out["after_wait"] = late.cpu().tolist()
elif rank == 1:
    dist.send(torch.full((2,), 9., device=dev), 0)
for name, call in [("avg", lambda: dist.all_reduce(torch.ones(2, device=dev), op=dist.ReduceOp.AVG)),
                   ("bf16_reduce_scatter",
                    lambda: dist.reduce_scatter_tensor(torch.empty(2, device=dev, dtype=torch.bfloat16),
                                                       torch.ones(2 * n, device=dev, dtype=torch.bfloat16)))]:
    try:
        call(); out[name] = "no error"
    except RuntimeError as e:
        out[name] = str(e).splitlines()[0]
try:
    dist.all_reduce(torch.ones(2))
    out["host_tensor"] = "no error"
except (RuntimeError, ValueError) as e:
    out["host_tensor"] = str(e).splitlines()[0]
dist.barrier()
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_testccl_moves_device_tensors_and_declares_gaps(tmp_path) -> None:
    """testccl: collectives on device tensors give the right values; results land at wait(); its gaps raise."""
    from portspeed.testing import run_ranks

    script = tmp_path / "ccl_rank.py"
    script.write_text(_CCL_RANK)
    res = run_ranks([str(script)], 2, timeout=180, env={"PYTHONPATH": str(REPO)})
    outs = []
    for r in res:
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        assert r.returncode == 0 and line, f"rank {r.rank} exit {r.returncode}\n{r.stderr[-4000:]}"
        outs.append(json.loads(line[-1][7:]))
    for rank, out in enumerate(outs):
        assert out["all_reduce"] == [3.0] * 4
        assert out["broadcast"] == [1.0, 2.0, 3.0, 4.0]
        assert out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert out["reduce_scatter_tensor"] == [[0.0, 2.0], [4.0, 6.0]][rank]
        assert out["all_to_all_single"] == [[0.0, 10.0], [1.0, 11.0]][rank]
        assert out["batch_isend_irecv"] == [float(1 - rank)] * 3
        assert "does not support ReduceOp.AVG" in out["avg"]
        assert "does not support bfloat16" in out["bf16_reduce_scatter"]
        assert out["host_tensor"] != "no error", "a host tensor went through the device-only CCL"
    assert outs[0]["before_wait"] == [0.0, 0.0] and outs[0]["after_wait"] == [9.0, 9.0]


def test_testccl_staging_group_connects_at_first_use() -> None:
    """testccl's staging Gloo group is lazy (portspeed's lazy Gloo setting): creating a group of two with the
    peer absent returns at once; with PORTSPEED_GLOO_LAZY_INIT=0 it waits for the peer (the control).

    torch reads TORCH_GLOO_LAZY_INIT when the Gloo options are made; options made outside portspeed's lazy
    block gave eager staging groups, which Megatron's 8-rank unit tests then connected dozens of times.
    """
    code = """
        import datetime, time
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=3), wait_for_workers=False)
        create = dist.Backend._plugins["TESTCCL"].creator_fn
        t = time.time()
        try:
            create(dist.PrefixStore("g/", store), 0, 2, datetime.timedelta(seconds=3))
            print("MADE %.2f" % (time.time() - t))
        except Exception as exc:
            print("RAISED %.2f %s" % (time.time() - t, type(exc).__name__))
    """
    lazy = _run(code)
    assert "MADE" in lazy, lazy
    assert float(lazy.split("MADE ")[1].split()[0]) < 2.5, lazy
    eager = _run(code, PORTSPEED_GLOO_LAZY_INIT="0")
    assert "RAISED" in eager, f"control: an eager staging group should wait for its absent peer: {eager}"
