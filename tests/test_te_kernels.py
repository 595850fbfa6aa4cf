"""The portable TE's kernel registry and the vendor kernel slot: preference, overrides, refusals, conformance.

What must hold (issue 23): each operation is served vendor -> torch -> reference, decided once per
process from the adapter's declarations and torch's checks; ``PORTSPEED_TE_KERNELS`` moves the start
(an unavailable forced choice falls back, with a warning) and is refused by name when it names an
unknown op or implementation; an adapter kernel with the wrong signature is refused at activation
naming the adapter and the op; the conformance suite names a planted wrong kernel; every torch
implementation matches its reference (fp32 tight, bf16 within the band).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from portspeed import config
from portspeed.accelerator import adapter_class, get_accelerator, set_accelerator
from portspeed.accelerator.kernel_ops import KERNEL_OPS, KernelContractError, check_declared, check_kernel
from portspeed.conformance.kernels import compare_kernel, run_kernel_checks
from portspeed.conformance.report import Report
from portspeed.errors import ConfigError
from portspeed.portable_te import kernels, norms
from portspeed.portable_te.grouped import GroupedLinear, grouped_mm_reference, grouped_mm_torch
from portspeed.portable_te.rope import rope_reference, rope_torch

pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py: clean settings and selection

Cpu = adapter_class("cpu")
CALLS: list[str] = []


def counting_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A correct vendor rms_norm that counts its calls."""
    CALLS.append("rms_norm")
    return norms.rms_norm_reference(x, weight, eps)


def wrong_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A planted wrong kernel: the mean of |x| where the contract says the root mean square."""
    xf = x.float()
    return (xf / (xf.abs().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def swapped_rms_norm(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * weight


def _adapter(declared: dict[str, Any], grouped: bool = False) -> Any:
    """A CPU adapter that declares ``declared`` as its kernels (and, with ``grouped``, torch's grouped GEMM)."""

    class Vendor(Cpu):  # type: ignore[misc, valid-type]
        name = "vendor-cpu"

        @classmethod
        def kernels(cls) -> dict[str, Any]:
            return dict(declared)

    class GroupedVendor(Vendor):
        def has_grouped_mm(self, dtype: torch.dtype) -> bool:
            return True

    return GroupedVendor() if grouped else Vendor()


def test_ops_are_one_list() -> None:
    assert tuple(KERNEL_OPS) == config.TE_KERNEL_OPS == tuple(kernels.TABLE)


# ------------------------------------------------------------------ preference
def test_default_preference_on_the_cpu_adapter() -> None:
    got = {c.op: c.impl for c in kernels.choices()}
    assert got == {"attention": "torch", "attention_lse": "torch", "attention_lse_backward": "torch",
                   "rms_norm": "torch", "layer_norm": "torch", "rope": "torch", "swiglu": "reference",
                   "grouped_mm": "reference"}
    assert kernels.kernel("rms_norm") is norms.rms_norm_torch
    assert "declares no vendor kernel" in kernels.choice("rms_norm").why


def test_vendor_kernel_wins_and_is_reached_through_the_norm() -> None:
    set_accelerator(_adapter({"rms_norm": counting_rms_norm}))
    CALLS.clear()
    x, w = torch.randn(4, 32), torch.randn(32)
    out = norms.rms_norm(x, w, 1e-5, zero_centered_gamma=False)
    assert CALLS == ["rms_norm"] and kernels.choice("rms_norm").impl == "vendor"
    assert torch.equal(out, norms.rms_norm_reference(x, w, 1e-5))
    assert kernels.choice("layer_norm").impl == "torch"  # undeclared ops keep torch's


def test_choice_is_made_once_until_the_adapter_changes(caplog: pytest.LogCaptureFixture) -> None:
    declared: dict[str, Any] = {}
    acc = _adapter(declared)
    set_accelerator(acc)
    with caplog.at_level(logging.INFO, logger="portspeed"):
        first = kernels.kernel("rms_norm")
        declared["rms_norm"] = counting_rms_norm  # a later declaration does not change the choice ...
        assert kernels.kernel("rms_norm") is first is norms.rms_norm_torch
    assert sum("rms_norm runs the torch" in r.getMessage() for r in caplog.records) == 1  # logged once
    set_accelerator(_adapter({"rms_norm": counting_rms_norm}))  # ... a new adapter does
    assert kernels.kernel("rms_norm") is counting_rms_norm
    kernels.reset()
    assert kernels.kernel("rms_norm") is counting_rms_norm


def test_import_paths_resolve_at_first_use() -> None:
    set_accelerator(_adapter({"rms_norm": "portspeed.portable_te.norms:rms_norm_reference",
                              "layer_norm": "no_such_vendor_module:layer_norm"}))  # activation imports nothing
    assert kernels.kernel("rms_norm") is norms.rms_norm_reference and kernels.choice("rms_norm").impl == "vendor"
    with pytest.raises(KernelContractError, match="adapter 'vendor-cpu', kernel 'layer_norm'.*cannot import"):
        kernels.kernel("layer_norm")


# ------------------------------------------------------------------ PORTSPEED_TE_KERNELS
def test_reference_forced_for_every_op(portspeed_env: Any) -> None:
    portspeed_env(PORTSPEED_TE_KERNELS="reference")
    assert {c.impl for c in kernels.choices()} == {"reference"}
    assert kernels.kernel("rope") is rope_reference


def test_per_op_override_and_forced_fallback(portspeed_env: Any, caplog: pytest.LogCaptureFixture) -> None:
    portspeed_env(PORTSPEED_TE_KERNELS="vendor,rms_norm=reference,swiglu=torch")
    with caplog.at_level(logging.WARNING, logger="portspeed"):
        got = {c.op: c for c in kernels.choices()}
    assert got["rms_norm"].impl == "reference" and got["layer_norm"].impl == "torch"
    assert got["swiglu"].impl == "reference"  # torch has no fused swiglu: one step down, with a warning
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("asks for the torch swiglu" in m for m in warned), warned
    assert any("asks for the vendor attention" in m for m in warned), warned  # cpu declares none: torch runs


@pytest.mark.parametrize("value,words", [
    ("fast", ["'fast' is not an implementation", "vendor, torch, reference"]),
    ("attention=cuda", ["'cuda' is not an implementation"]),
    ("softmax=torch", ["'softmax' is not an operation", "grouped_mm"]),
    ("torch,reference", ["sets the default twice"]),
])
def test_bad_setting_is_refused_by_name(value: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as got:
        config.Settings.from_env({"PORTSPEED_TE_KERNELS": value})
    assert f"PORTSPEED_TE_KERNELS={value!r}" in str(got.value)
    for w in words:
        assert w in str(got.value)


def test_setting_parses() -> None:
    s = config.Settings.from_env({"PORTSPEED_TE_KERNELS": " Torch , attention=reference "})
    assert s.te_kernels == (("*", "torch"), ("attention", "reference"))
    assert s.te_kernel_start("attention") == "reference" and s.te_kernel_start("rope") == "torch"
    assert config.Settings().te_kernel_start("rope") == "vendor"


# ------------------------------------------------------------------ the slot's refusals
def test_wrong_signature_refused_at_activation_naming_adapter_and_op() -> None:
    with pytest.raises(KernelContractError) as got:
        set_accelerator(_adapter({"rms_norm": swapped_rms_norm}))
    assert "adapter 'vendor-cpu', kernel 'rms_norm'" in str(got.value) and "order" in str(got.value)
    assert get_accelerator().name == "cpu"  # the refused adapter was not activated

    def no_eps(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x

    assert "missing parameter(s) eps" in (check_kernel("rms_norm", no_eps) or "")
    for declared, words in (({"softmax": counting_rms_norm}, "'softmax', which is not an operation"),
                            ({"rms_norm": "not a path"}, "is not an import path"),
                            ({"rms_norm": no_eps}, "missing parameter(s) eps")):
        with pytest.raises(KernelContractError, match="adapter 'x'") as got:
            check_declared("x", declared)
        assert words in str(got.value)


def test_wrong_signature_refused_when_the_adapter_is_selected(portspeed_env: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection path (PORTSPEED_ACCELERATOR, what the adaptors' activation runs) refuses it too."""
    from portspeed.accelerator import selection

    bad = type(_adapter({"rms_norm": swapped_rms_norm}))
    portspeed_env(PORTSPEED_ACCELERATOR="cpu")
    monkeypatch.setattr(selection, "adapter_class", lambda name: bad)
    with pytest.raises(KernelContractError, match="adapter 'vendor-cpu', kernel 'rms_norm'"):
        get_accelerator()


def test_resolved_path_with_wrong_signature_refused_at_first_use() -> None:
    set_accelerator(_adapter({"rms_norm": "portspeed.portable_te.swiglu:swiglu_reference"}))
    with pytest.raises(KernelContractError, match="adapter 'vendor-cpu', kernel 'rms_norm'.*missing parameter"):
        kernels.kernel("rms_norm")


# ------------------------------------------------------------------ conformance
def test_conformance_names_a_planted_wrong_kernel_and_passes_a_right_one() -> None:
    report = Report("vendor-cpu")
    run_kernel_checks(_adapter({"rms_norm": wrong_rms_norm, "layer_norm": norms.layer_norm_torch,
                                "rope": rope_torch}), report)
    failed = report.failed
    assert [c.name.split()[2] for c in failed] == ["rms_norm"], report.render()
    assert 'rms_norm case "over the last dimension" with x [3, 5, 64], weight [64], float32: output 0: error ' \
        in failed[0].detail and "> 1e-04, the band" in failed[0].detail, failed[0].detail
    assert len(report.checks) == 3 and not any(c.skipped for c in report.checks)


def test_conformance_skips_an_adapter_without_kernels() -> None:
    report = Report("cpu")
    run_kernel_checks(Cpu(), report)
    assert len(report.checks) == 1 and report.checks[0].skipped and "declares no kernels()" in report.checks[0].detail


@pytest.mark.parametrize("op", [op for op, row in kernels.TABLE.items() if row.torch is not None])
def test_torch_implementation_matches_the_reference(op: str) -> None:
    """Every torch implementation passes the conformance bands (fp32 1e-4, bf16 3e-2; values and gradients)."""
    set_accelerator(_adapter({}, grouped=True))  # so grouped_mm_torch takes torch's grouped_mm, not the loop
    assert compare_kernel(op, kernels.import_path(kernels.TABLE[op].torch), "cpu") is None


def test_norm_and_rope_torch_forms_are_tight_in_fp32() -> None:
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(6, 128, generator=g) * 3, torch.randn(128, generator=g), torch.randn(128, generator=g)
    assert torch.allclose(norms.rms_norm_torch(x, w, 1e-5), norms.rms_norm_reference(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(norms.layer_norm_torch(x, w, b, 1e-5), norms.layer_norm_reference(x, w, b, 1e-5))
    t, f = torch.randn(8, 2, 3, 64, generator=g), torch.rand(8, 1, 1, 48, generator=g) * 6
    for interleaved in (False, True):
        assert torch.equal(rope_torch(t, f, interleaved=interleaved), rope_reference(t, f, interleaved=interleaved))


# ------------------------------------------------------------------ grouped GEMM in GroupedLinear
def _grouped_run(acc: Any) -> tuple[torch.Tensor, ...]:
    set_accelerator(acc)
    torch.manual_seed(0)
    layer = GroupedLinear(3, 16, 8, bias=True, device="cpu", init_method=torch.nn.init.normal_)
    x = torch.randn(10, 16, requires_grad=True)
    out = layer(x, [3, 0, 7])
    out.sum().backward()  # an expanded gradient: the grouped path must take it
    return (tuple(layer.state_dict()), out.detach(), x.grad, *(p.grad for p in layer.parameters()))


def test_grouped_linear_takes_torch_grouped_mm_where_declared_and_equals_the_loop() -> None:
    loop = _grouped_run(Cpu())
    assert kernels.kernel("grouped_mm") is grouped_mm_reference
    grouped = _grouped_run(_adapter({}, grouped=True))
    assert kernels.kernel("grouped_mm") is grouped_mm_torch
    assert loop[0] == grouped[0] == ("weight0", "bias0", "weight1", "bias1", "weight2", "bias2",
                                   "_extra_state")  # the checkpoint keys stay
    for a, b in zip(loop[1:], grouped[1:]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ portspeed info
def test_plan_reads_declarations_only() -> None:
    """An import path that does not exist is shown as declared: the plan imports no kernel."""
    acc = _adapter({"attention": "no_such_vendor_module:fused_attention"})
    got = {c.op: c for c in kernels.plan(type(acc))}
    assert got["attention"].impl == "vendor" and "no_such_vendor_module:fused_attention" in got["attention"].why
    assert got["rms_norm"].impl == "torch" and got["grouped_mm"].impl == "reference"
    assert "has_grouped_mm" in got["grouped_mm"].why
    forced = {c.op: c.impl for c in kernels.plan(type(acc), config.Settings.from_env(
        {"PORTSPEED_TE_KERNELS": "attention=torch,reference"}))}
    assert forced["attention"] == "torch" and forced["rms_norm"] == "reference"


@pytest.mark.parametrize("setting,rms_norm", [("", "vendor"), ("reference", "reference"),
                                              ("torch,attention=vendor", "torch"), ("rms_norm=reference", "reference")])
@pytest.mark.parametrize("grouped", [False, True])
def test_plan_and_first_use_walk_one_ladder(setting: str, rms_norm: str, grouped: bool, portspeed_env: Any) -> None:
    """The plan (from the class, nothing imported) and the choice at first use (the live adapter) agree, op by op,
    with the same reasons: one walk down vendor -> torch -> reference."""
    portspeed_env(PORTSPEED_TE_KERNELS=setting or None)
    acc = _adapter({"rms_norm": norms.rms_norm_reference, "swiglu": "portspeed.portable_te.swiglu:swiglu_reference"},
                   grouped=grouped)
    set_accelerator(acc)
    kernels.reset()
    planned = kernels.plan(type(acc))
    assert [(c.op, c.impl, c.why) for c in planned] == [(c.op, c.impl, c.why) for c in kernels.choices()]
    assert {c.op: c.impl for c in planned}["rms_norm"] == rms_norm


def test_info_prints_the_table_from_declarations() -> None:
    from portspeed.cli import info

    rows = info.te_kernels("cpu", config.Settings())
    assert [r["op"] for r in rows] == list(KERNEL_OPS) and rows[0]["impl"] == "torch"
    text = info.render({"portspeed": "x", "python": "3", "platform": "p", "versions": {"torch": "2"},
                        "adapters": [], "patch_sets": [], "te_kernels": rows})
    assert "portable Transformer Engine kernels" in text and "grouped_mm" in text


def test_cuda_declares_grouped_mm_for_bf16_on_sm80_and_later(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = adapter_class("cuda")()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, dtype, want in (((9, 0), torch.bfloat16, True), ((8, 0), torch.bfloat16, True),
                                    ((7, 5), torch.bfloat16, False), ((9, 0), torch.float32, False),
                                    ((9, 0), torch.float16, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert cuda.has_grouped_mm(dtype) is want, (capability, dtype)
    assert Cpu().has_grouped_mm(torch.bfloat16) is False


def test_conformance_command_runs_the_kernels_suite() -> None:
    from helpers.launch import run_python

    res = run_python(["-m", "portspeed.cli", "conformance", "--adapter", "cpu", "--suites", "kernels"], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[skip] kernels: vendor kernels match the reference" in res.stdout and "declares no kernels()" in res.stdout
