"""torch's own ops on the device, against the CPU: what Megatron's local path and the portable TE send to torch.

Why: an adapter that declares no kernel still runs torch's operators on its device, through kernels the vendor
registered with torch's dispatcher or the CPU fallback. One wrong kernel there (OpenReg's SDPA on torch 2.13
returns memory it never wrote) changes every model, and the vendor-kernel checks never see it. So each op runs
on the device and on the host from the same inputs in the same dtype (fp32, bf16), values and gradients, and is
compared within the kernel bands (``portspeed.vendor.KERNEL_BANDS``: the largest difference over the largest
magnitude of the CPU's answer).

A wrong op is named with its case, and the check prints the declaration (``wrong_torch_ops``) that moves it to a
rung that is right: where the portable Transformer Engine has another rung for it (SDPA: ``attention``;
``layer_norm``; ``rms_norm``), that rung, and for the norms also the host (Megatron's local path calls torch's);
for the others (matmul, addmm, baddbmm, softmax, gelu, silu, cross_entropy), the host
(``portspeed.accelerator.host_rung``: every caller, Megatron's local path included). Once declared, it checks that
the device's own op is still wrong (the host rung suspended) and that the rung is right, on the device.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from portspeed.accelerator.kernel_ops import KERNEL_BANDS
from portspeed.conformance.report import Report

__all__ = ["OPS", "TE_RUNG", "compare_torch_op", "run_torch_op_checks"]

SUITE = "kernels"
_DTYPES = (torch.float32, torch.bfloat16)

#: torch op -> the portable TE operation whose torch rung is that op (a wrong op moves to the TE's next rung)
TE_RUNG = {"scaled_dot_product_attention": "attention", "layer_norm": "layer_norm", "rms_norm": "rms_norm"}

#: a case: (name, function of the inputs, inputs as host fp32 tensors, indices of inputs to differentiate)
Case = tuple[str, Callable[..., torch.Tensor], tuple[Any, ...], tuple[int, ...]]


def _r(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _sdpa(gen: torch.Generator) -> Iterator[Case]:
    q, k, v = _r(gen, 2, 4, 16, 16), _r(gen, 2, 4, 16, 16), _r(gen, 2, 4, 16, 16)
    yield "no mask", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k, v), (0, 1, 2)
    yield "causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), (0, 1, 2)
    mask = torch.rand(2, 1, 16, 16, generator=gen) > 0.3
    mask[..., 0] = True  # every row attends somewhere
    yield ("boolean mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
           (q, k, v, mask), (0, 1, 2))


def _cases(op: str, gen: torch.Generator) -> Iterator[Case]:
    x = _r(gen, 4, 6, 64) * 2 + 0.5
    w, b = 1 + 0.1 * _r(gen, 64), 0.1 * _r(gen, 64)
    if op == "scaled_dot_product_attention":
        yield from _sdpa(gen)
    elif op == "layer_norm":
        yield "over the last dimension", lambda x, w, b: F.layer_norm(x, (64,), w, b, 1e-5), (x, w, b), (0, 1, 2)
    elif op == "rms_norm":
        yield "over the last dimension", lambda x, w: F.rms_norm(x, (64,), w, 1e-5), (x, w), (0, 1)
    elif op == "matmul":
        yield "[4, 6, 64] @ [64, 32]", torch.matmul, (x, _r(gen, 64, 32) / 8), (0, 1)
    elif op == "addmm":
        yield "bias + [24, 64] @ [64, 32]", torch.addmm, (_r(gen, 32), _r(gen, 24, 64), _r(gen, 64, 32) / 8), (0, 1, 2)
    elif op == "baddbmm":  # Megatron's attention scores: beta 0 over an uninitialised buffer
        yield ("beta 0 over an unwritten buffer, alpha 0.25",
               lambda q, k: torch.baddbmm(torch.full((8, 16, 16), float("nan"), device=q.device, dtype=q.dtype), q,
                                          k.transpose(1, 2), beta=0.0, alpha=0.25),
               (_r(gen, 8, 16, 32), _r(gen, 8, 16, 32)), (0, 1))
    elif op == "softmax":
        yield "over the last dimension", lambda x: F.softmax(x, dim=-1), (x * 3,), (0,)
    elif op == "gelu":
        yield "exact", F.gelu, (x,), (0,)
        yield "tanh", lambda x: F.gelu(x, approximate="tanh"), (x,), (0,)
    elif op == "silu":
        yield "x", F.silu, (x,), (0,)
    elif op == "cross_entropy":
        target = torch.randint(0, 50, (24,), generator=gen)
        yield "logits [24, 50]", lambda z, t: F.cross_entropy(z, t), (_r(gen, 24, 50) * 2, target), (0,)
    else:
        raise KeyError(op)


OPS = ("scaled_dot_product_attention", "layer_norm", "rms_norm", "matmul", "addmm", "baddbmm", "softmax", "gelu",
       "silu", "cross_entropy")


def _run(fn: Callable, args: tuple, wrt: tuple[int, ...], dtype: torch.dtype, device: Any,
         grad_seed: int) -> list[torch.Tensor]:
    inputs = [a.detach().to(device=device, dtype=dtype if a.is_floating_point() else a.dtype, copy=True)
              .requires_grad_(i in wrt) for i, a in enumerate(args)]
    out = fn(*inputs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    out.backward(grad.to(out.dtype).to(out.device))
    return [out.detach().float().cpu()] + [inputs[i].grad.float().cpu() for i in wrt]


def compare_torch_op(op: str, device: Any, seed: int = 4321) -> str | None:
    """None if torch's ``op`` on ``device`` matches the CPU in every case and dtype; else the first failure."""
    gen = torch.Generator().manual_seed(seed)
    for name, fn, args, wrt in _cases(op, gen):
        for dtype in _DTYPES:
            mine = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
            want = _run(fn, mine, wrt, dtype, "cpu", seed)  # the host's kernels, in the same dtype
            where = f'torch {op} case "{name}", {str(dtype).replace("torch.", "")}'
            try:
                got = _run(fn, mine, wrt, dtype, device, seed)
            except Exception as exc:  # an op that raises on the device is a failed op, named
                return f"{where}: raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            for i, (g, w) in enumerate(zip(got, want)):
                what = "output" if i == 0 else f"gradient of input {wrt[i - 1]}"
                if not torch.isfinite(g).all():
                    return f"{where}: {what} not finite"
                rel = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-6)
                if rel > KERNEL_BANDS[dtype]:
                    return f"{where}: {what} error {rel:.2e} > {KERNEL_BANDS[dtype]:.0e}, the band"
    return None


def run_torch_op_checks(acc: Any, report: Report) -> None:
    """One check per op of ``OPS`` on ``acc``'s device; the ``wrong_torch_ops`` line for a wrong op with a rung."""
    from portspeed.accelerator.host_rung import HOST_OPS

    device = acc.device(0)
    declared = tuple(acc.wrong_torch_ops)
    wrong: list[str] = [te for te in declared]
    for op in OPS:
        te = TE_RUNG.get(op)
        if te is not None and te in declared:
            _check_te_rung(acc, op, te, device, report)
            continue
        if op in declared:
            _check_host_rung(op, device, report)
            continue
        bad = compare_torch_op(op, device)
        if bad is None:
            report.add(SUITE, f"torch {op} on the device matches the CPU", True)
        elif te is not None:
            wrong.append(te)
            others = (f"portspeed computes {op} on the host for every other caller (Megatron's local path)"
                      if te in HOST_OPS else "Megatron's local path does not use it")
            report.add(SUITE, f"torch {op} on the device matches the CPU", False,
                       f"{bad} -- the portable TE's {te} moves off torch's op, and {others}, when the adapter "
                       "declares wrong_torch_ops (printed at the end)")
        elif op in HOST_OPS:
            wrong.append(op)
            report.add(SUITE, f"torch {op} on the device matches the CPU", False,
                       f"{bad} -- portspeed computes {op} on the host, for every caller, when the adapter declares "
                       f"wrong_torch_ops (printed at the end)")
        else:
            report.add(SUITE, f"torch {op} on the device matches the CPU", False,
                       f"{bad} -- no rung of portspeed replaces torch's {op}: fix the device's kernel for it (its "
                       "aten op's PrivateUse1 registration)")
    if len(wrong) > len(declared):
        report.declare("wrong_torch_ops", repr(tuple(dict.fromkeys(wrong))))


def _check_te_rung(acc: Any, op: str, te: str, device: Any, report: Report) -> None:
    """A declared TE op: still wrong on the device (else the declaration goes), and the rung it moves to is right."""
    from portspeed.accelerator import host_rung
    from portspeed.conformance.kernels import compare_kernel
    from portspeed.portable_te.kernels import TABLE, import_path

    with host_rung.suspended():  # the device's own op (the norms are computed on the host too, once declared)
        own = compare_torch_op(op, device)
    if own is None:
        report.add(SUITE, f"torch {op} on the device (declared wrong: wrong_torch_ops has {te!r})", False,
                   f"it matches the CPU on the device: take {te!r} out of wrong_torch_ops (the portable TE "
                   "then uses torch's op again)")
        return
    kernel = acc.kernels().get(te)
    rung = "the adapter's kernel" if kernel is not None else "portspeed's reference"
    fn = import_path(TABLE[te].reference) if kernel is None else _resolved(acc, te, kernel)
    bad = compare_kernel(te, fn, device)
    host = ""
    if te in host_rung.HOST_OPS:  # torch's op itself, for Megatron's local path: computed on the host
        host = f"; torch's {op} (Megatron's local path) runs on the host, which matches"
        if te not in host_rung.registered():
            bad = bad or (f"{own} -- and the host rung is not registered for this device (its dispatch key is "
                          "not PrivateUse1 nor an in-tree one portspeed knows)")
        bad = bad or compare_torch_op(op, device)
    report.add(SUITE, f"torch {op} is wrong on the device, as declared (wrong_torch_ops): the portable TE's "
               f"{te} runs {rung}, which matches{host}", bad is None, bad or "")


def _check_host_rung(op: str, device: Any, report: Report) -> None:
    """A declared host op: the device's own kernel still wrong (else the declaration goes), the host rung right."""
    from portspeed.accelerator import host_rung

    with host_rung.suspended():
        own = compare_torch_op(op, device)
    if own is None:
        report.add(SUITE, f"torch {op} on the device (declared wrong: wrong_torch_ops has {op!r})", False,
                   f"the device's own kernel matches the CPU: take {op!r} out of wrong_torch_ops (portspeed then "
                   "leaves it on the device)")
        return
    if op not in host_rung.registered():
        report.add(SUITE, f"torch {op} is wrong on the device, as declared (wrong_torch_ops): computed on the host",
                   False, f"{own} -- and the host rung is not registered for this device (its dispatch key is not "
                   "PrivateUse1 nor an in-tree one portspeed knows)")
        return
    bad = compare_torch_op(op, device)
    report.add(SUITE, f"torch {op} is wrong on the device, as declared (wrong_torch_ops): portspeed computes it on "
               "the host, which matches", bad is None, bad or "")


def _resolved(acc: Any, op: str, decl: Any) -> Callable:
    from portspeed.accelerator.kernel_ops import resolve_kernel

    return resolve_kernel(acc.name, op, decl)
