"""MoE router gating without Transformer Engine: the 0.15/0.16 NameError is fixed there, and only there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
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
    print("RESULT " + json.dumps(out))
    """ % PATCH
)


def _probe(**env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PORTSPEED_")}
    full.update(PORTSPEED_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **env)
    res = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.split("RESULT ", 1)[1])


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
