"""Device checks of the conformance kit (one process): what a port assumes of a device.

Each check names the rule it tests. They go through the adapter's own API (``device()``,
``default_generator()``, ``Stream``, ``Event``, memory statistics), so they test the adapter
and the device together. On a host adapter (``device_type == "cpu"``) the separation checks
do not apply and are reported as skipped, with that reason.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.conformance.report import Report

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
    dev = acc.device(0)
    host_device = acc.device_type == "cpu"

    def lands_on_device() -> None:
        acc.set_device(0)
        t = torch.ones(3, device=acc.device())
        assert t.device.type == acc.device_type, f"a tensor made on {acc.device()} is on {t.device}"
        assert torch.ones(3).to(dev).device.type == acc.device_type

    report.run(SUITE, "tensors made on the adapter's device are on it", lands_on_device)

    if host_device:
        for name in ("host and device tensors do not mix in one op", "moves between host and device are copies",
                     "the device generator is separate from the host generator"):
            report.skip(SUITE, name, "the device is the host on this adapter")
    else:
        def no_mixing() -> None:
            _must_raise(lambda: torch.ones(4, device=dev) + torch.ones(4), ("device", "Device"))
            (torch.ones(4, device=dev) + torch.tensor(1.0)).cpu()  # a 0-dim host scalar is allowed

        def real_copies() -> None:
            x = torch.arange(4.0)
            d = x.to(dev)
            x[0] = 100.0
            assert d.cpu()[0].item() == 0.0, "changing the host tensor changed its device copy"
            h = d.cpu()
            h[1] = -1.0
            assert d[1].item() == 1.0, "changing .cpu() changed the device tensor"

        def separate_generator() -> None:
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

        report.run(SUITE, "host and device tensors do not mix in one op", no_mixing)
        report.run(SUITE, "moves between host and device are copies", real_copies)
        report.run(SUITE, "the device generator is separate from the host generator", separate_generator)

    def views_alias() -> None:
        d = torch.zeros(4, 3, device=dev)
        d.view(-1)[0] = 5.0
        d.t()[2, 1] = 6.0
        assert d.cpu()[0, 0].item() == 5.0 and d.cpu()[1, 2].item() == 6.0, "a view did not write its base"

    def rng_state_replays() -> None:
        acc.manual_seed(5)
        state = acc.get_rng_state()
        a = torch.rand(16, device=dev).cpu()
        acc.set_rng_state(state)
        assert torch.equal(torch.rand(16, device=dev).cpu(), a), "restoring the RNG state did not replay the draws"

    def streams_and_events() -> None:
        s = acc.Stream()
        start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
        start.record(s)
        with acc.stream(s):
            y = torch.ones(8, device=dev) * 3
        end.record(s)
        end.synchronize()
        acc.current_stream().wait_stream(s)
        acc.synchronize()
        assert y.sum().item() == 24.0 and start.elapsed_time(end) >= 0.0

    def memory_statistics() -> None:
        before = acc.memory_allocated()
        keep = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        grew = acc.memory_allocated() - before
        assert keep.numel() and (grew >= 1 << 20 or host_device), f"1 MiB allocated, statistics grew by {grew}"

    report.run(SUITE, "views share the device memory of their base", views_alias)
    report.run(SUITE, "get/set_rng_state replays the device's draws", rng_state_replays)
    report.run(SUITE, "streams, events and synchronize work", streams_and_events)
    report.run(SUITE, "memory statistics count device allocations", memory_statistics)
