"""A vendor's first day, run: the one-file adapter (examples/vendor_adapter.py: the test device as "Acme") named by
its file, a gap left out of it found and the printed line fixing it, its ranks finding the file from any directory,
and the example GPT trained with TP2 on it equal to the CPU TP1 run, through its own kernels (counted).

The test device is a C++ PrivateUse1 device with its own CCL (testccl): a test device, not hardware. Its
conformance run with every suite is tests/test_conformance.py's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers.launch import REPO, free_port, run_python

pytestmark = [pytest.mark.multiproc]

EXAMPLE = REPO / "examples" / "vendor_adapter.py"
TIMEOUT = 400
#: the BackendGaps line the test leaves out of the example (testccl refuses bf16 reduce-scatters)
LEFT_OUT = '        unsupported_dtypes=[("reduce_scatter", torch.bfloat16), ("reduce_scatter_tensor", torch.bfloat16)],\n'


def _conformance(cwd: Path, *args: str) -> tuple[int, str]:
    res = run_python(["-m", "portspeed.cli", "conformance", *args], timeout=TIMEOUT, cwd=cwd)
    return res.returncode, res.stdout + res.stderr


@pytest.mark.testdev
def test_an_undeclared_gap_is_printed_as_the_line_that_fixes_it(tmp_path: Path) -> None:
    """The example without its unsupported_dtypes line: conformance names the op, the dtype and what the backend did,
    and prints the field to write; the file with that printed field added passes (a relative file, from its cwd)."""
    text = EXAMPLE.read_text()
    assert LEFT_OUT in text
    adapter = tmp_path / "acme.py"
    adapter.write_text(text.replace(LEFT_OUT, ""))
    rc, out = _conformance(tmp_path, "--adapter", "acme.py:AcmeAccelerator", "--suites", "collectives")
    assert rc == 1, out[-4000:]
    failed = [ln for ln in out.splitlines() if "[FAIL]" in ln]
    assert len(failed) == 2, "\n".join(failed)  # the undeclared gap, and the declaration that fits
    assert "undeclared gap: reduce_scatter bfloat16: every op raised; reduce_scatter_tensor bfloat16: every op " \
           "raised" in failed[0], failed[0]
    written = re.search(r"write in the adapter's BackendGaps\(\.\.\.\): (.*?) \(first seen", failed[0]).group(1)
    assert written == LEFT_OUT.strip().rstrip(","), written
    lines = adapter.read_text().splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if "backend_gaps = BackendGaps(" in ln)
    adapter.write_text("".join(lines[:at + 1] + [f"        {written},\n"] + lines[at + 1:]))
    rc, out = _conformance(tmp_path, "--adapter", "acme.py:AcmeAccelerator", "--suites", "collectives")
    assert rc == 0 and "0 failed" in out, out[-4000:]


def test_every_rank_finds_a_relative_adapter_file_wherever_it_runs(tmp_path: Path) -> None:
    """`portspeed run` from the file's folder with a relative PORTSPEED_ACCELERATOR; each rank moves to another
    directory before selecting: both select the same file's class (the launcher handed them the absolute path)."""
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "acme_cpu.py").write_text(
        "from portspeed.adapters.cpu import CpuAccelerator\n\n\n"
        "class AcmeCpu(CpuAccelerator):\n    name = 'acme-cpu'\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "here" / "rank.py").write_text(
        "import json, os\n"
        f"os.chdir({str(tmp_path / 'elsewhere')!r})\n"
        "import portspeed\n"
        "acc = portspeed.get_accelerator()\n"
        "print('RANK ' + json.dumps({'name': acc.name, 'file': __import__('sys').modules[type(acc).__module__]"
        ".__file__, 'env': os.environ['PORTSPEED_ACCELERATOR'], 'cwd': os.getcwd()}), flush=True)\n")
    res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                      "--adaptor", "none", "rank.py"], timeout=TIMEOUT, cwd=tmp_path / "here",
                     env={"PORTSPEED_ACCELERATOR": "acme_cpu.py:AcmeCpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads(ln[5:]) for ln in res.stdout.splitlines() if ln.startswith("RANK ")]
    want = str(tmp_path / "here" / "acme_cpu.py")
    assert len(ranks) == 2 and all(r["name"] == "acme-cpu" and r["file"] == want and r["env"] == f"{want}:AcmeCpu"
                                   and r["cwd"] == str(tmp_path / "elsewhere") for r in ranks), ranks
