"""PORTSPEED_NAN_CHECK: a NaN carried by a collective is named at that collective, on Gloo, the stand-in and testccl.

Each backend runs tests/data/nan_faults.py under `portspeed run` (2 ranks, real process groups): an all_reduce of
+inf and -inf (no input holds NaN, every output does) raises on both ranks, synchronous and at wait(); a
broadcast into a NaN-filled buffer off the source raises nothing (that buffer is an output); a NaN in rank 1's
all_reduce input raises on rank 1 at that line, naming it. Where torch has a NanCheckHook (torch >= 2.15) and
the backend is a C++ one (Gloo, testccl), torch found the input NaN; on the stand-in (a Python process group)
and on older torch, portspeed did.
"""

from __future__ import annotations

import re

import pytest
import torch
from packaging.version import Version

from helpers.launch import REPO, free_port, run_python

from portspeed import config
from portspeed.errors import ConfigError

SCRIPT = REPO / "tests" / "data" / "nan_faults.py"
TORCH_HOOK = Version(torch.__version__.split("+")[0]) >= Version("2.15")


def _site(tag: str) -> str:
    for n, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# site: {tag}"):
            return f"nan_faults.py:{n}"
    raise AssertionError(f"no '# site: {tag}' in {SCRIPT}")


#: backend label -> (environment, whether torch's hook serves its groups)
BACKENDS = {"cpu": ({"PORTSPEED_ACCELERATOR": "cpu"}, True),
            "standin": ({"PORTSPEED_ACCELERATOR": "cpu", "PORTSPEED_BACKEND": "standin"}, False),
            "testdev": ({"PORTSPEED_ACCELERATOR": "testdev"}, True)}


@pytest.mark.multiproc
@pytest.mark.torch_hooks
@pytest.mark.parametrize("backend", [pytest.param(b, marks=[pytest.mark.testdev] if b == "testdev" else [])
                                     for b in BACKENDS])
def test_nan_is_named_at_the_collective(backend: str) -> None:
    env, cpp = BACKENDS[backend]
    res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                      "--master-port", str(free_port()), str(SCRIPT)], timeout=240,
                     env={**env, "PORTSPEED_FRAMEWORK_MODULES": "__main__", "PORTSPEED_NAN_CHECK": "1"},
                     drop=["PORTSPEED_TRACE", "TORCH_DIST_NAN_CHECK"])
    text = res.stdout + res.stderr
    assert res.returncode == 1, text[-4000:]
    for r in (0, 1):
        for mode, tag in (("output", "output"), ("async", "async")):
            line = next((x for x in text.splitlines() if x.startswith(f"rank {r} {mode}: ")), "")
            assert line.startswith(f"rank {r} {mode}: NaN in the output of all_reduce on rank {r} "
                                   f"(group 0 (default_pg), ranks [0, 1]) at {_site(tag)}: the tensor [4] float32 "
                                   "holds 4 NaN of 4"), text[-4000:]
            assert "found by portspeed" in line
        assert f"rank {r} broadcast: 4.0" in text  # a NaN-filled receive buffer is not an input
    got = re.findall(r"CollectiveNaNError: (.*)", text)
    who = "torch's NanCheckHook" if cpp and TORCH_HOOK else "portspeed"
    assert got == [f"NaN in the input of all_reduce on rank 1 (group 0 (default_pg), ranks [0, 1]) at "
                   f"{_site('input')}: the tensor [4] float32 holds 1 NaN of 4 (found by {who}; PORTSPEED_NAN_CHECK=1)"
                   ], text[-4000:]
    assert "rank 1 input: no error" not in text and "rank 1 (local rank 1 on" in text.splitlines()[-1]


@pytest.mark.torch_hooks
def test_bad_switch_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^PORTSPEED_NAN_CHECK='maybe' is not a boolean"):
        config.Settings.from_env({"PORTSPEED_NAN_CHECK": "maybe"})
    assert config.Settings.from_env({"PORTSPEED_NAN_CHECK": "on"}).nan_check
    res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "2", str(SCRIPT)], timeout=120,
                     env={"PORTSPEED_ACCELERATOR": "cpu", "PORTSPEED_NAN_CHECK": "maybe"})
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and lines[-1].startswith("portspeed run: error: PORTSPEED_NAN_CHECK='maybe' is not a "
                                                        "boolean"), res.stderr[-2000:]
    assert "Traceback" not in res.stderr
