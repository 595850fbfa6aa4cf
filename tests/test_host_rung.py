"""The host rung (portspeed.accelerator.host_rung): each torch op ``wrong_torch_ops`` may name runs on the host.

On the test device (a C++ PrivateUse1 device, not hardware), an adapter that declares every op of ``HOST_OPS``
wrong: each op, forward and backward, fp32 and bf16, still matches the CPU through conformance's own comparison, and
every aten operator behind each name ran on the host rung (its counters), so none slipped past it to the device's
kernel. With the rung suspended the device's kernels serve again (the counters stand still). The gelu that the
bare device gets wrong, found and fixed end to end: tests/test_bare_device.py.
"""

from __future__ import annotations

import pytest

from helpers.launch import child_json

_PROBE = '''
    import json
    import portspeed
    from portspeed.accelerator import host_rung
    from portspeed.conformance.torch_ops import compare_torch_op
    acc = portspeed.get_accelerator()
    out = {"declared": list(acc.wrong_torch_ops), "registered": list(host_rung.registered())}
    out["bad"] = {op: compare_torch_op(op, acc.device(0)) for op in host_rung.HOST_OPS}
    out["calls"] = host_rung.calls()
    with host_rung.suspended():
        out["suspended"] = list(host_rung.registered())
        compare_torch_op("gelu", acc.device(0))
    out["after"] = host_rung.calls()
    out["back"] = list(host_rung.registered())
    print(json.dumps(out))
'''

_ADAPTER = '''
from portspeed.accelerator.host_rung import HOST_OPS
from portspeed.testing.testdev.adapter import TestdevAccelerator


class EveryOpOnTheHost(TestdevAccelerator):
    name = "every-op-on-the-host"
    wrong_torch_ops = tuple(HOST_OPS)
'''


@pytest.mark.testdev
def test_every_declared_op_runs_on_the_host_and_matches_the_cpu(tmp_path) -> None:
    """Every HOST_OPS name declared: each matches the CPU, each aten op behind it ran on the host rung; suspended,
    none is registered and gelu reaches the device's kernel (the counters stand still); then it is back."""
    from portspeed.accelerator.host_rung import HOST_OPS

    adapter = tmp_path / "every_op.py"
    adapter.write_text(_ADAPTER)
    got = child_json(_PROBE, timeout=240, env={"PORTSPEED_ACCELERATOR": f"{adapter}:EveryOpOnTheHost"})
    assert got["declared"] == got["registered"] == list(HOST_OPS), got
    assert got["bad"] == {op: None for op in HOST_OPS}, got["bad"]
    missed = [aten for names in HOST_OPS.values() for aten in names if not got["calls"].get(aten)]
    assert not missed, (missed, got["calls"])
    assert got["suspended"] == [] and got["after"] == got["calls"] and got["back"] == list(HOST_OPS), got
