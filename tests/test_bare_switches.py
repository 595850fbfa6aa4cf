"""The bare variant of the test device (``PORTSPEED_TESTDEV_BARE``, portspeed/testing/testdev/bare.py): each switch
plants its fault in the same built library, unset changes nothing, and a name that is no fault is refused.

What portspeed and conformance make of those faults, end to end: tests/test_bare_device.py. The test device is a
C++ PrivateUse1 device, not hardware.
"""

from __future__ import annotations

import pytest

from helpers.launch import child_json

TIMEOUT = 400

_PROBE = '''
    import datetime, json
    import torch, torch.distributed as dist
    import portspeed.testing.testdev.runtime as rt
    dev = torch.device("testdev", 0)
    got = {"faults": list(rt.bare_faults()),
           "shallow": torch._has_compatible_shallow_copy_type(torch.empty(1), torch.empty(1, device=dev))}
    try:
        torch.accelerator.get_memory_info(0)
        got["memory"] = "answered"
    except NotImplementedError:
        got["memory"] = "NotImplementedError"
    q = torch.randn(1, 2, 8, 16)
    got["sdpa"] = torch.allclose(torch.nn.functional.scaled_dot_product_attention(q.to(dev), q.to(dev), q.to(dev))
                                 .cpu(), torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-5)
    x = torch.randn(64)
    got["gelu"] = [round((torch.nn.functional.gelu(x.to(dev)).cpu().abs().max() /
                         torch.nn.functional.gelu(x).abs().max()).item(), 4)]
    xd = x.to(dev).requires_grad_()
    torch.nn.functional.gelu(xd).sum().backward()
    xh = x.clone().requires_grad_()
    torch.nn.functional.gelu(xh).sum().backward()
    got["gelu"].append(round((xd.grad.cpu().abs().max() / xh.grad.abs().max()).item(), 4))
    xd = x.view(8, 8).to(dev).requires_grad_()
    xh = x.view(8, 8).clone().requires_grad_()
    ln = [torch.nn.functional.layer_norm(t, (8,)) for t in (xd, xh)]
    got["layer_norm"] = [round((ln[0].detach().cpu().abs().max() / ln[1].detach().abs().max()).item(), 4)]
    for t in ln:
        (t * torch.arange(8.0, device=t.device)).sum().backward()
    got["layer_norm"].append(round((xd.grad.cpu().abs().max() / xh.grad.abs().max()).item(), 4))
    host = torch.get_rng_state()
    torch.nn.functional.dropout(torch.ones(64, device=dev), 0.5)
    got["host_rng"] = not torch.equal(host, torch.get_rng_state())
    dist.init_process_group("testccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    out = torch.zeros(4, device=dev)
    dist.all_gather_into_tensor(out, torch.arange(1.0, 5.0, device=dev))
    got["all_gather"] = out.cpu().tolist()
    dist.destroy_process_group()
    import portspeed
    got["adapter"] = portspeed.get_accelerator().name  # selection: detects the shallow-copy answer, fixes it
    m = torch.nn.Linear(2, 2)
    w = m.weight
    w.tensor_model_parallel = True
    m.to(dev)
    got["kept"] = m.weight is w and getattr(m.weight, "tensor_model_parallel", False)
    print(json.dumps(got))
'''


@pytest.mark.testdev
@pytest.mark.parametrize("bare", ["", "all"])
def test_each_switch_plants_its_fault_and_the_default_is_unchanged(bare: str) -> None:
    """PORTSPEED_TESTDEV_BARE=all: no shallow-copy kernel, memory info raises, SDPA wrong, random ops on the host
    generator, the CCL moves nothing, gelu and layer_norm and their gradients 1.25x; unset: none of these. On both,
    module.to keeps the
    Parameter after selection (on the bare device because portspeed registered the kernel)."""
    got = child_json(_PROBE, timeout=TIMEOUT, env={"PORTSPEED_TESTDEV_BARE": bare, "PORTSPEED_ACCELERATOR": "testdev"})
    on = bool(bare)
    assert got["faults"] == (["no-memory-info", "no-shallow-copy", "wrong-sdpa", "host-rng", "stub-ccl",
                              "wrong-gelu", "wrong-layer-norm"] if on else []), got
    assert got["gelu"] == got["layer_norm"] == ([1.25, 1.25] if on else [1.0, 1.0]), got
    assert got["shallow"] is not on and got["memory"] == ("NotImplementedError" if on else "answered"), got
    assert got["sdpa"] is not on and got["host_rng"] is on, got
    assert got["all_gather"] == ([0.0] * 4 if on else [1.0, 2.0, 3.0, 4.0]), got
    assert got["adapter"] == "testdev" and got["kept"] is True, got


def test_a_bare_value_that_names_no_fault_is_refused_in_one_line() -> None:
    """A typo in PORTSPEED_TESTDEV_BARE is refused before the library loads, listing the faults."""
    from portspeed.testing.testdev.bare import BareValueError, faults

    assert faults("wrong-sdpa, host-rng") == ("wrong-sdpa", "host-rng")
    assert faults("all") == ("no-memory-info", "no-shallow-copy", "wrong-sdpa", "host-rng", "stub-ccl", "wrong-gelu",
                             "wrong-layer-norm")
    with pytest.raises(BareValueError, match="'wrong-sdp' is not a fault of the bare test device; give a comma "
                                             "list of no-memory-info, no-shallow-copy"):
        faults("wrong-sdp")
