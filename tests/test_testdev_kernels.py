"""The test device's own kernels: torch's PrivateUse1 SDPA hook and portspeed's vendor kernel slot (issue 23).

A device that is not the host proves both routes a vendor has to make the portable Transformer Engine fast:

- attention: the device registers ``_fused_sdp_choice`` and ``_scaled_dot_product_fused_attention_overrideable``
  (+ backward) in C++ (``csrc/fused.cpp``); ``F.scaled_dot_product_attention`` on device tensors reaches them
  (their counters move), except with dropout, which the device's choice sends to torch's math path;
- rms_norm: the adapter declares ``{"rms_norm": "portspeed.testing.testdev.kernels:rms_norm"}`` (a C++ operator
  of the device); the portable TE's ``RMSNorm`` runs it, and the conformance kit compares it with the reference
  and names a planted wrong kernel.

Bands: the device computes attention with torch's CPU flash kernels on copies of its tensors, so the device equals
the CPU run of the same torch call bit for bit (asserted exactly for SDPA; observed so through the portable TE too);
against the explicit fp32 arithmetic 1e-5. The vendor rms_norm differs from ``F.rms_norm`` (the CPU run) in the
order of its reductions only: through RMSNorm + DotProductAttention, max |difference| / max(|CPU|, 1) observed
1.6e-7 in fp32 (asserted 1e-5) and 0 in bf16 (asserted 2e-3), with and without attention dropout.

Registering the device cannot be undone in a process: each check runs in a fresh interpreter (``run_python``),
as in tests/test_testdev.py. The extension is built by ``make test`` first; if it cannot be built these fail.
"""

from __future__ import annotations

import textwrap

import pytest

from helpers.launch import run_python

PRELUDE = "import torch\nimport torch.nn.functional as F\n"


def _run(code: str, timeout: float = 300, **env: str) -> str:
    res = run_python(["-c", PRELUDE + textwrap.dedent(code) + "\nprint('OK')\n"], timeout=timeout, env=env)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("OK"), (
        f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-5000:]}")
    return res.stdout


def test_declaring_the_vendor_kernel_loads_nothing() -> None:
    """The declaration is read from Python alone: the registry's plan names the vendor rms_norm, and neither the
    device runtime nor the kernel module is imported (``portspeed info`` stays instant and builds nothing)."""
    _run("""
        import sys
        from portspeed.accelerator import adapter_class
        from portspeed.portable_te import kernels
        cls = adapter_class("testdev")
        assert cls.kernels() == {"rms_norm": "portspeed.testing.testdev.kernels:rms_norm"}, cls.kernels()
        plan = {c.op: c for c in kernels.plan(cls)}
        assert plan["rms_norm"].impl == "vendor" and "testdev.kernels:rms_norm" in plan["rms_norm"].why, plan
        assert plan["attention"].impl == "torch", plan["attention"]
        loaded = [m for m in ("portspeed.testing.testdev.runtime", "portspeed.testing.testdev.kernels",
                              "portspeed_testdev_ext") if m in sys.modules]
        assert not loaded and not hasattr(torch, "testdev"), loaded
    """, PORTSPEED_ACCELERATOR="cpu")


@pytest.mark.testdev
def test_sdpa_on_the_device_runs_its_fused_kernel() -> None:
    """SDPA on device tensors takes the device's overrideable kernel forward and backward (causal, sq != sk,
    boolean / additive masks, a mask with causal, GQA as K/V with fewer heads, scale, bf16): equal to the CPU
    run, counters move once per call. Dropout, and a mask that needs a gradient, go to torch's math path (still
    equal to the CPU run under the same seed). The op returns the log-sum-exp of the scores."""
    _run("""
        import portspeed.testing.testdev.runtime as rt

        def delta(before):
            now = rt.counters()
            return {k: now[k] - before[k] for k in now if now[k] != before[k]}

        def sdpa(device, q, k, v, mask, grad, **kw):
            leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.to(device), **kw)
            out.backward(grad.to(device))
            return [t.detach().cpu() for t in (out, *(x.grad for x in leaves))]

        g = torch.Generator().manual_seed(0)
        with_causal = torch.rand(1, 1, 6, 7, generator=g) > 0.3
        with_causal[..., 0] = True  # every row keeps a key under the causal mask too
        cases = {  # name: (hq, hkv, sq, sk, mask, keywords)
            "plain": (4, 4, 8, 8, None, {}),
            "causal sq < sk": (4, 4, 5, 9, None, {"is_causal": True}),
            "causal GQA": (4, 2, 8, 8, None, {"is_causal": True, "enable_gqa": True}),
            "boolean mask GQA": (4, 1, 6, 7, torch.rand(2, 1, 6, 7, generator=g) > 0.3, {"enable_gqa": True}),
            "additive mask": (4, 4, 6, 7, torch.randn(1, 4, 6, 7, generator=g), {}),
            "scale": (4, 4, 8, 8, None, {"is_causal": True, "scale": 0.37}),
            "mask and causal": (4, 2, 6, 7, with_causal, {"is_causal": True, "enable_gqa": True}),
        }
        for dtype in (torch.float32, torch.bfloat16):
            for name, (hq, hkv, sq, sk, mask, kw) in cases.items():
                q, grad = (torch.randn(2, hq, sq, 16, generator=g).to(dtype) for _ in range(2))
                k, v = (torch.randn(2, hkv, sk, 16, generator=g).to(dtype) for _ in range(2))
                m = mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
                before = rt.counters()
                got = sdpa("testdev", q, k, v, m, grad, **kw)
                assert delta(before) == {"sdpa_choice_overrideable": 1, "sdpa_overrideable_fwd": 1,
                                         "sdpa_overrideable_bwd": 1}, (name, delta(before))
                for what, a, b in zip(("out", "dq", "dk", "dv"), got, sdpa("cpu", q, k, v, m, grad, **kw)):
                    assert a.dtype == dtype and torch.equal(a, b), (name, dtype, what, (a - b).abs().max())

        q, k, v, grad = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(4))
        overrideable, math = 4, 0  # at::SDPBackend
        assert torch._fused_sdp_choice(q.testdev(), k.testdev(), v.testdev()) == overrideable
        assert torch._fused_sdp_choice(q.testdev(), k.testdev(), v.testdev(), dropout_p=0.1) == math
        torch.testdev.manual_seed(5)
        before = rt.counters()
        got = sdpa("testdev", q, k, v, None, grad, dropout_p=0.3)
        assert delta(before) == {"sdpa_choice_math": 1, "sdpa_choice_math_dropout": 1}, delta(before)
        torch.manual_seed(5)
        for a, b in zip(got, sdpa("cpu", q, k, v, None, grad, dropout_p=0.3)):
            assert torch.equal(a, b), (a - b).abs().max()

        bias = torch.randn(2, 1, 6, 6, generator=g).testdev().requires_grad_()
        before = rt.counters()
        F.scaled_dot_product_attention(q.testdev(), k.testdev(), v.testdev(), attn_mask=bias).sum().backward()
        assert delta(before) == {"sdpa_choice_math": 1} and bias.grad is not None, delta(before)

        kv = k[:, :2].testdev(), v[:, :2].testdev()  # GQA straight into the op: no enable_gqa in its schema
        out, lse = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
            q.testdev(), *kv, is_causal=True, scale=0.3)[:2]
        assert lse.device.type == "testdev" and lse.dtype == torch.float32 and lse.shape == (2, 4, 6)
        s = (q @ k[:, :2].repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
        s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(lse.cpu(), torch.logsumexp(s, -1), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.cpu(), torch.softmax(s, -1) @ v[:, :2].repeat_interleave(2, 1),
                                   atol=1e-5, rtol=0)
    """)


@pytest.mark.testdev
def test_portable_te_reaches_both_kernels_and_equals_the_cpu_run() -> None:
    """With the test device selected, the portable TE's RMSNorm runs the vendor rms_norm and DotProductAttention
    the device's SDPA kernel (forward and backward; causal, padding, GQA; fp32 and bf16); the results equal the
    same layers on the CPU adapter. Training-time attention dropout goes to torch's math path on the device."""
    _run("""
        import portspeed
        from portspeed.accelerator import adapter_class, set_accelerator
        from portspeed.portable_te import attention, kernels, norms, rng
        import portspeed.testing.testdev.runtime as rt

        device = portspeed.get_accelerator()
        assert device.name == "testdev"
        assert kernels.choice("rms_norm").impl == "vendor" and kernels.choice("attention").impl == "torch"
        cpu = adapter_class("cpu")()

        def layers(where, mask_type, groups, dtype, dropout=0.0):
            torch.manual_seed(0)
            s, b, h, d = 12, 2, 4, 16
            tracker = rng.CudaRNGStatesTracker()
            tracker.add("model-parallel-rng", 1234)
            dpa = attention.DotProductAttention(h, d, num_gqa_groups=groups, attn_mask_type=mask_type,
                                                attention_dropout=dropout, get_rng_state_tracker=lambda: tracker)
            norm = norms.RMSNorm(h * d, eps=1e-5, zero_centered_gamma=True, device=where, params_dtype=dtype)
            with torch.no_grad():
                norm.weight.copy_(0.1 * torch.randn(h * d))
            x = torch.randn(s, b, h * d).to(dtype).to(where).requires_grad_()
            k, v = (torch.randn(s, b, groups, d).to(dtype).to(where).requires_grad_() for _ in range(2))
            mask = None
            if mask_type == "padding":
                mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
                mask[1, ..., 9:] = True  # Megatron's convention: True = masked out
                mask = mask.to(where)
            y = norm(x)
            out = dpa(y.view(s, b, h, d), k, v, mask)
            out.float().square().sum().backward()
            return [t.detach().float().cpu() for t in (y, out, x.grad, k.grad, v.grad, norm.weight.grad)]

        def both(*args, **kw):
            set_accelerator(device)
            rt.reset_counters()
            got = layers(device.device(0), *args, **kw)
            calls = {k: v for k, v in rt.counters().items() if v}
            set_accelerator(cpu)
            want = layers("cpu", *args, **kw)
            return got, want, calls

        def close(got, want, dtype, case):
            for name, a, b in zip(("norm", "attention", "dx", "dk", "dv", "dweight"), got, want):
                diff = (a - b).abs().max().item() / max(b.abs().max().item(), 1.0)
                assert diff <= (1e-5 if dtype == torch.float32 else 2e-3), (case, dtype, name, diff)

        for mask_type, groups in (("causal", 4), ("causal", 2), ("padding", 2)):
            for dtype in (torch.float32, torch.bfloat16):
                got, want, calls = both(mask_type, groups, dtype)
                assert calls == {"rms_norm_fwd": 1, "rms_norm_bwd": 1, "sdpa_choice_overrideable": 1,
                                 "sdpa_overrideable_fwd": 1, "sdpa_overrideable_bwd": 1}, (mask_type, calls)
                close(got, want, dtype, (mask_type, groups))

        # dropout inside the tracker's fork: the device's generator draws the CPU's mask under the same seed
        got, want, calls = both("causal", 2, torch.float32, dropout=0.2)
        assert calls == {"rms_norm_fwd": 1, "rms_norm_bwd": 1, "sdpa_choice_math": 1,
                         "sdpa_choice_math_dropout": 1}, calls
        close(got, want, torch.float32, "dropout")
        assert not torch.equal(got[1], both("causal", 2, torch.float32)[0][1])  # the dropout did drop
    """, PORTSPEED_ACCELERATOR="testdev")


@pytest.mark.testdev
def test_conformance_passes_the_device_kernel_and_names_planted_wrong_ones() -> None:
    """The kit's kernels suite runs the declared rms_norm on the device (its counter moves) and passes it; a kernel
    0.1 % off in value, and one right in value with a gradient 1 % off, both running on the device, are named
    with the first case that fails (fp32 band 1e-4)."""
    _run("""
        from portspeed.conformance.kernels import run_kernel_checks
        from portspeed.conformance.report import Report
        from portspeed.testing.testdev.adapter import TestdevAccelerator
        from portspeed.testing.testdev.kernels import rms_norm
        import portspeed.testing.testdev.runtime as rt

        def off_in_value(x, weight, eps):  # planted: 0.1 % too large
            return rms_norm(x, weight, eps) * 1.001

        def off_in_gradient(x, weight, eps):  # planted: the right value, every gradient 1 % too large
            y = rms_norm(x, weight, eps)
            return y + (0.01 * y - (0.01 * y).detach())

        def check(kernel):
            class Planted(TestdevAccelerator):
                name = "testdev-planted"

                @classmethod
                def kernels(cls):
                    return {"rms_norm": kernel}

            report = Report("testdev")
            run_kernel_checks(TestdevAccelerator() if kernel is None else Planted(), report)
            assert len(report.checks) == 1 and not report.checks[0].skipped, report.render()
            return report

        before = rt.counters()["rms_norm_fwd"]
        good = check(None)
        assert not good.failed, good.render()
        assert rt.counters()["rms_norm_fwd"] > before  # it ran the device's kernel
        for kernel, words in ((off_in_value, "x [3, 5, 64], float32: output 0"),
                              (off_in_gradient, "x [3, 5, 64], float32: gradient of input 0")):
            failed = check(kernel).failed
            assert len(failed) == 1 and "rms_norm" in failed[0].name, failed
            assert words in failed[0].detail and "> 1e-04" in failed[0].detail, failed[0].detail
    """)
