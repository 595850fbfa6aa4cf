"""The torch.cuda calls the scoped view serves to Megatron and DeepSpeed, each made on the device.

Why: framework modules see ``torch.cuda`` as portspeed's view (``portspeed.translation.cuda_view.CUDA_API``), each
name answered by an adapter method. A default that the device cannot serve (OpenReg's
``torch.accelerator.get_memory_info`` raises NotImplementedError, reached by Megatron through
``torch.cuda.get_device_properties``) fails inside the framework, far from its cause. Here every such call is
made once, on the device, through the view itself: a call that raises is named with the adapter method to
override, and the device's own answer for its total memory is asked, since the default degrades there (to the
declared ``total_memory_bytes``, else the host's memory) rather than fail.

``CALLS`` covers every name of the view that reaches the adapter (a test checks it against ``CUDA_API``): the
constants (``get_device_capability`` ...), the CUDA-only refusals and torch's own types are not the device's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from portspeed.conformance.report import Report

__all__ = ["CALLS", "run_view_checks"]

SUITE = "device"


def _expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    assert isinstance(value, kind), f"{what} answered {value!r}, not a {getattr(kind, '__name__', kind)}"
    return value


def _enter_exit(ctx: Any) -> None:
    with ctx:
        pass


def _props(view: Any) -> None:
    props = view.get_device_properties(0)
    _expect(props.total_memory, int, "get_device_properties(0).total_memory")
    assert props.total_memory > 0, f"get_device_properties(0).total_memory is {props.total_memory}"


def _event(view: Any, dev: torch.device) -> None:
    start, end = view.Event(enable_timing=True), view.Event(enable_timing=True)
    start.record()
    torch.ones(4, device=dev).sum()
    end.record()
    end.synchronize()
    _expect(start.elapsed_time(end), float, "Event.elapsed_time")


def _stream(view: Any, dev: torch.device) -> None:
    s = view.Stream()
    with view.stream(s):
        y = torch.ones(4, device=dev) * 2
    view.current_stream().wait_stream(s)
    assert y.sum().item() == 8.0


def _autocast(view: Any, ctx: Callable[..., Any], dev: torch.device) -> None:
    with ctx(dtype=torch.bfloat16):
        y = torch.mm(torch.ones(4, 4, device=dev), torch.ones(4, 4, device=dev))
    assert y.dtype == torch.bfloat16, f"a matmul under autocast gave {y.dtype}, not bfloat16"


def _rng_round_trip(view: Any) -> None:
    state = view.get_rng_state()
    view.set_rng_state(state)
    states = view.get_rng_state_all()
    view.set_rng_state_all(states)


def _custom_fwd(view: Any, dev: torch.device) -> None:
    class Twice(torch.autograd.Function):
        @staticmethod
        @view.amp.custom_fwd
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        @view.amp.custom_bwd
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    x = torch.ones(3, device=dev, requires_grad=True)
    Twice.apply(x).sum().backward()
    assert x.grad is not None and x.grad.sum().item() == 6.0


#: view name -> (the call, made with (view, device); the adapter method that answers it)
CALLS: dict[str, tuple[Callable[[Any, torch.device], Any], str]] = {
    "is_available": (lambda v, d: _expect(v.is_available(), bool, "is_available()"), "is_available"),
    "device_count": (lambda v, d: _expect(v.device_count(), int, "device_count()"), "device_count"),
    "current_device": (lambda v, d: _expect(v.current_device(), int, "current_device()"), "current_device"),
    "set_device": (lambda v, d: v.set_device(v.current_device()), "set_device"),
    "device": (lambda v, d: _enter_exit(v.device(0)), "set_device"),
    "synchronize": (lambda v, d: v.synchronize(), "synchronize"),
    "get_device_properties": (lambda v, d: _props(v), "total_memory"),
    "get_device_name": (lambda v, d: _expect(v.get_device_name(0), str, "get_device_name(0)"), "total_memory"),
    "is_bf16_supported": (lambda v, d: _expect(v.is_bf16_supported(), bool, "is_bf16_supported()"),
                          "is_bf16_supported"),
    "default_generators": (lambda v, d: v.default_generators[0].get_state(), "default_generator"),
    "get_rng_state": (lambda v, d: _rng_round_trip(v), "get_rng_state"),
    "set_rng_state": (lambda v, d: v.set_rng_state(v.get_rng_state()), "set_rng_state"),
    "get_rng_state_all": (lambda v, d: v.get_rng_state_all(), "get_rng_state"),
    "set_rng_state_all": (lambda v, d: v.set_rng_state_all(v.get_rng_state_all()), "set_rng_state"),
    "manual_seed": (lambda v, d: v.manual_seed(1234), "manual_seed"),
    "manual_seed_all": (lambda v, d: v.manual_seed_all(1234), "manual_seed_all"),
    "seed": (lambda v, d: v.seed(), "default_generator"),
    "initial_seed": (lambda v, d: _expect(v.initial_seed(), int, "initial_seed()"), "initial_seed"),
    "Stream": (lambda v, d: v.Stream(), "Stream"),
    "Event": (_event, "Event"),
    "current_stream": (lambda v, d: v.current_stream(), "current_stream"),
    "default_stream": (lambda v, d: v.default_stream(), "default_stream"),
    "stream": (_stream, "stream"),
    "set_stream": (lambda v, d: v.set_stream(v.current_stream()), "current_stream"),
    "memory_allocated": (lambda v, d: _expect(v.memory_allocated(), int, "memory_allocated()"), "memory_allocated"),
    "max_memory_allocated": (lambda v, d: _expect(v.max_memory_allocated(), int, "max_memory_allocated()"),
                             "max_memory_allocated"),
    "memory_reserved": (lambda v, d: _expect(v.memory_reserved(), int, "memory_reserved()"), "memory_reserved"),
    "max_memory_reserved": (lambda v, d: _expect(v.max_memory_reserved(), int, "max_memory_reserved()"),
                            "max_memory_reserved"),
    "reset_peak_memory_stats": (lambda v, d: v.reset_peak_memory_stats(), "reset_peak_memory_stats"),
    "reset_max_memory_allocated": (lambda v, d: v.reset_max_memory_allocated(), "reset_peak_memory_stats"),
    "memory_stats": (lambda v, d: _expect(v.memory_stats(), dict, "memory_stats()"), "memory_stats"),
    "empty_cache": (lambda v, d: v.empty_cache(), "empty_cache"),
    "mem_get_info": (lambda v, d: _expect(v.mem_get_info(), tuple, "mem_get_info()"), "total_memory"),
    "autocast": (lambda v, d: _autocast(v, v.autocast, d), "device_type (autocast kernels: AutocastPrivateUse1)"),
    "nvtx.range_push": (lambda v, d: v.nvtx.range_push("portspeed conformance"), "range_push"),
    "nvtx.range_pop": (lambda v, d: v.nvtx.range_pop(), "range_pop"),
    "nvtx.range": (lambda v, d: _enter_exit(v.nvtx.range("portspeed conformance")), "range_push"),
    "nvtx.mark": (lambda v, d: v.nvtx.mark("portspeed conformance"), "range_push"),
    "amp.autocast": (lambda v, d: _autocast(v, v.amp.autocast, d), "device_type (autocast kernels)"),
    "amp.custom_fwd": (_custom_fwd, "device_type (autocast kernels)"),
    "amp.custom_bwd": (_custom_fwd, "device_type (autocast kernels)"),
    "amp.GradScaler": (lambda v, d: v.amp.GradScaler(), "device_type"),
}


def run_view_checks(acc: Any, report: Report) -> None:
    """Make every call of ``CALLS`` through the view on ``acc``'s device; one line per call that raises, one line
    for the rest; then whether the device answers its total memory itself."""
    from portspeed.accelerator.contract import Accelerator, host_memory_bytes
    from portspeed.translation.cuda_view import CudaView

    view, dev, cls = CudaView(), acc.device(0), type(acc).__name__
    acc.set_device(0)
    passed = []
    for name, (call, method) in CALLS.items():
        try:
            call(view, dev)
        except Exception as exc:  # a call the framework would make and the device cannot serve: named
            how = (f"override {cls}.{method} in the adapter" if method.isidentifier()
                   else f"the adapter's {method}")
            report.add(SUITE, f"torch.cuda.{name} answers on the device", False,
                       f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} -- {how}")
        else:
            passed.append(name)
    report.add(SUITE, f"{len(passed)} of the {len(CALLS)} torch.cuda calls the view serves to Megatron and "
               "DeepSpeed answer on the device", len(passed) == len(CALLS), "the others are named above")
    if type(acc).total_memory is not Accelerator.total_memory and \
            type(acc).device_total_memory is Accelerator.device_total_memory:
        acc.total_memory(0)  # the adapter answers its memory itself (the CPU adapter: the host's)
        report.add(SUITE, "the adapter answers its total memory itself (its own total_memory)", True)
        return
    try:
        acc.device_total_memory(0)
    except Exception as exc:  # the device cannot say: the default answers a stated value; the adapter should say
        declared = acc.total_memory_bytes
        if declared is not None:
            report.add(SUITE, f"total memory: the device cannot say, the adapter declares total_memory_bytes = "
                       f"{declared}", True)
            return
        guess = host_memory_bytes()
        report.add(SUITE, "the device answers its total memory (get_device_properties().total_memory, mem_get_info)",
                   False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; portspeed answers "
                   f"{guess} bytes (the host's physical memory) until the adapter declares its device's memory: "
                   f"total_memory_bytes = <bytes per device> ({guess} below; write the real figure if you know it)")
        report.declare("total_memory_bytes", str(guess))
    else:
        report.add(SUITE, "the device answers its total memory (get_device_properties().total_memory, mem_get_info)",
                   True)
