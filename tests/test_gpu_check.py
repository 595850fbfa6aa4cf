"""benchmarks/gpu_check.sh, prepared for a lent GPU, checked on CPU: syntax, the parts' code paths, the table.

The GPU run happens once, by hand; what can go wrong there without a GPU is tested here:
the scripts parse; asked for CUDA where there is none, each Python part stops with a message
that says so (``CUDA_VISIBLE_DEVICES=""`` hides a GPU where there is one); the attention
benchmark's two implementations compute the same attention (MHA and GQA) and report time,
memory and the SDPA backend; portspeed imports from the source tree alone (no install: the
folder gpu_check.sh puts first on PYTHONPATH maps ``portspeed.adapters`` / ``.patches``);
the TE-step part serves the portable TE through its own import hook (the route it takes on
CUDA) and builds TE layers from it; the table names every part that failed or timed out.
Nothing here times anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launch import python_for_children, run_python

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_te_kernels  # noqa: E402
import gpu_check  # noqa: E402

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_scripts_parse(script: str) -> None:
    res = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_wheel_folder_is_git_ignored() -> None:
    """gpu_wheels.sh writes .whl/ at the root; the wheels must never be committed."""
    assert "/.whl/" in (REPO / ".gitignore").read_text().splitlines()


def test_cuda_asked_without_gpu_says_so() -> None:
    """Each Python part, told --device cuda on a machine without one, exits 2 naming the problem."""
    pre = run_python([str(BENCH / "gpu_check.py"), "preflight", "--device", "cuda", "--out", "/tmp/gpu_check_nogpu"],
                     timeout=180, env=NO_GPU)
    assert pre.returncode == 2, pre.stderr
    assert "CUDA is not available" in pre.stderr
    for args in (["example", "--device", "cuda"], ["te", "--device", "cuda"]):
        res = run_python([str(BENCH / "gpu_check.py"), *args, "--out", "/tmp/gpu_check_nogpu"], timeout=120, env=NO_GPU)
        assert res.returncode == 2 and "torch.cuda.is_available() is False" in res.stderr, res.stderr
    att = run_python([str(BENCH / "bench_te_kernels.py"), "--parts", "attention", "--device", "cuda"], timeout=120,
                     env=NO_GPU)
    assert att.returncode == 2 and "torch.cuda.is_available() is False" in att.stderr, att.stderr


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_attention_implementations_agree(kind: str) -> None:
    """The benchmark's fused and reference attention are the same function (values and gradients)."""
    import torch

    impls = bench_te_kernels.attention_impls()
    torch.manual_seed(0)
    hkv = 4 if kind == "gqa" else 8
    q = torch.randn(1, 8, 48, 16, dtype=torch.float32, requires_grad=True)
    k = torch.randn(1, hkv, 48, 16, dtype=torch.float32, requires_grad=True)
    v = torch.randn(1, hkv, 48, 16, dtype=torch.float32, requires_grad=True)
    outs, grads = {}, {}
    for name, fn in impls.items():
        out = fn(q, k, v, 0.25)
        grads[name] = torch.autograd.grad(out.sum(), (q, k, v))
        outs[name] = out.detach()
    torch.testing.assert_close(outs["fused"], outs["reference"], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads["fused"], grads["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_case_row_and_table() -> None:
    """One case per implementation, in this process: a complete row; the table pairs them with their ratios."""
    rows = []
    for impl in ("fused", "reference"):
        rows.append(bench_te_kernels.run_case({"device": "cpu", "seq": 64, "dtype": "bf16", "kind": "gqa",
                                               "impl": impl, "repeats": 2, "long_s": 10.0}))
    for row in rows:
        assert row["n"] == 2 and row["time_s"] > 0 and row["wall_s"] > 0 and row["peak_mb"] >= 0
    assert rows[0]["backend"] in ("flash (cpu)", "math")
    text = bench_te_kernels.table(rows)
    line = next(ln for ln in text.splitlines() if ln.startswith("s=64 bf16 gqa"))
    assert f"{rows[0]['time_s'] / rows[1]['time_s']:.3f}" in line and rows[0]["backend"] in line


def test_portspeed_imports_from_the_tree_alone() -> None:
    """Without the install's finder, the gpu_site folder makes portspeed.adapters / .patches import from the tree."""
    code = ("import sys\n"
            "keep = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable')]\n"
            "sys.meta_path[:] = keep\n"
            "for m in [m for m in sys.modules if m == 'portspeed' or m.startswith('portspeed.')]:\n"
            "    del sys.modules[m]\n"
            "import portspeed.adapters.cuda, portspeed.patches\n"
            "print(portspeed.adapters.cuda.__file__, portspeed.patches.__file__)\n")
    res = run_python(["-c", code], timeout=120, env={"PYTHONPATH": f"{BENCH / 'gpu_site'}:{REPO}"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(REPO / "adapters" / "cuda.py"), str(REPO / "patches" / "__init__.py")]


@pytest.mark.megatron
@pytest.mark.multiproc
def test_dry_run_runs_every_part(tmp_path: Path) -> None:
    """``gpu_check.sh --dry-run``: every part runs tiny on the CPU and passes; the TE step reaches the portable TE.

    The TE part blocks portspeed's portable-TE patch and serves the TE through gpu_check.py's own import
    hook, the route it takes on CUDA (where portspeed serves no TE), so that route is proven here.
    """
    python, extra = python_for_children()  # the session's warm Python where it runs: its parts fork from it
    res = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run"], cwd=REPO, capture_output=True,
                         text=True, timeout=4200, env={**os.environ, **extra, "PYTHON": python, "OMP_NUM_THREADS": "1",
                                                      "GPU_CHECK_LOGS": str(tmp_path), "OUT": ""})
    table = (tmp_path / "table.txt").read_text() if (tmp_path / "table.txt").is_file() else res.stdout[-4000:]
    assert res.returncode == 0, f"{table}\n{res.stderr[-2000:]}"
    rows = {ln.split()[0]: ln.split()[1] for ln in table.splitlines()[1:6]}
    assert rows == dict.fromkeys(gpu_check.PARTS, "ok"), table
    te = json.loads((tmp_path / "te.json").read_text())["rows"]
    assert [r["portable_te"] for r in te] == [True, True, False], te
    assert any("scaled_dot_product" in op for op in te[0]["sdpa_ops"]), te  # the default TE path runs SDPA
    assert te[1]["kernels"] == "reference" and te[1]["sdpa_ops"] == [], te  # the reference runs none


def test_table_names_every_failure(tmp_path: Path) -> None:
    """A timed-out part, a failed one, a missing one and a failed variant are each named; the good figures stay."""
    (tmp_path / "preflight.json").write_text(json.dumps({"torch": "2.11.0", "gpu": "H100", "megatron_core": "0.19.2",
                                                          "device": "cuda"}))
    (tmp_path / "preflight.status").write_text("exit 0\n")
    (tmp_path / "conformance.status").write_text("timed out after 45 s\n")
    (tmp_path / "example.json").write_text(json.dumps({"error": "RuntimeError: the example exited 1"}))
    (tmp_path / "example.status").write_text("exit 1\n")
    (tmp_path / "te.json").write_text(json.dumps({"rows": [
        {"name": "local spec", "spec": "local", "step_ms": 12.5, "peak_mb": 100.0, "sdpa_ops": []},
        {"name": "TE spec, torch kernels", "error": "exit 1: boom"}]}))
    (tmp_path / "te.status").write_text("exit 1\n")
    text = gpu_check.render(tmp_path)
    lines = {ln.split()[0]: ln for ln in text.splitlines()[1:6]}
    assert lines["preflight"].split()[1] == "ok" and "H100" in lines["preflight"]
    assert "FAILED" in lines["conformance"] and "timed out after 45 s" in lines["conformance"]
    assert "FAILED" in lines["example"] and "the example exited 1" in lines["example"]
    assert "FAILED" in lines["te"] and "failed: TE spec, torch kernels" in lines["te"]
    assert "FAILED" in lines["attention"] and "not run" in lines["attention"]
    assert any(ln.startswith("local spec") and "12.50" in ln for ln in text.splitlines())
