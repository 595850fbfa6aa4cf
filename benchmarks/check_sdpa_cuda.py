"""The portable TE's attention kernels on a CUDA GPU: correctness against the reference, which SDPA backend ran,
and the fused-vs-reference time and memory of one attention forward+backward.

Why a script (not a test): CI has no GPU; a developer lent one runs ``python benchmarks/check_sdpa_cuda.py``
(torch with CUDA only; needs no Megatron) and records what it prints in docs/transformer-engine.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from portspeed.portable_te import packed, sdpa  # noqa: E402

DEV = torch.device("cuda")


def _qkv(hq, hkv, sq, sk, dtype, d=64, b=2):
    g = torch.Generator(device=DEV).manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, device=DEV).to(dtype).requires_grad_()  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d), torch.randn(b, hq, sq, d, device=DEV, dtype=dtype)


def _grads(fn, q, k, v, g, **kw):
    for t in (q, k, v):
        t.grad = None
    o = fn(q, k, v, scale=0.125, dropout_p=0.0, **kw)
    o.backward(g)
    return [o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def check_attention() -> None:
    mask = torch.rand(2, 1, 96, 128, device=DEV) > 0.3
    mask[0, 0, 5] = False
    cases = {"top_left": (None, "top_left", 128, 128), "bottom_right sq<sk": (None, "bottom_right", 96, 128),
             "bottom_right sq>sk": (None, "bottom_right", 128, 96), "mask+dead row": (mask, None, 96, 128),
             "mask+top_left": (mask, "top_left", 96, 128)}
    for dtype in (torch.float32, torch.bfloat16):
        for name, (m, causal, sq, sk) in cases.items():
            q, k, v, g = _qkv(8, 2, sq, sk, dtype)
            a = _grads(sdpa.attention_torch, q, k, v, g, attn_mask=m, causal=causal)
            r = _grads(sdpa.attention_reference, q, k, v, g, attn_mask=m, causal=causal)
            diffs = " ".join(f"{n}={(x - y).abs().max().item():.1e}"
                             for n, x, y in zip(("out", "dq", "dk", "dv"), a, r))
            print(f"attention {str(dtype)[6:]:8s} {name:20s} {diffs}")


def check_lse() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for hkv in (8, 2):
            q, k, v, g = _qkv(8, hkv, 64, 128, dtype)
            blocks = [(slice(0, 64), False), (slice(64, 128), True)]
            parts = [sdpa.attention_lse_torch(q, k[:, :, s], v[:, :, s], causal=c, scale=0.125) for s, c in blocks]
            lse = torch.logaddexp(parts[0][1], parts[1][1])
            out = sum(o.float() * torch.exp(l - lse).unsqueeze(-1) for o, l in parts).to(dtype)
            full = sdpa.attention_reference(q, k, v, attn_mask=None, causal="bottom_right", scale=0.125, dropout_p=0.0)
            full.backward(g)
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for s, c in blocks:
                gq, gk, gv = sdpa.attention_lse_backward_torch(g, q, k[:, :, s], v[:, :, s], out, lse, causal=c,
                                                               scale=0.125)
                dq += gq
                dk[:, :, s] += gk
                dv[:, :, s] += gv
            ref_o, ref_l = sdpa.attention_lse_reference(q, k[:, :, :64], v[:, :, :64], causal=False, scale=0.125)
            print(f"lse {str(dtype)[6:]:8s} hkv={hkv} block lse={(parts[0][1] - ref_l).abs().max().item():.1e} "
                  f"merged out={(out.float() - full.float()).abs().max().item():.1e} "
                  f"dq={(dq - q.grad).abs().max().item():.1e} dk={(dk - k.grad).abs().max().item():.1e} "
                  f"dv={(dv - v.grad).abs().max().item():.1e}")


def check_varlen() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        ok = packed.varlen_supported(DEV, dtype)
        cu = torch.tensor([0, 50, 120, 128], dtype=torch.int32, device=DEV)
        q, k, v = (torch.randn(130, h, 64, device=DEV, dtype=dtype) for h in (8, 2, 2))

        def ref(q, k, v, mask, causal):
            return sdpa.attention_reference(q, k, v, attn_mask=mask, causal=causal, scale=0.125, dropout_p=0.0)

        got = packed.packed_attention(q, k, v, "padding_causal", 0.125, ref, cu, cu, varlen=True)
        want = packed.packed_attention(q, k, v, "padding_causal", 0.125, ref, cu, cu, varlen=False)
        print(f"varlen {str(dtype)[6:]:8s} kernel={ok} max|diff| vs per-sequence reference "
              f"{(got.float() - want.float()).abs().max().item():.1e}")


def backends() -> None:
    from torch.profiler import ProfilerActivity, profile

    for dtype, m, causal in ((torch.bfloat16, None, "top_left"), (torch.float32, None, "top_left"),
                             (torch.float32, "mask", None), (torch.bfloat16, None, "bottom_right")):
        q, k, v, g = _qkv(16, 4, 1024, 1024 if causal != "bottom_right" else 2048, dtype, b=1)
        mask = torch.ones(1, 1, 1024, k.shape[2], dtype=torch.bool, device=DEV) if m else None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sdpa.attention_torch(q, k, v, attn_mask=mask, causal=causal, scale=0.125, dropout_p=0.0).backward(g)
            torch.cuda.synchronize()
        names = sorted({e.key for e in prof.key_averages() if any(w in e.key.lower() for w in
                        ("flash", "fmha", "cudnn", "efficient", "attention", "softmax", "gemm"))})
        print(f"backend {str(dtype)[6:]:8s} mask={bool(m)} causal={causal} GQA 16/4: {[n[:60] for n in names][:4]}")


def bench() -> None:
    print("attention fwd+bwd, b1, 16 heads, hd 64, causal (median of 5; peak = max_memory_allocated above inputs)")
    for dtype in (torch.float32, torch.bfloat16):
        for s in (4096, 8192):
            for name, fn in (("reference", sdpa.attention_reference), ("torch", sdpa.attention_torch)):
                q, k, v, g = _qkv(16, 16, s, s, dtype, b=1)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(6):
                    t0 = time.perf_counter()
                    fn(q, k, v, attn_mask=None, causal="top_left", scale=0.125, dropout_p=0.0).backward(g)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                print(f"  {str(dtype)[6:]:8s} seq {s:5d} {name:9s} {statistics.median(times[1:]) * 1e3:8.2f} ms "
                      f"peak {peak:8.0f} MiB")
                del q, k, v, g


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    steps = [globals()[a] for a in sys.argv[1:]] or [check_attention, check_lse, check_varlen, backends, bench]
    for step in steps:
        try:
            step()
        except Exception as exc:  # report every part; one failing does not hide the others
            print(f"{step.__name__} FAILED: {type(exc).__name__}: {exc}")
