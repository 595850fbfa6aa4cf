"""``te.pytorch.GroupedLinear``: the MoE experts' grouped GEMM (``--moe-grouped-gemm``) on plain torch.

Why: with ``--moe-grouped-gemm`` Megatron's TE spec builds ``TEGroupedMLP``, whose
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` subclass this layer. It
holds one weight per local expert (``weight0`` ... ``weight{n-1}``, and ``bias{i}``) and
multiplies the expert-sorted tokens in one call: ``forward(x, m_splits)`` takes the first
``m_splits[0]`` rows through expert 0, the next ``m_splits[1]`` through expert 1, and so on.
NVIDIA's layer does this in one grouped CUDA kernel; here it is one matmul per expert, the
same arithmetic ``SequentialMLP`` does, so a grouped and a sequential run of the same
checkpoint agree (Megatron gives both the same distributed-checkpoint keys).

What Megatron relies on, kept:

- the expert communication is Megatron's (its token dispatcher): it builds the layer with
  ``parallel_mode=None`` and ``tp_size=1`` whenever expert tensor or expert parallelism is on,
  so the layer itself never communicates. A tensor-parallel group of more than one rank with a
  parallel mode would need TE's own communication, which Megatron does not ask for: refused;
- every weight is marked tensor-parallel (dim 1 for ``row``, else 0), as TE marks it, so each
  shard counts in the gradient norm; biases follow TE's row / column rule;
- ``fuse_wgrad_accumulation``: each weight gradient goes into its ``main_grad``
  (``linear.linear_into_main_grad``);
- ``return_bias``: the biases come back as a list, one per expert (Megatron adds them per
  expert after the activation);
- the fp8 bookkeeping Megatron's checkpoint hooks read (``fp8``, ``fp8_calibration``,
  ``fp8_meta["fp8_checkpoint"]``, ``init_fp8_metadata``) answers "no fp8", so one
  ``_extra_state`` entry per layer is saved and split per expert as Megatron expects.

The multiplication itself is the kernel registry's choice (``kernels``, op ``grouped_mm``): a
vendor's grouped kernel, else torch's ``grouped_mm`` for the dtypes the adapter declares
(``Accelerator.has_grouped_mm``: the CUDA adapter, bf16 on compute capability >= 8.0), else the loop
above. The per-expert weights (and so the checkpoint keys) stay as they are: a grouped kernel gets
them stacked at call time (one copy of the expert weights per step, the cost of keeping the keys),
and with ``fuse_wgrad_accumulation`` into ``main_grad`` the loop runs (the grouped kernels write
``.grad``).

Refused, by the same words as the other layers: userbuffers, ``delay_wgrad_compute`` and other
options in ``linear.check_linear_options``; fp8 through the Megatron config (``check_config``).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from portspeed.accelerator import selection

from . import comm
from .base import PortableModule, check_config, resolve_device, set_tp_attributes, tracker_fork
from .kernels import kernel, served
from .linear import check_linear_options, linear_into_main_grad
from .refuse import refuse

__all__ = ["GroupedLinear", "grouped_mm_reference", "grouped_mm_torch", "torch_grouped_mm_serves"]

log = logging.getLogger("portspeed")
_TORCH_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # public from 2.10
#: (adapter selection generation, dtype) -> whether the adapter declares torch's grouped kernel for it
_declared: dict[tuple[int, torch.dtype], bool] = {}


def grouped_mm_reference(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The ``grouped_mm`` contract as a loop of matmuls (one host read of ``offsets``)."""
    ends = [int(e) for e in offsets.tolist()]
    starts = [0] + ends[:-1]
    return torch.cat([x[s:e] @ weights[i] for i, (s, e) in enumerate(zip(starts, ends))])


def torch_grouped_mm_serves(dtype: torch.dtype) -> bool:
    """Whether torch's grouped kernel serves ``dtype`` here: the active adapter declares it (logged once per dtype)."""
    key = (selection._generation, dtype)
    ok = _declared.get(key)
    if ok is None:
        acc = selection.get_accelerator()
        ok = _declared[key] = _TORCH_GROUPED_MM is not None and bool(acc.has_grouped_mm(dtype))
        log.info("portspeed: grouped GEMM in %s on adapter %r: %s", dtype, acc.name,
                 "torch's grouped_mm" if ok else "a loop of matmuls (the adapter declares no grouped kernel for it)")
    return ok


def _aligned(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """torch's grouped kernels want every non-unit stride (and the output's rows) on 16 bytes."""
    size = x.element_size()
    strides = [s for s in (*x.stride(), *weights.stride(), weights.shape[-1]) if s != 1]
    return all(s * size % 16 == 0 for s in strides)


def grouped_mm_torch(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The ``grouped_mm`` contract on torch's grouped kernel for declared dtypes, else the loop."""
    if not (torch_grouped_mm_serves(x.dtype) and _aligned(x, weights)):
        return grouped_mm_reference(x, weights, offsets)
    out = _TORCH_GROUPED_MM(x, weights, offs=offsets)
    if out.requires_grad:  # torch's fallback (a loop) refuses an expanded (stride 0) gradient: make it dense
        out.register_hook(lambda g: g.contiguous())
    return out


class GroupedLinear(PortableModule):
    """``te.pytorch.GroupedLinear(num_gemms, in_features, out_features, ...)``: one linear layer per expert."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Callable | None = None, rng_tracker_name: str | None = None,
                 init_method: Callable | None = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: torch.dtype | None = None, parallel_mode: str | None = None, device: Any = "cuda",
                 **options: Any) -> None:
        super().__init__()
        check_config(self)
        check_linear_options(options)
        if parallel_mode not in (None, "column", "row"):
            refuse(f"GroupedLinear(parallel_mode={parallel_mode!r})", "use 'column', 'row' or None")
        tp = comm.group_size(tp_group) if tp_group is not None else int(tp_size or 1)
        if tp > 1 and parallel_mode is not None:
            refuse(f"GroupedLinear's own tensor-parallel communication (parallel_mode={parallel_mode!r} on "
                   f"{tp} ranks)", "let Megatron's token dispatcher do the expert communication, as its "
                   "TEGroupedMLP does (parallel_mode=None)")
        self.num_gemms = int(num_gemms)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.parallel_mode, self.tp_group, self.tp_size = parallel_mode, tp_group, tp
        self.sequence_parallel = bool(sequence_parallel)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.ub_name = options.get("ub_name")
        # the fp8 state Megatron's checkpoint hooks read: none
        self.fp8 = self.fp8_calibration = self.primary_weights_in_fp8 = False
        self.fp8_meta: dict[str, Any] = {"fp8_checkpoint": False, "recipe": None}
        dtype = params_dtype or torch.get_default_dtype()
        dev = resolve_device(device)
        for i in range(self.num_gemms):
            weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=dtype, device=dev))
            set_tp_attributes(weight, True, 1 if parallel_mode == "row" else 0)
            self.register_parameter(f"weight{i}", weight)
            if self.use_bias:
                b = torch.nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=dev))
                if parallel_mode == "row":
                    b.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
                elif parallel_mode == "column":
                    set_tp_attributes(b, True, 0)
                self.register_parameter(f"bias{i}", b)
            else:
                setattr(self, f"bias{i}", torch.empty(0, dtype=dtype, device=dev))
        if dev.type != "meta":
            self._init_parameters(init_method, get_rng_state_tracker, rng_tracker_name)

    def _init_parameters(self, init_method: Callable | None, get_rng_state_tracker: Callable | None,
                         rng_tracker_name: str | None) -> None:
        """Each weight by ``init_method`` inside the RNG tracker's fork (in expert order), biases zero, as TE does."""
        with torch.no_grad():
            for i in range(self.num_gemms):
                if init_method is not None:
                    with tracker_fork(get_rng_state_tracker, rng_tracker_name):
                        init_method(getattr(self, f"weight{i}"))
                if self.use_bias:
                    getattr(self, f"bias{i}").zero_()

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Nothing to set up: there is no fp8 (Megatron calls it before loading a checkpoint)."""

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """Set the group after construction (Megatron builds some modules before its groups exist)."""
        self.tp_group = tp_group

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Rows ``m_splits[i]`` of ``inp`` (expert-sorted tokens) through expert ``i``; outputs in the same order."""
        splits = [int(m) for m in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]
        if len(splits) != self.num_gemms:
            raise ValueError(f"GroupedLinear has {self.num_gemms} experts but was given {len(splits)} splits")
        x = inp.reshape(-1, self.in_features)
        if sum(splits) != x.shape[0]:
            raise ValueError(f"GroupedLinear: the splits {splits} add up to {sum(splits)}, the input has "
                             f"{x.shape[0]} rows")
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        fn = kernel("grouped_mm")
        impl = served(fn)  # the kernel under a probe's recording wrapper
        if not (impl is grouped_mm_reference or self.fuse_wgrad_accumulation
                or (impl is grouped_mm_torch and not torch_grouped_mm_serves(x.dtype))):
            return self._grouped(fn, x, inp, splits, biases)
        outs = []
        for i, chunk in enumerate(torch.split(x, splits)):
            out = linear_into_main_grad(chunk, getattr(self, f"weight{i}"), self.fuse_wgrad_accumulation)
            if self.use_bias and not self.return_bias:
                out = out + biases[i]
            outs.append(out)
        out = torch.cat(outs).reshape(*inp.shape[:-1], self.out_features)
        if self.return_bias:
            return out, biases
        return out

    def _grouped(self, fn: Callable, x: torch.Tensor, inp: torch.Tensor, splits: list[int],
                 biases: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """One grouped GEMM over the expert weights stacked as ``[g, in, out]``; biases added per row block."""
        weights = torch.stack([getattr(self, f"weight{i}") for i in range(self.num_gemms)]).transpose(1, 2)
        offsets = torch.tensor(list(itertools.accumulate(splits)), dtype=torch.int32, device=x.device)
        out = fn(x, weights, offsets)
        if self.use_bias and not self.return_bias:
            out = out + torch.repeat_interleave(torch.stack(biases), torch.tensor(splits, device=x.device), dim=0,
                                                output_size=x.shape[0])
        out = out.reshape(*inp.shape[:-1], self.out_features)
        if self.return_bias:
            return out, biases
        return out
