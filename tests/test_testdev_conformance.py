"""The conformance kit's kernels suite on the test device: its declared kernels pass, planted wrong ones are named.

The kit runs each kernel the adapter declares on the device (the device's counters move) against the portable
Transformer Engine's reference, within the bands of ``portspeed.conformance.kernels``; a planted kernel that is
wrong in value or in gradient is named with the first case that fails. The kernels themselves, and how they are
reached: test_testdev_kernels.py. Each check runs in a fresh interpreter (registering the device cannot be undone).
"""

from __future__ import annotations

import textwrap

import pytest

from helpers.launch import run_ok, run_python

PRELUDE = "import torch\nimport torch.nn.functional as F\n"


def _run(code: str, timeout: float = 300, **env: str) -> str:
    return run_ok(PRELUDE + textwrap.dedent(code), timeout=timeout, env=env)


@pytest.mark.testdev
def test_conformance_passes_the_device_kernels_and_names_planted_wrong_ones() -> None:
    """The kit's kernels suite runs each declared kernel on the device (its counters move) and passes it; planted
    kernels running on the device are named with the first case that fails (fp32 band 1e-4): an rms_norm 0.1 % off
    in value, one right in value with a gradient 1 % off, an attention_lse whose log-sum-exp is 0.01 too large,
    and an attention_lse_backward that uses the block's own out / lse instead of the merged ones given to it."""
    _run("""
        from portspeed.conformance.kernels import run_kernel_checks
        from portspeed.conformance.report import Report
        from portspeed.testing.testdev.adapter import TestdevAccelerator
        from portspeed.testing.testdev.kernels import attention_lse, attention_lse_backward, rms_norm
        import portspeed.testing.testdev.runtime as rt

        def off_in_value(x, weight, eps):  # planted: 0.1 % too large
            return rms_norm(x, weight, eps) * 1.001

        def off_in_gradient(x, weight, eps):  # planted: the right value, every gradient 1 % too large
            y = rms_norm(x, weight, eps)
            return y + (0.01 * y - (0.01 * y).detach())

        def lse_off(q, k, v, *, causal, scale):  # planted: the right output, the log-sum-exp 0.01 too large
            out, lse = attention_lse(q, k, v, causal=causal, scale=scale)
            return out, lse + 0.01

        def own_lse_backward(grad_out, q, k, v, out, lse, *, causal, scale):  # planted: ignores the merged out/lse
            mine, my_lse = attention_lse(q, k, v, causal=causal, scale=scale)
            return attention_lse_backward(grad_out, q, k, v, mine, my_lse, causal=causal, scale=scale)

        def check(op=None, kernel=None):
            class Planted(TestdevAccelerator):
                name = "testdev-planted"

                @classmethod
                def kernels(cls):
                    return {op: kernel}

            report = Report("testdev")
            run_kernel_checks(TestdevAccelerator() if kernel is None else Planted(), report)
            assert not any(c.skipped for c in report.checks), report.render()
            return report

        before = rt.counters()
        good = check()
        assert len(good.checks) == 3 and not good.failed, good.render()
        assert {c.name.split()[2] for c in good.checks} == {"rms_norm", "attention_lse", "attention_lse_backward"}
        moved = {k for k, n in rt.counters().items() if n > before[k]}
        assert moved == {"rms_norm_fwd", "rms_norm_bwd", "attention_lse_fwd", "attention_lse_bwd"}, moved
        for op, kernel, words in (
                ("rms_norm", off_in_value, 'rms_norm case "over the last dimension" with x [3, 5, 64], weight [64], '
                                           "float32: output 0"),
                ("rms_norm", off_in_gradient, "x [3, 5, 64], weight [64], float32: gradient of input 0"),
                ("attention_lse", lse_off, 'attention_lse case "MHA sq 16 sk 16 causal True" with q [2, 4, 16, 16], '
                                           "k [2, 4, 16, 16], v [2, 4, 16, 16], float32: output 1"),
                ("attention_lse_backward", own_lse_backward, "out [2, 4, 16, 16], lse [2, 4, 16], float32: output 0")):
            failed = check(op, kernel).failed
            assert len(failed) == 1 and f"kernel {op} " in failed[0].name, failed
            assert words in failed[0].detail and "> 1e-04, the band" in failed[0].detail, failed[0].detail
    """)


@pytest.mark.testdev
def test_conformance_cli_passes_the_kernels_suite_on_the_device() -> None:
    """``portspeed conformance --adapter testdev --suites kernels``: every declared kernel passes, nothing skipped."""
    res = run_python(["-m", "portspeed.cli", "conformance", "--adapter", "testdev", "--suites", "kernels"],
                     timeout=600)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    for op in ("rms_norm", "attention_lse", "attention_lse_backward"):
        assert f"vendor kernel {op} (portspeed.testing.testdev.kernels:{op})" in res.stdout, res.stdout[-3000:]
    assert "[skip]" not in res.stdout and "0 failed" in res.stdout, res.stdout[-3000:]
