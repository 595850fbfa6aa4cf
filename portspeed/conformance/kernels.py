"""Kernel checks of the conformance kit: every vendor kernel an adapter declares, against the reference.

Why: a vendor kernel (``Accelerator.kernels()``, contracts in ``portspeed.accelerator.kernel_ops``)
replaces the portable Transformer Engine's arithmetic wherever it is declared, so a wrong one
silently changes every model. Each declared kernel runs on the adapter's device on small inputs
(fp32 and bf16; masks, causal alignments, grouped-query attention, fully masked rows, partial
rotary dimensions, empty expert groups) and is compared, values and gradients, with the reference
implementation run on the host in fp32 from the same inputs. One check per kernel; its detail names
the first case that fails: the operation, the case (its features, the shapes of its inputs, the
dtype), which output or gradient, the error and the band.

Bands (``portspeed.vendor.KERNEL_BANDS``; the largest difference over the largest magnitude of
the reference, per tensor): fp32 ``1e-4`` (room for a device's own reduction order, tf32
excluded), bf16 ``3e-2`` (a few bf16 roundings; 2^-7 is 7.8e-3).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Iterator

import torch

from portspeed.accelerator.kernel_ops import KERNEL_BANDS, KERNEL_OPS, resolve_kernel
from portspeed.conformance.report import Report

__all__ = ["run_kernel_checks", "BANDS", "compare_kernel", "compare_implementations"]

SUITE = "kernels"
BANDS = KERNEL_BANDS
_DTYPES = (torch.float32, torch.bfloat16)

#: a case: (name, inputs as host fp32 tensors / values, keyword arguments, indices of inputs to differentiate)
Case = tuple[str, tuple[Any, ...], dict[str, Any], tuple[int, ...]]


def _rand(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _attention_cases(gen: torch.Generator) -> Iterator[Case]:
    b, d = 2, 16
    scale = 1 / math.sqrt(d)
    for hq, hkv in ((4, 4), (4, 2)):
        tag = "GQA" if hkv != hq else "MHA"
        for sq, sk, causal in ((16, 16, None), (16, 16, "top_left"), (8, 16, "bottom_right"), (16, 8, "top_left")):
            q, k, v = _rand(b, hq, sq, d, gen=gen), _rand(b, hkv, sk, d, gen=gen), _rand(b, hkv, sk, d, gen=gen)
            yield (f"{tag} sq {sq} sk {sk} causal {causal}", (q, k, v),
                   dict(attn_mask=None, causal=causal, scale=scale, dropout_p=0.0), (0, 1, 2))
        sq = sk = 16
        mask = torch.rand(b, 1, sq, sk, generator=gen) > 0.3
        mask[:, :, 3] = False  # a row with nothing to attend: the mean of v
        q, k, v = _rand(b, hq, sq, d, gen=gen), _rand(b, hkv, sk, d, gen=gen), _rand(b, hkv, sk, d, gen=gen)
        yield (f"{tag} boolean mask with a fully masked row", (q, k, v),
               dict(attn_mask=mask, causal=None, scale=scale, dropout_p=0.0), (0, 1, 2))
        yield (f"{tag} boolean mask and causal", (q, k, v),
               dict(attn_mask=mask, causal="top_left", scale=0.3, dropout_p=0.0), (0, 1, 2))


def _lse_cases(gen: torch.Generator) -> Iterator[Case]:
    b, d = 2, 16
    for hq, hkv in ((4, 4), (4, 2)):
        for sq, sk, causal in ((16, 16, True), (16, 16, False), (8, 16, False)):
            q, k, v = _rand(b, hq, sq, d, gen=gen), _rand(b, hkv, sk, d, gen=gen), _rand(b, hkv, sk, d, gen=gen)
            yield (f"{'GQA' if hkv != hq else 'MHA'} sq {sq} sk {sk} causal {causal}", (q, k, v),
                   dict(causal=causal, scale=1 / math.sqrt(d)), ())


def _lse_backward_cases(gen: torch.Generator) -> Iterator[Case]:
    from portspeed.portable_te.sdpa import attention_lse_reference

    for name, (q, k, v), kw, _ in _lse_cases(gen):
        out, lse = attention_lse_reference(q, k, v, **kw)
        # the final out / lse of a merge: this block's, with the lse raised as if another block held half the mass
        yield name, (torch.randn(out.shape, generator=gen), q, k, v, out * 0.5, lse + math.log(2.0)), kw, ()


def _norm_cases(gen: torch.Generator, op: str) -> Iterator[Case]:
    x = _rand(3, 5, 64, gen=gen) * 2 + 0.5
    w = 1 + 0.1 * _rand(64, gen=gen)
    if op == "rms_norm":
        yield "over the last dimension", (x, w, 1e-5), {}, (0, 1)
    else:
        yield "with bias", (x, w, 0.1 * _rand(64, gen=gen), 1e-5), {}, (0, 1, 2)
        yield "without bias", (x, w, None, 1e-5), {}, (0, 1)


def _rope_cases(gen: torch.Generator) -> Iterator[Case]:
    for rot in (32, 16):
        for interleaved in (False, True):
            half = torch.rand(12, 1, 1, rot // 2, generator=gen) * 6
            freqs = torch.cat((half, half), -1) if not interleaved else half.repeat_interleave(2, -1)
            yield (f"rotary {rot} of 32 channels, interleaved {interleaved}", (_rand(12, 2, 3, 32, gen=gen), freqs),
                   dict(interleaved=interleaved), (0,))


def _grouped_cases(gen: torch.Generator) -> Iterator[Case]:
    offsets = torch.tensor([5, 5, 12, 16], dtype=torch.int32)  # expert 1 gets no row
    x, weights = _rand(16, 32, gen=gen), _rand(4, 32, 16, gen=gen) / 6
    yield "4 groups, one empty, k 32, n 16", (x, weights, offsets), {}, (0, 1)


def _cases(op: str, gen: torch.Generator) -> Iterator[Case]:
    if op == "attention":
        return _attention_cases(gen)
    if op == "attention_lse":
        return _lse_cases(gen)
    if op == "attention_lse_backward":
        return _lse_backward_cases(gen)
    if op in ("rms_norm", "layer_norm"):
        return _norm_cases(gen, op)
    if op == "rope":
        return _rope_cases(gen)
    if op == "swiglu":
        return iter([("x [6, 2 x 24]", (_rand(6, 48, gen=gen) * 2,), {}, (0,))])
    if op == "grouped_mm":
        return _grouped_cases(gen)
    raise KeyError(op)


def _reference(op: str) -> Callable:
    from portspeed.portable_te.kernels import TABLE, import_path

    return import_path(TABLE[op].reference)


#: inputs the contracts keep in float32 whatever the compute dtype (rope's angles, the merged log-sum-exp)
_FP32_ARGS = {"rope": (1,), "attention_lse_backward": (5,)}


def _as(x: Any, dtype: torch.dtype, device: Any, grad: bool) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if not x.is_floating_point():
        return x.to(device)
    return x.detach().to(device=device, dtype=dtype, copy=True).requires_grad_(grad)


def _cast(args: tuple, dtype: torch.dtype, keep: tuple[int, ...]) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and i not in keep else a
                 for i, a in enumerate(args))


def _run(fn: Callable, args: tuple, kw: dict, wrt: tuple[int, ...], grads_out: list[torch.Tensor] | None,
         dtype: torch.dtype, device: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Call ``fn`` on ``args`` (already in their dtypes) on ``device``; outputs and the gradients of ``wrt``
    (as host fp32)."""
    inputs = [_as(a, a.dtype if isinstance(a, torch.Tensor) else dtype, device, i in wrt) for i, a in enumerate(args)]
    kw = {n: a.to(device) if isinstance(a, torch.Tensor) else a for n, a in kw.items()}  # masks
    out = fn(*inputs, **kw)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    grads: list[torch.Tensor] = []
    if wrt:
        assert grads_out is not None
        tensors = [o for o in outs if o.requires_grad]
        torch.autograd.backward(tensors, [g.to(o.dtype).to(o.device) for g, o in zip(grads_out, tensors)])
        grads = [inputs[i].grad for i in wrt]
        for i, g in zip(wrt, grads):
            if g is None:
                raise AssertionError(f"no gradient reached input {i}")
    return [o.detach().float().cpu() for o in outs], [g.float().cpu() for g in grads]


def _worst(name: str, got: list[torch.Tensor], want: list[torch.Tensor], band: float) -> str | None:
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"{name} {i}: shape {tuple(g.shape)}, the reference's {tuple(w.shape)}"
        if not torch.isfinite(g).all():
            return f"{name} {i}: not finite"
        rel = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-6)
        if rel > band:
            return f"{name} {i}: error {rel:.2e} > {band:.0e}, the band (max |difference| / max |reference|)"
    return None


def _case(op: str, name: str, args: tuple, kw: dict, dtype: torch.dtype) -> str:
    """``op case "name" with q [2, 4, 16, 16], k [...], ..., bfloat16``: the case as a vendor reproduces it."""
    params = list(inspect.signature(KERNEL_OPS[op]).parameters)
    tensors = [f"{p} {list(a.shape)}" for p, a in zip(params, args) if isinstance(a, torch.Tensor)]
    tensors += [f"{p} {list(a.shape)}" for p, a in kw.items() if isinstance(a, torch.Tensor)]
    return f'{op} case "{name}" with {", ".join(tensors)}, {str(dtype).replace("torch.", "")}'


def compare_kernel(op: str, fn: Callable, device: Any, seed: int = 1234) -> str | None:
    """None if ``fn`` matches the reference of ``op`` on ``device`` in every case; else the first failure, in words."""
    ref = _reference(op)
    gen = torch.Generator().manual_seed(seed)
    keep = _FP32_ARGS.get(op, ())
    for name, args, kw, wrt in _cases(op, gen):
        for dtype in _DTYPES:
            mine = _cast(args, dtype, keep)
            ref_args = _cast(mine, torch.float32, ())  # the same (rounded) inputs, in fp32 on the host
            outs, _ = _run(ref, ref_args, kw, (), None, torch.float32, "cpu")
            grads_out = [torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1)) for o in outs]
            want, want_grads = _run(ref, ref_args, kw, wrt, grads_out if wrt else None, torch.float32, "cpu")
            where = _case(op, name, args, kw, dtype)
            try:
                got, got_grads = _run(fn, mine, kw, wrt, grads_out if wrt else None, dtype, device)
            except Exception as exc:  # a kernel that raises fails its check, named
                return f"{where}: raised {type(exc).__name__}: {exc}"
            bad = _worst(f"{where}: output", got, want, BANDS[dtype])
            bad = bad or _worst(f"{where}: gradient of input", got_grads, want_grads, BANDS[dtype])
            if bad:
                return bad
    return None


def run_kernel_checks(acc: Any, report: Report) -> None:
    """Append one check per vendor kernel ``acc`` declares (a skip when it declares none) to ``report``."""
    declared = acc.kernels()
    if not declared:
        report.skip(SUITE, "vendor kernels match the reference", f"adapter {acc.name!r} declares no kernels()")
        return
    device = acc.device(0)
    for op, decl in declared.items():
        def check(op: str = op, decl: Any = decl) -> None:
            fn = resolve_kernel(acc.name, op, decl)
            bad = compare_kernel(op, fn, device)
            assert bad is None, bad

        what = decl if isinstance(decl, str) else getattr(decl, "__qualname__", decl)
        report.run(SUITE, f"vendor kernel {op} ({what}) matches the reference", check)


def compare_implementations(device: Any, impl: str = "torch") -> dict[str, str | None]:
    """Each built-in ``impl`` implementation (``"torch"`` or ``"reference"``) on ``device`` against the reference:
    ``{op: None or the first failure}`` (for a device check such as benchmarks/gpu_check.sh; ``grouped_mm``'s
    torch form takes torch's kernel only for the dtypes the active adapter declares)."""
    from portspeed.portable_te.kernels import TABLE, import_path

    return {op: compare_kernel(op, import_path(getattr(row, impl)), device)
            for op, row in TABLE.items() if getattr(row, impl) is not None}
