"""The stand-in vendor collective library: a real c10d backend named ``"standin"``, and its adapter.

Why: portspeed's CI has no vendor accelerator, yet the router's rewrites, the loss-parity
harness and the DeepSpeed path must meet a backend that (a) is not Gloo, (b) reduces in
a different order than Gloo, and (c) lacks things, as vendor CCLs do. This module is that
backend, and says plainly that it is a stand-in.

Contract
- ``StandinProcessGroup`` subclasses ``torch.distributed.ProcessGroup`` in Python and is
  registered with ``Backend.register_backend("standin", ..., devices=["cpu"])`` when this
  module is imported. Every collective is its own algorithm over point-to-point messages
  on an inner Gloo backend: all_reduce is a chunked ring (reduce-scatter, then
  all-gather), so floating-point sums accumulate in a different order than Gloo's;
  broadcast is a chain from the root; all_to_all_single is pairwise exchange.
- Declared gaps, which really raise ``RuntimeError`` (so the router must rewrite them):
  ReduceOp.AVG and PREMUL_SUM in every reducing collective, bfloat16 in reduce_scatter
  (list and tensor), and the list all_to_all. ``StandinAccelerator.backend_gaps`` declares
  the same, as a third-party adapter would, and the router reads it from there.
- Collectives run synchronously and return completed work objects; send/recv return the
  inner Gloo work (truly asynchronous), so batch_isend_irecv and pipeline p2p behave.
- ``StandinAccelerator`` is the CPU adapter with backend ``"standin"``; ``detect()`` is
  False, so only ``PORTSPEED_ACCELERATOR=standin`` or ``set_accelerator`` selects it.

Limits: CPU tensors only; one tensor per call (as torch.distributed passes them); no
timing fidelity: it is for correctness, never for speed figures.

Example::

    import portspeed, portspeed.testing.standin_ccl as standin
    portspeed.set_accelerator(standin.StandinAccelerator())
    dist.init_process_group("standin", ...)   # or "nccl", through the router
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from portspeed.adapters.cpu import CpuAccelerator
from portspeed.trace import staging as trace_staging
from portspeed.vendor import BackendGaps, op_type

__all__ = ["BACKEND_NAME", "StandinAccelerator", "StandinProcessGroup", "register"]

BACKEND_NAME = "standin"
_TAG = 1 << 20  # inner messages of collectives; user p2p tags stay below this
RedOpType = dist.ReduceOp.RedOpType

_COMBINE = {
    RedOpType.SUM: lambda acc, x: acc.add_(x),
    RedOpType.PRODUCT: lambda acc, x: acc.mul_(x),
    RedOpType.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    RedOpType.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    RedOpType.BAND: lambda acc, x: acc.bitwise_and_(x),
    RedOpType.BOR: lambda acc, x: acc.bitwise_or_(x),
    RedOpType.BXOR: lambda acc, x: acc.bitwise_xor_(x),
}


def _gap(what: str) -> RuntimeError:
    return RuntimeError(
        f"standin CCL: {what} is not supported (a gap declared on purpose, like a vendor CCL's); "
        "route the call through portspeed.comm.router, which rewrites it"
    )


def _done(result: Any = None) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class StandinProcessGroup(dist.ProcessGroup):
    """A Python c10d backend: ring collectives over an inner Gloo point-to-point group."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._p2p = dist.ProcessGroupGloo(dist.PrefixStore("standin-p2p", store), rank, size, timeout)
        # the flight recorder (PORTSPEED_TRACE) lists the inner group as staging and records its ring steps
        self._trace = trace_staging.label(BACKEND_NAME, rank, size, "inner Gloo group of its ring collectives")

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"<StandinProcessGroup rank={self._rank} size={self._size}>"

    def _get_backend(self, device: Any) -> Any:
        """The backend for ``device``: this group itself, since a Python process group registers none.

        Why: torch 2.14's ``batch_isend_irecv`` asks any ``ProcessGroup`` instance (2.13 asked
        only torch's own class) for its backend, then reads ``supports_coalescing`` with a
        default; the C++ lookup raises for a Python group. Answering ``self`` (no such
        attribute) takes torch's one-op-at-a-time path, as 2.13 did.
        """
        try:
            return super()._get_backend(device)
        except RuntimeError:
            return self

    # ------------------------------------------------------------------ checks
    def _check_op(self, opts: Any, what: str) -> Any:
        op = op_type(opts.reduceOp)
        if op == RedOpType.AVG:
            raise _gap(f"ReduceOp.AVG in {what}")
        if op == RedOpType.PREMUL_SUM or op not in _COMBINE:
            raise _gap(f"ReduceOp.{op.name} in {what}")
        return op

    @staticmethod
    def _check_tensors(tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type != "cpu":
                raise RuntimeError(f"standin CCL takes CPU tensors only, got one on {t.device}")

    # ------------------------------------------------------------------ ring primitives
    def _exchange(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> None:
        works = []
        staged = trace_staging.stage(self._trace, BACKEND_NAME, send, dst, recv, src) if self._trace else None
        if send is not None and send.numel():
            works.append(self._p2p.send([send], dst, _TAG))
        if recv is not None and recv.numel():
            works.append(self._p2p.recv([recv], src, _TAG))
        for w in works:
            w.wait()
        if staged:
            trace_staging.staged_done(staged)

    def _ring_reduce_scatter(self, chunks: list[torch.Tensor], op: Any) -> None:
        """In place: afterwards chunks[rank] holds the reduction of every rank's chunks[rank]."""
        n, r = self._size, self._rank
        right, left = (r + 1) % n, (r - 1) % n
        combine = _COMBINE[op]
        for s in range(n - 1):
            out_c, in_c = chunks[(r - s - 1) % n], chunks[(r - s - 2) % n]
            buf = torch.empty_like(in_c)
            self._exchange(out_c, right, buf, left)
            combine(in_c, buf)

    def _ring_all_gather(self, chunks: list[torch.Tensor]) -> None:
        """In place: chunks[rank] is known locally; afterwards every chunk is filled."""
        n, r = self._size, self._rank
        right, left = (r + 1) % n, (r - 1) % n
        for s in range(n - 1):
            self._exchange(chunks[(r - s) % n], right, chunks[(r - s - 1) % n], left)

    def _allreduce_one(self, t: torch.Tensor, op: Any) -> None:
        flat = t.detach().reshape(-1).contiguous().clone()
        chunks = list(flat.tensor_split(self._size))
        # rank r finishes chunk r+1, so chunk c is summed as (x_c + x_c+1) + ...: another
        # pairing than Gloo's ring, whose float sums therefore differ in the last bits
        rotated = chunks[1:] + chunks[:1]
        self._ring_reduce_scatter(rotated, op)
        self._ring_all_gather(rotated)
        t.copy_(flat.view_as(t))

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = self._check_op(opts, "all_reduce")
        self._check_tensors(tensors)
        for t in tensors:
            self._allreduce_one(t, op)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        op = self._check_op(opts, "reduce")
        self._check_tensors(tensors)
        for t in tensors:
            tmp = t.detach().clone()
            self._allreduce_one(tmp, op)
            if self._rank == opts.rootRank:
                t.copy_(tmp)
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        self._check_tensors(tensors)
        n, r, root = self._size, self._rank, opts.rootRank
        pos = (r - root) % n  # place in the chain root -> root+1 -> ...
        for t in tensors:
            buf = t.detach().contiguous().clone()
            if pos > 0:
                self._exchange(None, 0, buf, (r - 1) % n)
            if pos < n - 1:
                self._exchange(buf, (r + 1) % n, None, 0)
            if pos > 0:
                t.copy_(buf)
        return _done(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        self._check_tensors(input_tensors)
        for outs, inp in zip(output_tensors, input_tensors):
            bufs = [o.detach().contiguous().clone() if not o.is_contiguous() else o for o in outs]
            bufs[self._rank].copy_(inp)
            self._ring_all_gather(bufs)
            for o, b in zip(outs, bufs):
                if o is not b:
                    o.copy_(b)
        return _done(output_tensors)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        self._check_tensors([input])
        flat = torch.empty(output.numel(), dtype=output.dtype)
        chunks = list(flat.tensor_split(self._size))
        chunks[self._rank].copy_(input.reshape(-1))
        self._ring_all_gather(chunks)
        output.copy_(flat.view_as(output))
        return _done([output])

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _done(outputs)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any) -> dist.Work:
        op = self._check_op(opts, "reduce_scatter")
        for out, inputs in zip(output_tensors, input_lists):
            if out.dtype == torch.bfloat16:
                raise _gap("bfloat16 in reduce_scatter")
            self._check_tensors(list(inputs))
            chunks = [t.detach().reshape(-1).contiguous().clone() for t in inputs]
            self._ring_reduce_scatter(chunks, op)
            out.copy_(chunks[self._rank].view_as(out))
        return _done(output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        op = self._check_op(opts, "reduce_scatter_tensor")
        if input.dtype == torch.bfloat16:
            raise _gap("bfloat16 in reduce_scatter_tensor")
        self._check_tensors([input])
        chunks = list(input.detach().reshape(-1).contiguous().clone().tensor_split(self._size))
        self._ring_reduce_scatter(chunks, op)
        output.copy_(chunks[self._rank].view_as(output))
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> dist.Work:
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _done(outputs)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        raise _gap("the list all_to_all")

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        self._check_tensors([input])
        n, r = self._size, self._rank
        out = output if output.is_contiguous() else output.contiguous()
        inp = input.contiguous()
        outs = out.split(list(output_split_sizes) or out.shape[0] // n)
        ins = inp.split(list(input_split_sizes) or inp.shape[0] // n)
        outs[r].copy_(ins[r])
        for k in range(1, n):  # pairwise exchange: step k talks to r+k and r-k
            self._exchange(ins[(r + k) % n], (r + k) % n, outs[(r - k) % n], (r - k) % n)
        if out is not output:
            output.copy_(out)
        return _done([output])

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any) -> dist.Work:
        self._check_tensors(input_tensors)
        root, r = opts.rootRank, self._rank
        inp = input_tensors[0].contiguous()
        if r == root:
            for peer, o in enumerate(output_tensors[0]):
                if peer == r:
                    o.copy_(inp)
                else:
                    buf = torch.empty_like(o, memory_format=torch.contiguous_format)
                    self._exchange(None, 0, buf, peer)
                    o.copy_(buf)
        else:
            self._exchange(inp, root, None, 0)
        return _done(output_tensors)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any) -> dist.Work:
        self._check_tensors(output_tensors)
        root, r = opts.rootRank, self._rank
        out = output_tensors[0]
        if r == root:
            for peer, t in enumerate(input_tensors[0]):
                if peer == r:
                    out.copy_(t)
                else:
                    self._exchange(t.contiguous(), peer, None, 0)
        else:
            buf = torch.empty_like(out, memory_format=torch.contiguous_format)
            self._exchange(None, 0, buf, root)
            out.copy_(buf)
        return _done(output_tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        self._allreduce_one(torch.zeros(1), RedOpType.SUM)
        return _done(None)

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        self._check_tensors(tensors)
        return self._p2p.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        self._check_tensors(tensors)
        return self._p2p.recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._p2p.recv_anysource(tensors, tag)

    # torch before 2.13 calls these names (run on 2.6.0 and 2.8.0: a Python group is the group itself there)
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> StandinProcessGroup:
    return StandinProcessGroup(store, rank, size, timeout)


_registered = threading.Lock()


def register() -> None:
    """Register the ``standin`` backend with torch.distributed (idempotent)."""
    with _registered:
        if BACKEND_NAME in getattr(dist.Backend, "backend_list", []) or hasattr(dist.Backend, BACKEND_NAME.upper()):
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])


class StandinAccelerator(CpuAccelerator):
    """The CPU adapter on the stand-in vendor backend; never auto-detected."""

    name = "standin"
    backend = BACKEND_NAME
    verified_on_hardware = False
    backend_gaps = BackendGaps(
        unsupported_ops=(RedOpType.AVG, RedOpType.PREMUL_SUM),
        unsupported_dtypes=(("reduce_scatter", torch.bfloat16), ("reduce_scatter_tensor", torch.bfloat16)),
        unsupported_collectives=("all_to_all",),
        note="stand-in backend declares this gap on purpose, like a vendor CCL",
        sends_from_buffer=True,  # its send is the inner Gloo send of the caller's tensor
        # not groups_hold_host_threads, although each group wraps a Gloo group: torch 2.13 cannot destroy one
        # sub-group of a Python backend ("ProcessGroup name not set"), so they stay as Megatron leaves them
    )

    @classmethod
    def detect(cls) -> bool:
        return False

    @classmethod
    def load_vendor(cls) -> None:
        register()

    def __init__(self, backend: str | None = None) -> None:
        register()
        super().__init__(backend)


register()
