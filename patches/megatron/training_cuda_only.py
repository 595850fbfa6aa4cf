"""Megatron-LM options whose only implementation is CUDA machinery: refused at start-up, naming the flag.

Why: each of these options is accepted by Megatron's argument validation on any machine and
then fails far from the command line, or not at all where it should: context parallelism with
``--transformer-impl local`` builds the model and dies in the local ``DotProductAttention``
("Context parallelism is only supported by TEDotProductAttention!") after the process groups and
data are set up (on the TE path, Megatron-LM's default, the portable Transformer Engine's attention
does context parallelism, so nothing is refused there); CUDA
graph capture, DeepEP / HybridEP / NCCL-EP token dispatch and Transformer Engine's
userbuffers overlap need CUDA kernels or libraries that no other adapter has. Off CUDA
(the ``translated`` condition) the arguments are checked *before* Megatron validates them,
so the user's own spelling of the flag is still there (Megatron rewrites
``--enable-cuda-graph`` into ``cuda_graph_impl``), and one error lists every such flag with
what it needs and what to do instead.

The flag names were read from Megatron-LM core_v0.16.1 and core_v0.19.0 (``arguments.py``
and the ``TransformerConfig`` fields it turns into flags): ``--context-parallel-size``,
``--enable-cuda-graph``, ``--external-cuda-graph``, ``--cuda-graph-impl`` (``local``,
``transformer_engine``; ``full_iteration`` from 0.19), ``--moe-token-dispatcher-type flex``
with ``--moe-flex-dispatcher-backend`` (``deepep``, ``hybridep``; ``ncclep`` from 0.19) or
the deprecated ``--moe-enable-deepep``, ``--tp-comm-overlap``, and ``--moe-grouped-gemm`` with
``--transformer-impl local`` or ``--moe-use-legacy-grouped-gemm`` (the legacy GroupedMLP's
``grouped_gemm`` kernels; on the TE path the portable Transformer Engine runs grouped experts), and
``--log-straggler`` (megatron-core's ``StragglerDetector``: CUDA events, and NVML's temperature, power,
utilization and clock in every report; refused rather than served because no other device has those
readings to report, and ``portspeed compare --perf`` names the slow rank on every backend).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.errors import UnsupportedOptionError
from portspeed.patching.record import WRAP, Patch

from ._training_common import portable_te_path
from .ranges import DISTRIBUTION, TRAINING

__all__ = ["PATCHES", "refusals", "refuse_cuda_only_options"]


def _te_missing(adapter: str) -> str:
    """What is missing of Transformer Engine on this machine, in words."""
    try:
        installed = importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        installed = False
    if installed:
        return f"Transformer Engine is installed but runs on CUDA only, not on the {adapter} adapter"
    return f"Transformer Engine (transformer_engine) is not installed, and it runs on CUDA only"


def _context_parallel(args: Any, adapter: str) -> list[str]:
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp <= 1 or portable_te_path(args):
        return []  # on the TE path the portable Transformer Engine's attention does context parallelism
    return [f"--context-parallel-size {cp}: context parallelism needs Transformer Engine's attention "
            f"(TEDotProductAttention); Megatron's local DotProductAttention asserts a context-parallel size of 1, "
            f"and {_te_missing(adapter)}. Leave --transformer-impl at its default (portspeed's portable Transformer "
            f"Engine does context parallelism), or use --context-parallel-size 1 and split the model with tensor, "
            f"pipeline or data parallelism"]


def _cuda_graphs(args: Any, adapter: str) -> list[str]:
    out = []
    what = "CUDA graph capture and replay (torch.cuda.CUDAGraph), which exists on CUDA only"
    if getattr(args, "enable_cuda_graph", False):
        out.append(f"--enable-cuda-graph: {what}; drop it")
    if getattr(args, "external_cuda_graph", False):
        out.append(f"--external-cuda-graph: {what} (through Transformer Engine); drop it")
    impl = getattr(args, "cuda_graph_impl", "none")
    if impl not in (None, "none"):
        out.append(f"--cuda-graph-impl {impl}: {what}; use --cuda-graph-impl none (the default)")
    return out


#: flex dispatcher backend -> what it is
FLEX_BACKENDS = {
    "deepep": "DeepEP's CUDA all-to-all kernels",
    "hybridep": "HybridEP's CUDA kernels (DeepEP's hybrid-ep branch)",
    "ncclep": "NCCL EP through Transformer Engine (transformer_engine.pytorch.ep)",
}


def _flex_dispatcher(args: Any, adapter: str) -> list[str]:
    out = []
    if getattr(args, "moe_token_dispatcher_type", None) == "flex":
        backend = "deepep" if getattr(args, "moe_enable_deepep", False) else \
            getattr(args, "moe_flex_dispatcher_backend", "deepep")
        needs = FLEX_BACKENDS.get(backend, f"the {backend!r} backend's CUDA kernels")
        out.append(f"--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend {backend}): {needs}; use "
                   f"--moe-token-dispatcher-type alltoall (or allgather), Megatron's dispatchers over "
                   f"torch.distributed")
    if getattr(args, "moe_enable_deepep", False):
        out.append(f"--moe-enable-deepep: {FLEX_BACKENDS['deepep']}; drop it and use --moe-token-dispatcher-type "
                   f"alltoall")
    return out


def _userbuffers(args: Any, adapter: str) -> list[str]:
    if not getattr(args, "tp_comm_overlap", False):
        return []
    return ["--tp-comm-overlap: Transformer Engine's userbuffers (tensor-parallel communication overlapped with "
            "the GEMMs in CUDA kernels); drop it (--overlap-grad-reduce and --overlap-param-gather work on every "
            "adapter)"]


def _local_grouped_gemm(args: Any, adapter: str) -> list[str]:
    if not getattr(args, "moe_grouped_gemm", False):
        return []
    if getattr(args, "moe_use_legacy_grouped_gemm", False):
        how = "--moe-use-legacy-grouped-gemm"
    elif getattr(args, "transformer_impl", "transformer_engine") == "local":
        how = "--transformer-impl local"
    else:
        return []  # the TE path: the portable Transformer Engine's GroupedLinear (training_arguments.py)
    return [f"--moe-grouped-gemm with {how}: Megatron's legacy GroupedMLP, whose grouped_gemm package has CUDA "
            f"kernels only (Megatron-LM asserts a CUDA compute capability >= 8 for it); leave --transformer-impl at "
            f"its default without {how} (portspeed's portable Transformer Engine runs the grouped experts on the "
            f"{adapter} adapter), or drop --moe-grouped-gemm"]


def _log_straggler(args: Any, adapter: str) -> list[str]:
    if not getattr(args, "log_straggler", False):
        return []
    return ["--log-straggler: Megatron's StragglerDetector times with CUDA events and reports each GPU's temperature, "
            "power, utilization and clock through NVML (NVIDIA only; off CUDA it fails at the first log interval); "
            "drop it, record with `portspeed run --perf DIR` (PORTSPEED_PERF=DIR under torchrun), then "
            "`portspeed compare --perf DIR` names the slow rank"]


#: every check: (args, adapter name) -> one line per offending flag
CHECKS: tuple[Callable[[Any, str], list[str]], ...] = (_context_parallel, _cuda_graphs, _flex_dispatcher,
                                                       _userbuffers, _local_grouped_gemm, _log_straggler)


def refusals(args: Any, adapter: str) -> list[str]:
    """One line per option in ``args`` that needs CUDA-only machinery (empty: nothing to refuse)."""
    return [line for check in CHECKS for line in check(args, adapter)]


def refuse_cuda_only_options(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of validate_args(args, defaults): raise UnsupportedOptionError before Megatron validates."""
    margs = args[0] if args else kwargs.get("args")
    if margs is not None:
        adapter = get_accelerator().name
        lines = refusals(margs, adapter)
        if lines:
            raise UnsupportedOptionError(
                f"portspeed: Megatron option(s) that need CUDA-only machinery, which the {adapter} adapter does not "
                f"have:\n  " + "\n  ".join(lines))
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(
        name="megatron.training.validate_args.cuda_only",
        target="megatron.training.arguments:validate_args",
        kind=WRAP,
        impl=refuse_cuda_only_options,
        distribution=DISTRIBUTION,
        versions=TRAINING,
        when=translated,
        order=1,  # outside validate_args.torch_paths: nothing runs before the refusal
        reason="context parallelism (Transformer Engine's attention), CUDA graphs, the flex MoE token dispatcher "
        "(DeepEP, HybridEP, NCCL EP), --tp-comm-overlap (userbuffers), the legacy grouped GEMM and --log-straggler "
        "(CUDA events, NVML) need CUDA-only machinery; Megatron "
        "accepts them and fails later or deep inside, so refuse them at start-up naming the flag.",
    ),
]
