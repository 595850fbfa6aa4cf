"""Training-level proofs of loss parity: the router inside real training, and a planted bug caught and localised.

1. ``examples/pretrain_gpt.py`` asks for ``nccl`` with ``PORTSPEED_ACCELERATOR=standin``: the
   router maps it to the stand-in vendor backend (portspeed.testing.standin_ccl), which lacks
   ReduceOp.AVG and bf16 reduce_scatter. DP2 with the distributed optimizer makes Megatron
   reduce-scatter its gradients with exactly those (``--average-in-collective`` -> AVG;
   ``--bf16 --grad-reduce-in-bf16`` -> bf16), so the router's rewrites run inside training.
   The losses must equal the same run on Gloo (judged by portspeed.parity), and the loss
   record's ``meta.router_rewrites`` must show the rewrites really happened.
2. A TEST-ONLY declared patch (portspeed.testing.plant) scales the gradient into decoder
   layer 1 from iteration PLANT on. ``portspeed compare`` (the CLI) must exit 1 naming
   iteration PLANT+1 for the loss (the loss of N is computed before N's update) and PLANT
   for the grad norm. (Where it is, module by module, is the probe's part: ``portspeed run --probe``.)

All runs start from one checkpoint written before training (module fixture); each is a real
torchrun job on 127.0.0.1 with a hard time limit.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.gpt_example import MODEL, SCRIPT  # noqa: E402
from helpers.launch import parse_losses, run_python, torchrun  # noqa: E402

from portspeed.parity.losslog import read_record  # noqa: E402
from portspeed.parity.tolerance import Tolerance, compare  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]

ITERS = 6
PLANT = 3  # first iteration whose backward is scaled
DP2_DISTOPT = ["--use-distributed-optimizer"]
FP32_TOL = Tolerance(1e-5, 0.0, "fp32: Gloo vs stand-in differ only in reduction order")
#: bf16 Gloo vs stand-in, DP2: measured max |diff| 0.0 over 6 iterations (torch 2.13 CPU, mcore 0.16.1).
#: With two ranks a sum has one order, and the router's upcast rounds the fp32 sum to bf16 once, as a bf16
#: sum does; 1e-4 leaves room for a rare double rounding of one element (one bf16 ulp of one gradient).
BF16_TOL = Tolerance(1e-4, 0.0, "bf16 DP2: measured 0.0; room for one double-rounded gradient element")
TIMEOUT = 300


def _train(nproc: int, extra: list[str], *, init: str | None, iters: int = ITERS,
           env: dict | None = None) -> tuple[dict, str]:
    args = [*MODEL, "--iters", str(iters), *extra]
    if init is not None:
        args += ["--load", init, "--finetune"]
    res = torchrun(SCRIPT, nproc, args, timeout=TIMEOUT, env=env).check()
    losses = parse_losses(res.stdout)
    assert sorted(losses) == list(range(1, iters + 1)), (
        f"expected one loss line per iteration 1..{iters}, got {sorted(losses)}\n{res.stdout[-2000:]}")
    return losses, res.stderr


def _record_run(tmp: Path, name: str, extra: list[str], init: str, env: dict | None = None) -> Path:
    path = tmp / f"{name}.json"
    _train(2, [*extra, "--loss-log", str(path)], init=init, env=env)
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vendor_parity")


@pytest.fixture(scope="module")
def init_ckpt(workdir: Path) -> str:
    """Weights before training (torch_dist): every run here starts from them."""
    path = str(workdir / "init")
    torchrun(SCRIPT, 1, [*MODEL, "--iters", "0", "--save", path], timeout=TIMEOUT).check()
    return path


@pytest.fixture(scope="module")
def gloo_fp32(workdir: Path, init_ckpt: str) -> Path:
    """The reference: DP2, distributed optimizer, AVG in the collective, on Gloo."""
    return _record_run(workdir, "gloo_fp32", [*DP2_DISTOPT, "--average-in-collective", "--backend", "gloo"],
                       init_ckpt)


def _check_parity(ref_path: Path, run_path: Path, tol: Tolerance) -> float:
    """lm loss and grad norm of ``run`` within ``tol`` of ``ref`` at every iteration (portspeed.parity)."""
    ref, run = read_record(ref_path), read_record(run_path)
    values = [it.lm_loss for it in ref.iterations]
    assert len(set(values)) > 1, "the reference loss must change between iterations, or parity proves nothing"
    worst = 0.0
    for metric in ("lm_loss", "grad_norm"):
        c = compare(ref, run, tol, metric=metric)
        fd = c.first_divergence
        assert c.ok, f"{metric}: first divergence at iteration {fd.iteration}: ref {fd.ref!r} vs {fd.value!r}"
        assert len(c.rows) == ITERS
        if metric == "lm_loss" and c.largest is not None:
            worst = c.largest.abs_diff or 0.0
    return worst


def _standin_meta(path: Path) -> dict:
    meta = json.loads(path.read_text())["meta"]
    assert meta["accelerator"] == "standin", meta
    assert meta["backend"] == "nccl", f"the run must have asked for nccl (router maps it), meta: {meta}"
    assert meta["real_backend"] == "standin", f"nccl must have been routed to the stand-in backend, meta: {meta}"
    return meta


def test_avg_reduce_scatter_rewritten_in_training_matches_gloo(workdir: Path, init_ckpt: str,
                                                               gloo_fp32: Path) -> None:
    """fp32: Megatron's ReduceOp.AVG reduce_scatter is rewritten (SUM, then divide) on the stand-in; losses = Gloo's."""
    run = _record_run(workdir, "standin_fp32", [*DP2_DISTOPT, "--average-in-collective", "--backend", "nccl"],
                      init_ckpt, env={"PORTSPEED_ACCELERATOR": "standin"})
    rewrites = _standin_meta(run)["router_rewrites"]
    rs = rewrites.get("reduce_scatter_tensor", {})
    assert rs.get("by", {}).get("avg_as_sum", 0) >= ITERS, (
        f"expected >= {ITERS} AVG reduce_scatter rewrites (one per iteration at least), got {rewrites}")
    worst = _check_parity(gloo_fp32, run, FP32_TOL)
    print(f"fp32 AVG: max |diff| Gloo vs stand-in {worst:.3g}; rewrites {rewrites}")


def test_without_the_router_the_standin_run_fails_on_the_gap(init_ckpt: str) -> None:
    """Control: the same run with the router's reduce_scatter wrappers disabled dies on the stand-in's AVG gap."""
    res = torchrun(SCRIPT, 2, [*MODEL, "--iters", "1", *DP2_DISTOPT, "--average-in-collective", "--backend", "nccl",
                               "--load", init_ckpt, "--finetune"], timeout=TIMEOUT,
                   env={"PORTSPEED_ACCELERATOR": "standin",
                        "PORTSPEED_DISABLE": "torch.distributed.reduce_scatter_single.route,"
                                             "torch.distributed.reduce_scatter_tensor.route"})
    assert res.returncode != 0, "the stand-in lacks AVG: without the router this run must fail"
    assert "standin CCL: ReduceOp.AVG in reduce_scatter_tensor is not supported" in res.stderr, res.stderr[-3000:]


def test_bf16_reduce_scatter_rewritten_in_training_matches_gloo(workdir: Path, init_ckpt: str) -> None:
    """bf16 gradients reduced in bf16: the stand-in's missing bf16 reduce_scatter is upcast; losses = Gloo's."""
    flags = [*DP2_DISTOPT, "--bf16", "--grad-reduce-in-bf16", "--backend", "nccl"]
    ref = _record_run(workdir, "gloo_bf16", flags, init_ckpt, env={"PORTSPEED_ACCELERATOR": "cpu"})
    run = _record_run(workdir, "standin_bf16", flags, init_ckpt, env={"PORTSPEED_ACCELERATOR": "standin"})
    assert json.loads(ref.read_text())["meta"]["real_backend"] == "gloo"
    rewrites = _standin_meta(run)["router_rewrites"]
    rs = rewrites.get("reduce_scatter_tensor", {})
    assert rs.get("by", {}).get("upcast", 0) >= ITERS, (
        f"expected >= {ITERS} bf16 reduce_scatter upcasts (one per iteration at least), got {rewrites}")
    worst = _check_parity(ref, run, BF16_TOL)
    print(f"bf16: max |diff| Gloo vs stand-in {worst:.3g}; rewrites {rewrites}")


def _cli(*args: str) -> subprocess.CompletedProcess:
    res = run_python(["-m", "portspeed.cli", "compare", *args], timeout=120)
    return subprocess.CompletedProcess(res.cmd, res.returncode, res.stdout, res.stderr)


def test_planted_divergence_is_caught(workdir: Path, init_ckpt: str, gloo_fp32: Path) -> None:
    """Planted gradient scaling from PLANT: compare exits 1 at PLANT+1 (loss) / PLANT (grad norm)."""
    planted = workdir / "planted.json"
    _, stderr = _train(2, [*DP2_DISTOPT, "--average-in-collective", "--backend", "gloo", "--loss-log", str(planted),
                           "--plant-divergence", str(PLANT)], init=init_ckpt)
    assert "TEST-ONLY planted divergence active" in stderr

    report = workdir / "planted_report.json"
    res = _cli(str(gloo_fp32), str(planted), "--metric", "lm_loss", "--metric", "grad_norm", "--json", str(report))
    assert res.returncode == 1, f"compare must report the divergence (exit 1), got {res.returncode}\n{res.stdout}"
    assert f"DIVERGED at iteration {PLANT + 1}" in res.stdout, res.stdout
    firsts = {c["metric"]: c["first_divergence"]["iteration"] for c in json.loads(report.read_text())["comparisons"]}
    # the loss of iteration N is computed before N's update: the scaled backward of PLANT shows in
    # PLANT's grad norm at once and in the loss from PLANT + 1 on
    assert firsts == {"lm_loss": PLANT + 1, "grad_norm": PLANT}, firsts



@pytest.mark.parametrize("kwargs,needle", [({"from_iteration": 0}, "iterations start at 1"),
                                           ({"from_iteration": 2, "layer": -1}, "0-based decoder layer"),
                                           ({"from_iteration": 2, "factor": 1.0}, "would change nothing")])
def test_plant_refuses_arguments_that_plant_nothing(kwargs: dict, needle: str) -> None:
    """The test-only plant names what was wrong instead of silently planting nothing (and registers nothing)."""
    import portspeed
    from portspeed.testing import plant

    with pytest.raises(plant.PlantError, match=needle):
        plant.plant(**kwargs)
    assert plant.PATCH_NAME not in {r.patch.name for r in portspeed.manager().records()}
