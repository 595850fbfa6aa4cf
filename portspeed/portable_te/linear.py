"""``te.pytorch.Linear`` and ``te.pytorch.LayerNormLinear``: tensor-parallel linear layers on plain torch.

Why: Megatron's ``TELinear`` / ``TEColumnParallelLinear`` / ``TERowParallelLinear`` /
``TELayerNormColumnParallelLinear`` subclass these and leave the tensor-parallel work to them:

- ``parallel_mode="column"``: the weight is ``[out / tp, in]``; the input is copied to the group
  (its gradient all-reduced), or with ``sequence_parallel`` all-gathered along the sequence
  (dim 0; the gradient reduce-scattered); the output stays partitioned.
- ``parallel_mode="row"``: the weight is ``[out, in / tp]``; the partial output is all-reduced,
  or with ``sequence_parallel`` reduce-scattered along the sequence; the bias (whole) is added
  after the reduction, or handed back with ``return_bias``.
- ``parallel_mode=None``: a plain linear layer (no communication; Megatron builds its tensor-parallel
  experts this way and does their communication itself).
- parameter attributes exactly as TE sets them: every weight ``tensor_model_parallel`` (``partition_dim``
  1 for ``row``, else 0), ``None`` included, so each expert shard counts in Megatron's grad norm; a
  ``column`` bias tensor-parallel, a ``row`` bias and the norm parameters ``sequence_parallel`` when
  sequence parallelism is on over more than one rank.
- ``LayerNormLinear`` (column mode): LayerNorm / RMSNorm on the local sequence shard, then the
  gather, then the linear layer (``layer_norm_weight`` / ``layer_norm_bias`` parameters).
- ``fuse_wgrad_accumulation`` (Megatron passes its ``gradient_accumulation_fusion``): the weight
  gradient is added straight into ``weight.main_grad`` (in fp32 when main_grad is fp32, like TE's
  fused GEMM) and a placeholder goes to autograd, marked ``grad_added_to_main_grad`` so Megatron's
  DDP hook does not add it again.
- weights are initialised by ``init_method`` on the local shard inside the RNG tracker's fork
  (``rng_tracker_name``), as TE does; biases start at zero.

Refused (``refuse.py``): userbuffers overlap (``ub_overlap_*``, ``ub_bulk_*``, ...),
``delay_wgrad_compute``, ``symmetric_ar_type``, ``return_layernorm_output``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import comm
from .base import PortableModule, check_config, resolve_device, set_tp_attributes, tracker_fork
from .norms import layer_norm, rms_norm
from .refuse import refuse, refuse_if

__all__ = ["Linear", "LayerNormLinear", "check_linear_options", "linear_into_main_grad"]

#: keyword -> (option as the user names it, how to avoid it)
_REFUSED = {
    "delay_wgrad_compute": ("delayed weight-gradient computation (--delay-wgrad-compute)",
                            "drop --delay-wgrad-compute"),
    "symmetric_ar_type": ("symmetric-memory all-reduce (--symmetric-ar-type)", "drop --symmetric-ar-type"),
    "return_layernorm_output": ("LayerNormLinear(return_layernorm_output=True)", "use a spec without it"),
}
_UB = ("tensor-parallel communication overlap with userbuffers (--tp-comm-overlap)", "drop --tp-comm-overlap")
_IGNORED = {"ub_name", "rng_tracker_name", "tp_size", "name", "save_original_input"}


def check_linear_options(kwargs: dict[str, Any]) -> None:
    """Refuse the TE linear options the portable layers cannot honour (userbuffers, delayed wgrad, ...)."""
    for key, value in kwargs.items():
        if key.startswith("ub_") and key != "ub_name":
            refuse_if(value, *_UB)
        elif key in _REFUSED:
            refuse_if(value, *_REFUSED[key])
        elif key not in _IGNORED and value not in (None, False):
            refuse(f"the Transformer Engine linear option {key}={value!r}", f"do not pass {key}")


class _FusedWgradLinear(torch.autograd.Function):
    """y = x W^T whose weight gradient goes into ``weight.main_grad`` (TE's fuse_wgrad_accumulation)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight)
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        main_grad = weight.main_grad
        main_grad.add_(g2.to(main_grad.dtype).t().matmul(x2.to(main_grad.dtype)))
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            return grad_x, make(weight.shape, dtype=weight.dtype, device=weight.device)
        return grad_x, None


def linear_into_main_grad(x: torch.Tensor, weight: torch.Tensor, fuse_wgrad_accumulation: bool) -> torch.Tensor:
    """``x W^T``; with ``fuse_wgrad_accumulation`` and a ``weight.main_grad``, the weight gradient goes there."""
    if fuse_wgrad_accumulation and weight.requires_grad and hasattr(weight, "main_grad"):
        return _FusedWgradLinear.apply(x, weight)
    return F.linear(x, weight)


class _ParallelLinear(PortableModule):
    """The linear part shared by Linear and LayerNormLinear."""

    def _init_linear(self, in_features: int, out_features: int, *, bias: bool, return_bias: bool,
                     parallel_mode: str | None, tp_group: Any, tp_size: int, sequence_parallel: bool,
                     fuse_wgrad_accumulation: bool, init_method: Callable | None,
                     get_rng_state_tracker: Callable | None, rng_tracker_name: str | None,
                     params_dtype: torch.dtype | None, device: Any) -> None:
        if parallel_mode not in (None, "column", "row"):
            refuse(f"parallel_mode={parallel_mode!r}", "use 'column', 'row' or None")
        self.tp_group = tp_group
        self.tp_size = comm.group_size(tp_group) if tp_group is not None else int(tp_size or 1)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = bool(sequence_parallel) and parallel_mode is not None
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.in_features, self.out_features = in_features, out_features
        if parallel_mode == "column":
            self.out_features = _divide(out_features, self.tp_size)
        elif parallel_mode == "row":
            self.in_features = _divide(in_features, self.tp_size)
        dtype = params_dtype or torch.get_default_dtype()
        dev = resolve_device(device)
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=dtype, device=dev))
        bias_size = self.out_features
        self.bias = torch.nn.Parameter(torch.empty(bias_size, dtype=dtype, device=dev)) if bias else None
        # The attributes NVIDIA's TE sets (v2.6 transformer_engine/pytorch/module/linear.py:1285-1304, the same in
        # layernorm_linear.py:1412-1436): the weight is tensor-parallel in EVERY mode, None included (Megatron
        # builds tensor-parallel experts with parallel_mode=None and counts their shards in the grad norm by this
        # mark; it unmarks its "duplicated" linears itself from megatron-core 0.17); the bias by the mode.
        set_tp_attributes(self.weight, True, 1 if parallel_mode == "row" else 0)
        if self.bias is not None:
            if parallel_mode == "row":
                mark = self._sequence_parallel_mark(sequence_parallel)
                self.bias.sequence_parallel = mark  # type: ignore[attr-defined]
            elif parallel_mode == "column":
                set_tp_attributes(self.bias, True, 0)
        if dev.type != "meta":
            with torch.no_grad():
                if init_method is not None:
                    with tracker_fork(get_rng_state_tracker, rng_tracker_name):
                        init_method(self.weight)
                if self.bias is not None:
                    self.bias.zero_()

    def _sequence_parallel_mark(self, sequence_parallel: bool) -> bool:
        """The ``sequence_parallel`` attribute TE puts on parameters: only with more than one tensor-parallel rank."""
        return self.tp_size > 1 and bool(sequence_parallel)

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """Set the group after construction (Megatron builds some modules before its groups exist)."""
        self.tp_group = tp_group

    def _linear(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x is the (normalised) input on this rank: gather/copy, multiply, reduce, bias."""
        group = self.tp_group
        if self.parallel_mode == "column":
            x = comm.gather_sequence(x, group) if self.sequence_parallel else comm.copy_to_group(x, group)
        add_bias_inside = self.bias is not None and not self.return_bias and self.parallel_mode != "row"
        if self.fuse_wgrad_accumulation and self.weight.requires_grad and hasattr(self.weight, "main_grad"):
            out = _FusedWgradLinear.apply(x, self.weight)
            if add_bias_inside:
                out = out + self.bias
        else:
            out = F.linear(x, self.weight, self.bias if add_bias_inside else None)
        if self.parallel_mode == "row":
            if self.sequence_parallel:
                out = comm.reduce_scatter_sequence(out, group)
            else:
                out = comm.reduce_from_group(out, group)
            if self.bias is not None and not self.return_bias:
                out = out + self.bias
        if self.return_bias:
            return out, (self.bias if self.bias is not None else torch.empty(0, dtype=out.dtype, device=out.device))
        return out


def _divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by the tensor-parallel size {d}")
    return n // d


class Linear(_ParallelLinear):
    """``te.pytorch.Linear(in_features, out_features, ...)`` (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Callable | None = None, init_method: Callable | None = None,
                 bias: bool = True, return_bias: bool = False, params_dtype: torch.dtype | None = None,
                 parallel_mode: str | None = None, device: Any = None, rng_tracker_name: str | None = None,
                 **options: Any) -> None:
        super().__init__()
        check_config(self)
        check_linear_options(options)
        self.ub_name = options.get("ub_name")
        self._init_linear(in_features, out_features, bias=bias, return_bias=return_bias, parallel_mode=parallel_mode,
                          tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
                          fuse_wgrad_accumulation=fuse_wgrad_accumulation, init_method=init_method,
                          get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=rng_tracker_name,
                          params_dtype=params_dtype, device=device)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                **unsupported: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _check_forward(unsupported)
        return self._linear(inp)


class LayerNormLinear(_ParallelLinear):
    """``te.pytorch.LayerNormLinear``: a norm (``normalization`` LayerNorm / RMSNorm) then a Linear."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Callable | None = None, init_method: Callable | None = None,
                 bias: bool = True, normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: torch.dtype | None = None, parallel_mode: str | None = None,
                 zero_centered_gamma: bool = False, device: Any = None, rng_tracker_name: str | None = None,
                 **options: Any) -> None:
        super().__init__()
        check_config(self)
        check_linear_options(options)
        if normalization not in ("LayerNorm", "RMSNorm"):
            refuse(f"normalization={normalization!r}", "use --normalization LayerNorm or RMSNorm")
        self.ub_name = options.get("ub_name")
        self.normalization, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        dtype = params_dtype or torch.get_default_dtype()
        dev = resolve_device(device)
        self.layer_norm_weight = torch.nn.Parameter(torch.empty(in_features, dtype=dtype, device=dev))
        self.layer_norm_bias = (torch.nn.Parameter(torch.empty(in_features, dtype=dtype, device=dev))
                                if normalization == "LayerNorm" else None)
        if dev.type != "meta":
            with torch.no_grad():
                self.layer_norm_weight.fill_(0.0 if zero_centered_gamma else 1.0)
                if self.layer_norm_bias is not None:
                    self.layer_norm_bias.zero_()
        self._init_linear(in_features, out_features, bias=bias, return_bias=return_bias, parallel_mode=parallel_mode,
                          tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
                          fuse_wgrad_accumulation=fuse_wgrad_accumulation, init_method=init_method,
                          get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=rng_tracker_name,
                          params_dtype=params_dtype, device=device)
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = self._sequence_parallel_mark(sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                **unsupported: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _check_forward(unsupported)
        if self.normalization == "LayerNorm":
            x = layer_norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma)
        else:
            x = rms_norm(inp, self.layer_norm_weight, self.eps, self.zero_centered_gamma)
        return self._linear(x)


def _check_forward(kwargs: dict[str, Any]) -> None:
    for key, value in kwargs.items():
        refuse_if(value, f"the Transformer Engine forward option {key}={value!r} (fp8 output / quantised input)",
                  "drop the fp8 flags (--fp8-format, --fp8-recipe)")
