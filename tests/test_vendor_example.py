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

from helpers.launch import REPO, free_port, parse_losses, run_python

pytestmark = [pytest.mark.multiproc]

EXAMPLE = REPO / "examples" / "vendor_adapter.py"
TIMEOUT = 400
ITERS = 3
#: forward calls of the adapter's kernels per rank in ITERS iterations of the example GPT (4 layers, 4 micro-batches
#: of 2 a step): attention once per layer per micro-batch; RMSNorm twice per layer (the norms TE's LayerNormLinear
#: fuses before attention and the MLP; the final norm is Megatron's own torch norm, which its block picks when
#: NVIDIA's TE does not import, so not the slot's)
ATTENTION_CALLS = 4 * 4 * ITERS
RMS_NORM_CALLS = 2 * 4 * 4 * ITERS
#: the BackendGaps line the test leaves out of the example (testccl refuses bf16 reduce-scatters)
LEFT_OUT = ('        unsupported_dtypes=[("reduce_scatter", torch.bfloat16), '
            '("reduce_scatter_tensor", torch.bfloat16)],\n')
#: the example's reduce ops line (BXOR, which testccl does right, is added to it)
OPS = "unsupported_ops=[dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM]"


def _conformance(cwd: Path, *args: str) -> tuple[int, str]:
    res = run_python(["-m", "portspeed.cli", "conformance", *args], timeout=TIMEOUT, cwd=cwd)
    return res.returncode, res.stdout + res.stderr


@pytest.mark.testdev
def test_an_undeclared_gap_is_printed_as_the_line_that_fixes_it(tmp_path: Path) -> None:
    """The example without its unsupported_dtypes line, and declaring BXOR, which testccl has: conformance names the
    op, the dtype and what the backend did, prints the field to write, and says the BXOR declaration can go; the
    file with the printed field added and BXOR taken out passes (a relative file, from its directory)."""
    text = EXAMPLE.read_text()
    assert LEFT_OUT in text and OPS in text
    adapter = tmp_path / "acme.py"
    adapter.write_text(text.replace(LEFT_OUT, "").replace(OPS, OPS[:-1] + ", dist.ReduceOp.BXOR]"))
    rc, out = _conformance(tmp_path, "--adapter", "acme.py:AcmeAccelerator", "--suites", "collectives",
                           "--declared-gaps")
    assert rc == 1, out[-4000:]
    failed = [ln for ln in out.splitlines() if "[FAIL]" in ln]
    assert len(failed) == 3, "\n".join(failed)  # BXOR can go, the undeclared gap, the declaration that fits
    assert "raw declared unsupported_ops=[dist.ReduceOp.BXOR]" in failed[0] and "the declaration can go" in failed[0]
    assert "undeclared gap: reduce_scatter bfloat16: every op raised; reduce_scatter_tensor bfloat16: every op " \
           "raised" in failed[1], failed[1]
    written = re.search(r"write in the adapter's BackendGaps\(\.\.\.\): (.*?) \(first seen", failed[1]).group(1)
    assert written == LEFT_OUT.strip().rstrip(","), written
    assert "BackendGaps(unsupported_ops=[dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM], " + written in failed[2]
    lines = text.replace(LEFT_OUT, "").splitlines(keepends=True)  # the printed field added, BXOR taken out
    at = next(i for i, ln in enumerate(lines) if "backend_gaps = BackendGaps(" in ln)
    adapter.write_text("".join(lines[:at + 1] + [f"        {written},\n"] + lines[at + 1:]))
    rc, out = _conformance(tmp_path, "--adapter", "acme.py:AcmeAccelerator", "--suites", "collectives",
                           "--declared-gaps")
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


@pytest.mark.megatron
@pytest.mark.testdev
def test_tp2_on_the_one_file_adapter_equals_cpu_tp1_through_its_kernels(tmp_path: Path) -> None:
    """The example GPT on Megatron's TE spec with RMSNorm (the portable TE, whose kernel slot takes the adapter's
    kernels): TP2 on the one-file adapter equals the CPU TP1 run within 1e-5 at every iteration; on each rank the
    adapter's own attention and rms_norm ran (its counts), and under them the test device's fused attention and
    RMSNorm (the device's counters). No shared checkpoint is needed: the trainer makes the full weights on the host
    from one seed and then splits them (use_cpu_initialization), so TP1 and TP2 start equal."""
    from helpers.launch import torchrun
    from test_example_layouts import TE
    from test_megatron_core_parity import FP32_TOL, _assert_close

    cpu = parse_losses(torchrun("examples/pretrain_gpt.py", 1, [*TE, "--iters", str(ITERS)], timeout=TIMEOUT,
                                env={"PORTSPEED_ACCELERATOR": "cpu"}).check().stdout)
    assert sorted(cpu) == list(range(1, ITERS + 1)) and len({v[0] for v in cpu.values()}) > 1, cpu
    res = torchrun("tests/helpers/vendor_counts.py", 2, [*TE, "--iters", str(ITERS), "--tp", "2"], timeout=TIMEOUT,
                   env={"PORTSPEED_ACCELERATOR": "examples/vendor_adapter.py:AcmeAccelerator",
                        "VENDOR_COUNTS_DIR": str(tmp_path)}).check()
    got = parse_losses(res.stdout)
    assert sorted(got) == list(range(1, ITERS + 1)), res.stdout[-2000:]
    worst = _assert_close(got, cpu, FP32_TOL, "TP2 on the one-file adapter vs CPU TP1")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["adapter"] == "acme" for r in ranks), ranks
    print(f"TP2 on the one-file adapter vs CPU TP1: max |diff| {worst:.3g}; calls per rank "
          f"{[r['calls'] for r in ranks]}; device counters {[r['counters'] for r in ranks]}")
    for r in ranks:
        calls, dev = r["calls"], r["counters"]
        assert calls.get("attention") == ATTENTION_CALLS and calls.get("rms_norm") == RMS_NORM_CALLS, calls
        assert dev["rms_norm_fwd"] == RMS_NORM_CALLS and dev["rms_norm_bwd"] == RMS_NORM_CALLS, dev
        assert dev["sdpa_overrideable_fwd"] == ATTENTION_CALLS and dev["sdpa_overrideable_bwd"] == ATTENTION_CALLS, dev


@pytest.mark.testdev
def test_the_portable_te_runs_the_adapters_other_kernels() -> None:
    """The ops the TP2 run does not reach, on the device: the kernel table chooses the adapter's function for every
    op it declares, the ring attention of context parallelism (one rank) calls its attention_lse and backward, and
    the experts' GroupedLinear (--moe-grouped-gemm) its grouped_mm (its counts)."""
    from helpers.launch import child_json

    got = child_json('''
        import datetime, json, sys
        import torch, torch.distributed as dist
        import portspeed
        from portspeed.portable_te import kernels
        from portspeed.portable_te.grouped import GroupedLinear
        from portspeed.portable_te.ring import ring_attention

        acc = portspeed.get_accelerator()
        adapter = sys.modules[type(acc).__module__]
        chosen = {op: kernels.kernel(op) is getattr(adapter, op) for op in acc.kernels()}
        dev = acc.device(0)
        dist.init_process_group(acc.communication_backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        q, k, v = (torch.randn(1, 2, 8, 16, device=dev, requires_grad=True) for _ in range(3))
        ring_attention(q, k, v, dist.group.WORLD, causal=True, scale=0.25).sum().backward()
        experts = GroupedLinear(4, 8, 6, bias=False, params_dtype=torch.float32, device=dev,
                                init_method=torch.nn.init.normal_)
        experts(torch.randn(10, 8, device=dev, requires_grad=True), [3, 0, 4, 3]).sum().backward()
        print(json.dumps({"chosen": chosen, "calls": dict(adapter.CALLS), "grad": q.grad.device.type}))
    ''', timeout=TIMEOUT, env={"PORTSPEED_ACCELERATOR": "examples/vendor_adapter.py:AcmeAccelerator"})
    assert got["chosen"] == dict.fromkeys(["attention", "attention_lse", "attention_lse_backward", "rms_norm",
                                           "grouped_mm"], True), got
    assert got["calls"] == {"attention_lse": 1, "attention_lse_backward": 1, "grouped_mm": 1}, got
    assert got["grad"] == "testdev"
