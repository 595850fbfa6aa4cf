"""``staged``: a c10d backend for any device that copies its tensors to the host and runs each collective on Gloo.

Why: a new device's collective library (CCL) is often the last thing to work, and a CCL that moves no data,
or the wrong data, ruins a run without an error. Every device can copy a tensor to the host and back, and
Gloo runs every collective torch has on host tensors. This backend is the two together, so a device trains
on several ranks on day one (slowly: each collective is a device-to-host copy, Gloo over TCP, a copy back),
and a CCL that gets a few collectives wrong is used for the rest.

Contract
- ``StagedProcessGroup`` is a ``torch.distributed.ProcessGroup`` written in Python (no C++, so nothing to
  build). Each collective copies the device tensors it reads to host buffers (a host tensor that is contiguous
  is used as it is), runs the same collective on an inner Gloo group (connected at its first collective, as
  portspeed makes its Gloo groups: ``gloo_init.lazy_gloo``), waits, copies the results into the caller's
  tensors and returns a completed work. ``send`` is Gloo's own (asynchronous) send of a host copy; ``recv``'s
  work copies into the caller's tensor when it is waited.
- Two modes, chosen when a group is made, from the active adapter: ``backend = "staged"`` stages every
  collective; ``staged_collectives = (...)`` (names from ``STAGEABLE``) stages only those and sends the rest
  to the adapter's own backend (``backend``), created inside this group on the same store. The adapter's
  groups then run on ``staged`` (``declarations.groups_backend``).
- ``register(device_type)`` registers the name ``staged`` with torch for ``device_type`` and the host
  (idempotent; a later device type is added). portspeed's router calls it when a group is made on ``staged``.
- Its capability table is Gloo's (``capabilities_for("staged")``), plus the adapter's ``backend_gaps`` for the
  collectives its own backend keeps: the router rewrites what either lacks.

Limits: synchronous (a collective returns when its result is in the caller's tensor: no overlap with compute);
the copies and TCP make it far slower than a working CCL on device memory (docs/benchmarks.md, "staged");
one tensor per call, as torch.distributed passes them.

Example::

    class DayOneAccelerator(PrivateUse1Accelerator):
        backend = "staged"                               # every collective through the host
        # or: staged_collectives = ("broadcast", "all_gather")  # only those; the rest on the vendor's CCL
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, _create_work_from_future
from torch.futures import Future

from portspeed.accelerator.declarations import STAGED_BACKEND as BACKEND_NAME
from portspeed.accelerator.declarations import STAGEABLE
from portspeed.trace import staging as trace_staging

__all__ = ["BACKEND_NAME", "STAGEABLE", "StagedProcessGroup", "register"]


def _done(result: Any = None) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is a contiguous host tensor, else a contiguous host copy of it."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    h.copy_(t.detach())
    return h


def _empty(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is a contiguous host tensor, else a contiguous host buffer shaped like it."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


def _wait_all(works: Any) -> None:
    """Wait for each work (the adapter's backend answers asynchronously; a coalesced call is done when all are)."""
    for w in list(works):
        w.wait()


def _back(dst: torch.Tensor, host: torch.Tensor) -> None:
    # outside autograd, as a C++ backend writes: Megatron's pipeline receives into a leaf that requires grad
    if dst is not host:
        with torch.no_grad():
            dst.copy_(host.view(dst.shape))


def _inner_gloo(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

    from portspeed.comm.gloo_init import lazy_gloo

    with lazy_gloo("gloo"):  # torch reads TORCH_GLOO_LAZY_INIT when the options are made
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [ProcessGroupGloo.create_default_device()]
        return ProcessGroupGloo(PrefixStore("staged-gloo/", store), rank, size, options)


def _vendor_backend(name: str, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """The adapter's own c10d backend ``name`` for this group (a registered plugin, or torch's NCCL/XCCL)."""
    from torch._C._distributed_c10d import PrefixStore

    store = PrefixStore(f"staged-{name}/", store)
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is not None:
        if not plugin.extended_api:
            return plugin.creator_fn(store, rank, size, timeout)
        from torch._C._distributed_c10d import _DistributedBackendOptions

        opts = _DistributedBackendOptions()
        opts.store, opts.group_rank, opts.group_size, opts.timeout = store, rank, size, timeout
        opts.group_id, opts.global_ranks_in_group = f"staged-{name}", list(range(size))
        return plugin.creator_fn(opts, None)
    if name == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    if name == "xccl" and hasattr(dist, "ProcessGroupXCCL"):
        return dist.ProcessGroupXCCL(store, rank, size)
    raise RuntimeError(f"staged backend: the adapter's backend {name!r} is neither registered with "
                       "torch.distributed.Backend.register_backend nor NCCL/XCCL; staged_collectives needs it to "
                       "serve the collectives it keeps (or declare backend = 'staged' to stage them all)")


class StagedProcessGroup(dist.ProcessGroup):
    """Collectives staged through the host on an inner Gloo group (all, or those named; the rest on ``vendor``)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, vendor: str | None = None,
                 staged: tuple[str, ...] = STAGEABLE) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._gloo = _inner_gloo(store, rank, size, timeout)
        self._vendor_name = vendor
        self._vendor = _vendor_backend(vendor, store, rank, size, timeout) if vendor else None
        self.staged = frozenset(STAGEABLE if vendor is None else staged)
        trace_staging.label(BACKEND_NAME, rank, size, "inner Gloo group its staged collectives run on")

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def __repr__(self) -> str:
        mode = "every collective" if self._vendor is None else f"{sorted(self.staged)}, the rest on {self._vendor_name}"
        return f"<StagedProcessGroup rank={self._rank} size={self._size} staged={mode}>"

    def _get_backend(self, device: Any) -> Any:
        """This group itself (a Python group registers no backend; see StandinProcessGroup._get_backend)."""
        try:
            return super()._get_backend(device)
        except RuntimeError:
            return self

    def _own(self, collective: str) -> Any:
        """The adapter's backend when it keeps ``collective``, else None (staged)."""
        return None if collective in self.staged else self._vendor

    # ------------------------------------------------------------------ collectives
    def _inplace(self, tensors: list[torch.Tensor], run: Callable[[list[torch.Tensor]], Any]) -> dist.Work:
        for t in tensors:  # one call per tensor: a list means one tensor per device to c10d, not a batch
            h = _host(t)
            run([h]).wait()
            _back(t, h)
        return _done(tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        own = self._own("all_reduce")
        opts = opts if opts is not None else dist.AllreduceOptions()
        if own is not None:
            return own.allreduce(tensors, opts)
        return self._inplace(tensors, lambda hs: self._gloo.allreduce(hs, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        ar = dist.AllreduceOptions()
        if opts is not None:
            ar.reduceOp, ar.timeout = opts.reduceOp, opts.timeout
        _wait_all(self.allreduce([t], ar) for t in tensors)
        return _done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        own = self._own("reduce")
        if own is not None:
            return own.reduce(tensors, opts)
        return self._inplace(tensors, lambda hs: self._gloo.reduce(hs, opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        own = self._own("broadcast")
        if own is not None:
            return own.broadcast(tensors, opts)
        return self._inplace(tensors, lambda hs: self._gloo.broadcast(hs, opts))

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        own = self._own("all_gather")
        opts = opts if opts is not None else AllgatherOptions()
        if own is not None:
            return own.allgather(output_tensors, input_tensors, opts)
        for outs, inp in zip(output_tensors, input_tensors):
            hosts = [_empty(o) for o in outs]
            self._gloo.allgather([hosts], [_host(inp)], opts).wait()
            for o, h in zip(outs, hosts):
                _back(o, h)
        return _done(output_tensors)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        _wait_all(self.allgather([outs], [inp], opts) for outs, inp in zip(output_lists, input_list))
        return _done(output_lists)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        own = self._own("all_gather_into_tensor")
        opts = opts if opts is not None else AllgatherOptions()
        if own is not None:
            return own._allgather_base(output, input, opts)
        # flat on the host whatever the caller's shapes: Gloo wants each output chunk shaped as the input
        inp = _host(input).reshape(-1)
        flat = output.reshape(-1) if output.device.type == "cpu" and output.is_contiguous() else \
            torch.empty(output.numel(), dtype=output.dtype)
        self._gloo._allgather_base(flat, inp, opts).wait()
        if flat.data_ptr() != output.data_ptr() or output.device.type != "cpu":
            output.copy_(flat.view(output.shape))
        return _done([output])

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        _wait_all(self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs))
        return _done(outputs)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any) -> dist.Work:
        own = self._own("reduce_scatter")
        if own is not None:
            return own.reduce_scatter(output_tensors, input_lists, opts)
        for out, inputs in zip(output_tensors, input_lists):  # as one reduce_scatter_tensor of the chunks
            flat = torch.cat([_host(t).reshape(-1) for t in inputs])
            h = _empty(out)
            self._gloo._reduce_scatter_base(h.view(-1), flat, opts).wait()
            _back(out, h)
        return _done(output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        own = self._own("reduce_scatter_tensor")
        if own is not None:
            return own._reduce_scatter_base(output, input, opts)
        h = _empty(output)
        self._gloo._reduce_scatter_base(h.view(-1), _host(input).reshape(-1), opts).wait()
        _back(output, h)
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> dist.Work:
        _wait_all(self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs))
        return _done(outputs)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        own = self._own("all_to_all")
        opts = opts if opts is not None else dist.AllToAllOptions()
        if own is not None:
            return own.alltoall(output_tensors, input_tensors, opts)
        flat_in = torch.cat([_host(t).reshape(-1) for t in input_tensors])  # as one uneven all_to_all_single
        flat_out = torch.empty(sum(o.numel() for o in output_tensors), dtype=flat_in.dtype)
        self._gloo.alltoall_base(flat_out, flat_in, [o.numel() for o in output_tensors],
                                 [t.numel() for t in input_tensors], opts).wait()
        for o, h in zip(output_tensors, flat_out.split([o.numel() for o in output_tensors])):
            o.copy_(h.view(o.shape))
        return _done(output_tensors)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        own = self._own("all_to_all_single")
        opts = opts if opts is not None else dist.AllToAllOptions()
        if own is not None:
            return own.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        h = _empty(output)
        self._gloo.alltoall_base(h, _host(input), list(output_split_sizes), list(input_split_sizes), opts).wait()
        _back(output, h)
        return _done([output])

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any) -> dist.Work:
        own = self._own("gather")
        if own is not None:
            return own.gather(output_tensors, input_tensors, opts)
        hosts = [[_empty(o) for o in outs] for outs in output_tensors]
        self._gloo.gather(hosts, [_host(t) for t in input_tensors], opts).wait()
        for outs, hs in zip(output_tensors, hosts):
            for o, h in zip(outs, hs):
                _back(o, h)
        return _done(output_tensors)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any) -> dist.Work:
        own = self._own("scatter")
        if own is not None:
            return own.scatter(output_tensors, input_tensors, opts)
        hosts = [_empty(o) for o in output_tensors]
        self._gloo.scatter(hosts, [[_host(t) for t in ins] for ins in input_tensors], opts).wait()
        for o, h in zip(output_tensors, hosts):
            _back(o, h)
        return _done(output_tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        own = self._own("barrier")
        if own is not None:
            return own.barrier(opts if opts is not None else dist.BarrierOptions())
        self._gloo.barrier(dist.BarrierOptions()).wait()
        return _done(None)

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        own = self._own("send_recv")
        if own is not None:
            return own.send(tensors, dst, tag)
        return self._gloo.send([_host(t) for t in tensors], dst, tag)  # the work holds the host copy

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        own = self._own("send_recv")
        if own is not None:
            return own.recv(tensors, src, tag)
        from portspeed.comm.work import ThenWork

        hosts = [_empty(t) for t in tensors]
        inner = self._gloo.recv(hosts, src, tag)
        if all(h is t for h, t in zip(hosts, tensors)):
            return inner
        return ThenWork(inner, lambda: [_back(t, h) for t, h in zip(tensors, hosts)])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        own = self._own("send_recv")
        if own is not None:
            return own.recv_anysource(tensors, tag)
        from portspeed.comm.work import ThenWork

        hosts = [_empty(t) for t in tensors]
        inner = self._gloo.recv_anysource(hosts, tag)
        return ThenWork(inner, lambda: [_back(t, h) for t, h in zip(tensors, hosts)])

    # torch before 2.13 calls these names (as the stand-in CCL: a Python group is the group itself there)
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> StagedProcessGroup:
    """torch's creator: the mode the active adapter declares (every collective, or its staged_collectives)."""
    vendor, staged = None, STAGEABLE
    try:
        from portspeed.accelerator import get_accelerator

        acc = get_accelerator()
        own = acc.default_backend().lower()
        if acc.staged_collectives and own != BACKEND_NAME:
            vendor, staged = own, tuple(acc.staged_collectives)
    except Exception:  # noqa: BLE001 - no adapter can be selected here: every collective staged
        pass
    return StagedProcessGroup(store, rank, size, timeout, vendor, staged)


_lock = threading.Lock()


def register(device_type: str = "cpu") -> None:
    """Register ``staged`` with torch.distributed for ``device_type`` and the host (idempotent)."""
    with _lock:
        if BACKEND_NAME not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND_NAME, _create, devices=sorted({"cpu", device_type}))
            return
        devices = dist.Backend.backend_capability.setdefault(BACKEND_NAME, [])
        if device_type not in devices:  # a second device type in the same process (tests): add it
            devices.append(device_type)
            dist.Backend.default_device_backend_map.setdefault(device_type, BACKEND_NAME)
