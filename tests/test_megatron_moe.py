"""MoE router gating without Transformer Engine: the 0.15/0.16 NameError is fixed there, and only there."""

from __future__ import annotations

import textwrap

import pytest
from helpers.launch import child_json
from packaging.specifiers import SpecifierSet

from portspeed.patches.megatron.ranges import MOE_TE_GEMM_UNBOUND
from portspeed.versions import gate_version

pytestmark = [pytest.mark.megatron]

PATCH = "megatron.core.moe.te_gemm_unbound"
PROBE = textwrap.dedent(
    """
    import json, torch
    import portspeed, portspeed.megatron_adaptor
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    inp, w = torch.randn(4, 8), torch.randn(3, 8)
    out = {"bound": "te_general_gemm" in moe_utils.__dict__}
    try:
        out["equal"] = bool(torch.allclose(router_gating_linear(inp, w, None, torch.float32), inp @ w.t()))
    except NameError as exc:
        out["error"] = str(exc)
    out["status"] = next(p["status"] for p in portspeed.report() if p["name"] == "%s")
    print(json.dumps(out))
    """ % PATCH
)


def _probe(**env: str) -> dict:
    """The probe's result in a child without this run's PORTSPEED_* settings, on the CPU adapter (plus ``env``)."""
    return child_json(PROBE, timeout=300, env={"PORTSPEED_ACCELERATOR": "cpu", **env}, drop=("PORTSPEED_*",))


def test_router_gating_runs_without_transformer_engine_and_the_fix_is_gated() -> None:
    release = gate_version("megatron-core").version
    out = _probe()
    assert out.get("equal") is True, out
    if release is not None and SpecifierSet(MOE_TE_GEMM_UNBOUND).contains(release, prereleases=True):
        assert out["status"] == "applied" and out["bound"] is False, out
        control = _probe(PORTSPEED_DISABLE=PATCH)  # the upstream bug is really there without the patch
        assert "te_general_gemm" in control.get("error", ""), control
    else:
        assert out["status"] == "inactive" and out["bound"] is True, out


SPLITS_PROBE = textwrap.dedent(
    """
    import json, torch
    import portspeed, portspeed.megatron_adaptor
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu
    counts = torch.tensor([73, 66])
    host = token_dispatcher.maybe_move_tensor_to_cpu(counts, as_numpy=True)  # the dispatcher's own binding
    out = {"type": type(host).__module__ + "." + type(host).__name__, "values": [int(v) for v in host],
           "tensor_kept": torch.is_tensor(maybe_move_tensor_to_cpu(counts)),
           "status": next(p["status"] for p in portspeed.report() if p["name"] == "megatron.core.moe.host_splits")}
    host[0] = 0
    out["copied"] = int(counts[0]) == 73
    print(json.dumps(out))
    """
)


def test_all_to_all_split_sizes_reach_the_host_as_numbers() -> None:
    """The dispatcher's split sizes come back as a NumPy copy off CUDA, as from a CUDA tensor (all_to_all_single
    rejects tensors); without the patch they stay tensors."""
    out = child_json(SPLITS_PROBE, timeout=300, env={"PORTSPEED_ACCELERATOR": "cpu"}, drop=("PORTSPEED_*",))
    assert out == {"type": "numpy.ndarray", "values": [73, 66], "tensor_kept": True, "status": "applied",
                   "copied": True}, out
    control = child_json(SPLITS_PROBE, timeout=300, drop=("PORTSPEED_*",),
                         env={"PORTSPEED_ACCELERATOR": "cpu", "PORTSPEED_DISABLE": "megatron.core.moe.host_splits"})
    assert control["type"] == "torch.Tensor" and control["status"] == "disabled", control
