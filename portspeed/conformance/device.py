"""Device checks of the conformance kit (one process): what a port assumes of a device.

Each check names the rule it tests. They go through the adapter's own API (``device()``,
``default_generator()``, ``Stream``, ``Event``, memory statistics), so they test the adapter
and the device together. On a host adapter (``device_type == "cpu"``) the separation checks
do not apply and are reported as skipped, with that reason.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from portspeed.accelerator import param_identity
from portspeed.conformance.report import Report
from portspeed.conformance.view_calls import run_view_checks

__all__ = ["run_device_checks"]

SUITE = "device"


def _must_raise(fn: Any, words: tuple[str, ...]) -> None:
    try:
        fn()
    except (RuntimeError, TypeError, ValueError) as exc:
        assert any(w in str(exc) for w in words), f"raised, but not about devices: {exc}"
        return
    raise AssertionError("did not raise")


def run_device_checks(acc: Any, report: Report) -> None:
    """Append the device checks of adapter ``acc`` to ``report``."""
    report.run(SUITE, "tensors made on the adapter's device are on it", partial(_lands_on_device, acc))
    if acc.device_type == "cpu":
        for name in ("host and device tensors do not mix in one op", "moves between host and device are copies",
                     "the device generator is separate from the host generator"):
            report.skip(SUITE, name, "the device is the host on this adapter")
    else:
        report.run(SUITE, "host and device tensors do not mix in one op", partial(_no_mixing, acc))
        report.run(SUITE, "moves between host and device are copies", partial(_real_copies, acc))
        report.run(SUITE, "random ops on the device draw from the host generator, as declared (host_generator)"
                   if acc.host_generator else "the device generator is separate from the host generator",
                   partial(_separate_generator, acc, report))
    fixed = param_identity.state().get("registered")
    report.run(SUITE, "module.to(device) keeps Parameter objects and their attributes; param.data = t works"
               + (" (the device has no PrivateUse1 _has_compatible_shallow_copy_type kernel: portspeed registered "
                  "one at activation)" if fixed else ""), partial(_parameters_kept, acc))
    report.run(SUITE, "views share the device memory of their base", partial(_views_alias, acc))
    report.run(SUITE, "get/set_rng_state replays the device's draws", partial(_rng_state_replays, acc, report))
    report.run(SUITE, "streams, events and synchronize work", partial(_streams_and_events, acc))
    report.run(SUITE, "memory statistics count device allocations", partial(_memory_statistics, acc))
    run_view_checks(acc, report)


def _lands_on_device(acc: Any) -> None:
    acc.set_device(0)
    t = torch.ones(3, device=acc.device())
    assert t.device.type == acc.device_type, f"a tensor made on {acc.device()} is on {t.device}"
    assert torch.ones(3).to(acc.device(0)).device.type == acc.device_type


def _no_mixing(acc: Any) -> None:
    dev = acc.device(0)
    _must_raise(lambda: torch.ones(4, device=dev) + torch.ones(4), ("device", "Device"))
    (torch.ones(4, device=dev) + torch.tensor(1.0)).cpu()  # a 0-dim host scalar is allowed


def _real_copies(acc: Any) -> None:
    x = torch.arange(4.0)
    d = x.to(acc.device(0))
    x[0] = 100.0
    assert d.cpu()[0].item() == 0.0, "changing the host tensor changed its device copy"
    h = d.cpu()
    h[1] = -1.0
    assert d[1].item() == 1.0, "changing .cpu() changed the device tensor"


def _separate_generator(acc: Any, report: Report) -> None:
    dev = acc.device(0)
    host = torch.get_rng_state()
    torch.nn.functional.dropout(torch.ones(256, device=dev), 0.5)
    if acc.host_generator:  # declared: check that it holds
        assert not torch.equal(host, torch.get_rng_state()), (
            "the adapter declares host_generator = True, but dropout on the device did not draw from the "
            "host generator: take the declaration out")
        return
    if not torch.equal(host, torch.get_rng_state()):
        report.declare("host_generator", "True")
        raise AssertionError(
            "random ops on the device draw from the host generator (the CPU fallback's): seeding or saving "
            "the device generator does not reach them, so the framework's forked RNG states (Megatron's "
            "tensor-parallel tracker) fork nothing; declare host_generator = True (portspeed's RNG calls "
            "then serve the host generator), or give the device's random ops its own generator")
    gen = acc.default_generator(0)
    assert gen is not torch.default_generator and gen.device.type == acc.device_type, (
        f"the device generator is {gen.device} ({gen!r})")
    gen.manual_seed(11)
    a = torch.nn.functional.dropout(torch.ones(256, device=dev), 0.5).cpu()
    gen.manual_seed(11)
    torch.rand(100)  # host draws must not move the device generator
    host = torch.get_rng_state()
    b = torch.nn.functional.dropout(torch.ones(256, device=dev), 0.5).cpu()
    assert torch.equal(a, b), "dropout on the device changed with host draws"
    assert torch.equal(host, torch.get_rng_state()), "dropout on the device drew from the host generator"


def _views_alias(acc: Any) -> None:
    d = torch.zeros(4, 3, device=acc.device(0))
    d.view(-1)[0] = 5.0
    d.t()[2, 1] = 6.0
    assert d.cpu()[0, 0].item() == 5.0 and d.cpu()[1, 2].item() == 6.0, "a view did not write its base"


def _rng_state_replays(acc: Any, report: Report) -> None:
    dev = acc.device(0)
    acc.manual_seed(5)
    state = acc.get_rng_state()
    a = torch.rand(16, device=dev).cpu()
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(16, device=dev).cpu(), a), "restoring the RNG state did not replay the draws" + (
        " (random ops on the device draw from the host generator: host_generator = True, printed below, makes "
        "the adapter's RNG state the host's)" if "host_generator" in report.paste else "")


def _streams_and_events(acc: Any) -> None:
    s = acc.Stream()
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record(s)
    with acc.stream(s):
        y = torch.ones(8, device=acc.device(0)) * 3
    end.record(s)
    end.synchronize()
    acc.current_stream().wait_stream(s)
    acc.synchronize()
    assert y.sum().item() == 24.0 and start.elapsed_time(end) >= 0.0


def _memory_statistics(acc: Any) -> None:
    before = acc.memory_allocated()
    keep = torch.empty(1 << 20, dtype=torch.uint8, device=acc.device(0))
    grew = acc.memory_allocated() - before
    assert keep.numel() and (grew >= 1 << 20 or acc.device_type == "cpu"), (
        f"1 MiB allocated, statistics grew by {grew}")


def _parameters_kept(acc: Any) -> None:
    dev = acc.device(0)
    m = torch.nn.Linear(4, 3)
    w = m.weight
    w.tensor_model_parallel, w.partition_dim = True, 0  # what Megatron hangs on its parameters
    m.to(dev)
    assert m.weight.device.type == acc.device_type, f"module.to({dev}) left the weight on {m.weight.device}"
    assert m.weight is w, (f"module.to({dev}) made a new Parameter object: the attributes frameworks set on "
                           "parameters (Megatron's tensor_model_parallel, partition_dim) are lost")
    assert getattr(m.weight, "tensor_model_parallel", False) and m.weight.partition_dim == 0
    p = torch.nn.Parameter(torch.ones(3))
    p.data = p.data.to(dev)  # Megatron: weight.data = weight.data.cuda()
    assert p.device.type == acc.device_type
