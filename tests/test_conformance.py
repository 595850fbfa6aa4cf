"""The conformance kit (``portspeed conformance``) proves the test device and refuses bad input.

The kit is what a vendor runs on its own hardware; the test device (a C++ PrivateUse1
device, not hardware) is its first customer, so CI runs the whole kit against it, presented as a
new vendor's one-file adapter (examples/vendor_adapter.py). On the
CPU adapter the separation checks do not apply and are reported as skipped, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.launch import run_python

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]


def _kit(*args: str) -> tuple[int, str, str]:
    res = run_python(["-m", "portspeed.cli", "conformance", *args], timeout=900)
    return res.returncode, res.stdout, res.stderr


@pytest.mark.testdev
def test_the_one_file_vendor_adapter_passes_every_suite(tmp_path: Path) -> None:
    """examples/vendor_adapter.py (the test device as a new vendor's device, named by its file): device, kernels (its
    five, and DeepSpeed's quantizer), collectives (declared gaps run raw first, then rewritten through the router)
    and training all pass."""
    out_json = tmp_path / "kit.json"
    rc, out, err = _kit("--adapter", "examples/vendor_adapter.py:AcmeAccelerator", "--declared-gaps",
                        "--json", str(out_json))
    assert rc == 0, f"exit {rc}\n{out[-6000:]}\n{err[-3000:]}"
    checks = json.loads(out_json.read_text())["checks"]
    suites = {c["suite"] for c in checks}
    assert suites == {"device", "kernels", "collectives", "training"}
    assert not any(c["skipped"] for c in checks), "nothing may be skipped on a device that is not the host"
    kernels = {c["name"].split()[2] for c in checks if c["name"].startswith("vendor kernel ")}
    assert kernels == {"attention", "attention_lse", "attention_lse_backward", "rms_norm", "grouped_mm"}, kernels
    # DeepSpeed's quantizer (ZeRO++), portspeed's torch ops on the device, against its float reference
    assert [c["ok"] for c in checks if c["name"].startswith("DeepSpeed QuantizerBuilder")] == [True]
    raw = sorted(c["name"] for c in checks if c["name"].startswith("raw declared "))
    assert len(raw) == 5 and all(c.endswith(": the raw backend shows it") for c in raw), raw  # every item is needed
    assert sum(c["suite"] == "collectives" for c in checks) >= 140  # every collective x dtype x op really ran
    assert "matches CPU record" in out or "matches a CPU run here" in out


def test_cpu_adapter_skips_separation_with_the_reason() -> None:
    """On the host adapter, separation checks are skipped saying why; the rest of the device suite passes."""
    rc, out, err = _kit("--adapter", "cpu", "--suites", "device")
    assert rc == 0, f"exit {rc}\n{out}\n{err[-3000:]}"
    assert out.count("[skip]") == 3 and "the device is the host on this adapter" in out
    assert "0 failed" in out


@pytest.mark.parametrize("args,words", [
    (["--adapter", "no-such-device"], "--adapter 'no-such-device' is not an adapter; accepted: cpu"),
    (["--adapter", "cpu", "--suites", "device,speed"], "unknown speed"),
    (["--adapter", "cpu", "--nproc", "1"], "at least 2 ranks"),
])
def test_bad_input_is_refused_with_one_message(args: list[str], words: str) -> None:
    """An unknown adapter or suite, or too few ranks: exit 2 and a message naming what was wrong."""
    rc, out, err = _kit(*args)
    assert rc == 2 and words in err, f"exit {rc}\n{out}\n{err[-2000:]}"
