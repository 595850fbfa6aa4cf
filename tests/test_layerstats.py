"""portspeed.parity.layerstats: hook-recorded layer statistics and `portspeed compare --layers`."""

from __future__ import annotations

import io
import json

import pytest

from helpers.requires import require
import torch
from torch import nn

from portspeed.parity import compare as compare_cli
from portspeed.parity.layerstats import LayerStatsError, LayerStatsRecorder, compare_layers, load_layer_stats


class GradScale(torch.autograd.Function):
    """Identity forward, scaled gradient backward: a difference only the backward pass can see."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class Scaler(nn.Module):
    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s

    def forward(self, x):
        return GradScale.apply(x, self.s)


def model(seed: int = 0, grad_scale: float = 1.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), Scaler(grad_scale), nn.Tanh(), nn.Linear(8, 1))


def train(m: nn.Module, path, iterations=(2,), steps: int = 3, tweak=None) -> dict:
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with LayerStatsRecorder(m, iterations=iterations, path=path, meta={"name": str(path)}) as rec:
        for it in range(1, steps + 1):
            if tweak and it == tweak[0]:
                tweak[1](m)
            with rec.iteration(it):
                loss = m(x).pow(2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
    return load_layer_stats(path)


def test_same_runs_agree_and_only_requested_iterations_are_recorded(tmp_path):
    """Two identical runs agree everywhere; only iteration 2 is in the file; leaf modules only."""
    a = train(model(), tmp_path / "a.json")
    b = train(model(), tmp_path / "b.json")
    assert list(a["iterations"]) == ["2"]
    mods = [e["module"] for e in a["iterations"]["2"]["forward"]]
    assert mods == ["0", "1", "2", "3", "4", "5"]
    assert len(a["iterations"]["2"]["backward"]) == 6
    d = compare_layers(a, b)
    assert d.ok and d.compared == 12


def test_forward_difference_is_located_at_the_first_changed_module(tmp_path):
    """A weight changed in module '2' before iteration 2 is reported at module '2' in forward, not earlier."""
    def bump(m):
        with torch.no_grad():
            m[2].weight[0, 0] += 1e-3
    a = train(model(), tmp_path / "a.json")
    b = train(model(), tmp_path / "b.json", tweak=(2, bump))
    d = compare_layers(a, b)
    assert (d.iteration, d.phase, d.module) == (2, "forward", "2")


def test_backward_only_difference_is_located_in_backward_order(tmp_path):
    """A gradient-only change (module '3' scales its gradient) leaves activations equal at iteration 1
    and is found in the backward pass at the first gradient that passes through it."""
    a = train(model(grad_scale=1.0), tmp_path / "a.json", iterations=(1,), steps=1)
    b = train(model(grad_scale=1.5), tmp_path / "b.json", iterations=(1,), steps=1)
    d = compare_layers(a, b)
    assert d.phase == "backward"
    # the gradient of module 3's output is unchanged (the scaling applies to its input), so '2' is first
    assert d.module == "2"


def test_hooks_are_removed_on_close(tmp_path):
    """After the with block no hook remains on any module."""
    m = model()
    with LayerStatsRecorder(m, iterations=[1]):
        assert any(len(mod._forward_hooks) for mod in m.modules())
    assert not any(len(mod._forward_hooks) for mod in m.modules())


def test_cli_layers_exit_codes(tmp_path):
    """--layers: 0 when equal, 1 naming the module, 2 for a file that is not layer statistics."""
    def bump(m):
        with torch.no_grad():
            m[5].bias += 1e-2
    a = train(model(), tmp_path / "a.json", iterations=(1,))
    b = train(model(), tmp_path / "b.json", iterations=(1,))
    c = train(model(), tmp_path / "c.json", iterations=(1,), tweak=(1, bump))
    out = io.StringIO()
    assert compare_cli.main(["--layers", str(tmp_path / "a.json"), str(tmp_path / "b.json")], out=out) == 0
    out = io.StringIO()
    assert compare_cli.main(["--layers", str(tmp_path / "a.json"), str(tmp_path / "c.json")], out=out) == 1
    # the last layer's bias changed before iteration 1: modules 0-4 agree, module 5's output differs
    assert "module '5'" in out.getvalue() and "iteration 1" in out.getvalue()
    assert "5 earlier entries agreed" in out.getvalue()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"iterations": []}))
    err = io.StringIO()
    assert compare_cli.main(["--layers", str(tmp_path / "a.json"), str(bad)], out=io.StringIO(), err=err) == 2
    assert "not a layer-statistics file" in err.getvalue()


def test_bad_arguments():
    """No iterations to record, and files without a common iteration, are refused with what to do."""
    with pytest.raises(LayerStatsError, match="name the iterations"):
        LayerStatsRecorder(model(), iterations=[])
    with pytest.raises(LayerStatsError, match="record the same iteration"):
        compare_layers({"iterations": {"1": {}}}, {"iterations": {"2": {}}})


@pytest.mark.megatron
def test_megatron_gpt_difference_is_located(tmp_path):
    """On a real megatron-core GPTModel (in a subprocess: the adaptor must not patch this test process),
    one changed weight in layer 1's MLP is named as the first differing module."""
    require("megatron.core", "pip install 'portspeed[megatron]'")
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "data" / "gpt_layerstats.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    d = compare_layers(load_layer_stats(tmp_path / "a.json"), load_layer_stats(tmp_path / "b.json"))
    assert (d.phase, d.module) == ("forward", "decoder.layers.1.mlp.linear_fc1")
    assert d.compared > 10  # embedding and all of layer 0 agreed first
