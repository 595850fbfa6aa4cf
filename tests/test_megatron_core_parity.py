"""Loss parity of examples/pretrain_gpt.py (megatron-core on CPU + Gloo) across parallel layouts.

Every layout starts from one checkpoint written by a TP1 run before any training (pipeline
stages would otherwise initialise differently) and sees the same global batch per
iteration, so its per-iteration lm loss must equal the TP1 run's (fp32: within 1e-5).
Each test is a real torchrun job on 127.0.0.1 with a hard time limit.
"""

from __future__ import annotations

import json
import re

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.gpt_example import MODEL, SCRIPT  # noqa: E402
from helpers.launch import parse_losses, torchrun  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]

ITERS = 10
FP32_TOL = 1e-5
#: bf16 TP2 vs bf16 TP1: measured max |diff| 4.2e-4 over 10 iterations (torch 2.13 CPU, mcore 0.16.1); ~5x margin.
BF16_TOL = 2e-3
#: bf16 TP1 vs fp32 TP1: measured max |diff| 3.8e-4; ~10x margin.
BF16_VS_FP32_TOL = 4e-3
TIMEOUT = 300


def _run(nproc: int, extra: list[str], *, init: str | None, iters: int = ITERS, env: dict | None = None,
         model: list[str] = MODEL) -> dict[int, tuple[float, float | None]]:
    args = [*model, "--iters", str(iters), *extra]
    if init is not None:
        args += ["--load", init, "--finetune"]
    res = torchrun(SCRIPT, nproc, args, timeout=TIMEOUT, env=env).check()
    losses = parse_losses(res.stdout)
    assert sorted(losses) == list(range(1, iters + 1)) or iters == 0, (
        f"expected one loss line per iteration 1..{iters}, got {sorted(losses)}\n{res.stdout[-2000:]}")
    return losses


@pytest.fixture(scope="module")
def init_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Weights of a TP1 model before training, in torch_dist format: every layout loads these."""
    path = str(tmp_path_factory.mktemp("init") / "ckpt")
    _run(1, ["--save", path], init=None, iters=0)
    return path


@pytest.fixture(scope="module")
def tp1(init_ckpt: str) -> dict[int, tuple[float, float | None]]:
    losses = _run(1, [], init=init_ckpt)
    values = [v[0] for v in losses.values()]
    assert len(set(values)) > 1, "the baseline loss must change between iterations, or parity proves nothing"
    return losses


def _assert_close(got: dict, want: dict, tol: float, what: str) -> float:
    worst = 0.0
    for it in sorted(want):
        d = abs(got[it][0] - want[it][0])
        worst = max(worst, d)
        assert d <= tol, (f"{what}: iteration {it} lm loss {got[it][0]!r} vs TP1 {want[it][0]!r} "
                          f"(|diff| {d:.3g} > {tol})")
    return worst


LAYOUTS = [
    pytest.param(2, ["--tp", "2"], id="tp2"),
    pytest.param(2, ["--pp", "2"], id="pp2"),
    pytest.param(2, [], id="dp2"),
    pytest.param(4, ["--tp", "2", "--pp", "2"], id="tp2xpp2"),
    pytest.param(2, ["--use-distributed-optimizer"], id="dp2-distopt"),
    pytest.param(2, ["--tp", "2", "--sequence-parallel"], id="tp2-sp"),
    pytest.param(2, ["--pp", "2", "--vpp", "2"], id="pp2-vpp2"),
    # Megatron-LM frees each stage output after posting its send: a host backend must send a copy
    pytest.param(2, ["--pp", "2", "--vpp", "2", "--deallocate-pipeline-outputs"], id="pp2-vpp2-dealloc"),
    pytest.param(1, ["--recompute"], id="recompute"),
    pytest.param(2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
                 id="dp2-distopt-overlap"),
]


@pytest.mark.parametrize("nproc,extra", LAYOUTS)
def test_layout_matches_tp1(nproc: int, extra: list[str], init_ckpt: str, tp1: dict) -> None:
    """Each layout's fp32 lm loss equals TP1's at every iteration within 1e-5; grad norms agree too."""
    got = _run(nproc, extra, init=init_ckpt)
    _assert_close(got, tp1, FP32_TOL, " ".join(extra) or "dp2")
    for it in tp1:
        assert got[it][1] == pytest.approx(tp1[it][1], rel=1e-4), f"iteration {it}: grad norm differs"


def test_adaptor_imported_after_megatron(init_ckpt: str, tp1: dict) -> None:
    """Import order: Megatron-Core loaded first, then the adaptor; TP2 + sequence parallel still matches TP1."""
    res = torchrun("tests/helpers/late_import_pretrain.py", 2,
                   [*MODEL, "--iters", "3", "--tp", "2", "--sequence-parallel", "--load", init_ckpt, "--finetune"],
                   timeout=TIMEOUT).check()
    got = parse_losses(res.stdout)
    _assert_close(got, {i: tp1[i] for i in (1, 2, 3)}, FP32_TOL, "late import tp2-sp")


def test_grad_accumulation_matches_single_microbatch(init_ckpt: str, tp1: dict) -> None:
    """8 sequences as 1 micro-batch of 8 equals 4 accumulated micro-batches of 2 (the TP1 run)."""
    got = _run(1, ["--micro-batch-size", "8"], init=init_ckpt)
    _assert_close(got, tp1, FP32_TOL, "micro-batch 8")


def test_bf16_tp2_matches_bf16_tp1(init_ckpt: str, tp1: dict) -> None:
    """bf16: TP2 within BF16_TOL of TP1 (both bf16), and bf16 within BF16_VS_FP32_TOL of fp32."""
    b1 = _run(1, ["--bf16"], init=init_ckpt)
    b2 = _run(2, ["--bf16", "--tp", "2"], init=init_ckpt)
    worst = _assert_close(b2, b1, BF16_TOL, "bf16 tp2 vs bf16 tp1")
    vs_fp32 = _assert_close(b1, tp1, BF16_VS_FP32_TOL, "bf16 tp1 vs fp32 tp1")
    print(f"bf16 max |diff|: tp2 vs tp1 {worst:.3g}, bf16 vs fp32 {vs_fp32:.3g}")


def test_checkpoint_resume_equals_uninterrupted(init_ckpt: str, tp1: dict, tmp_path) -> None:
    """5 iterations, save (model + optimizer), load, 5 more: iterations 6..10 equal the uninterrupted run."""
    mid = str(tmp_path / "mid")
    first = _run(1, ["--save", mid], init=init_ckpt, iters=5)
    _assert_close(first, {i: tp1[i] for i in range(1, 6)}, 0.0, "first half")
    res = torchrun(SCRIPT, 1, [*MODEL, "--iters", "5", "--load", mid], timeout=TIMEOUT).check()
    second = parse_losses(res.stdout)
    assert sorted(second) == list(range(6, 11)), f"resumed run printed iterations {sorted(second)}"
    _assert_close(second, {i: tp1[i] for i in range(6, 11)}, 1e-6, "resumed")


def test_loss_log_record(init_ckpt: str, tmp_path) -> None:
    """--loss-log writes the JSON record the compare tool reads, with layout and one entry per iteration."""
    path = tmp_path / "tp2.json"
    got = _run(2, ["--tp", "2", "--loss-log", str(path)], init=init_ckpt, iters=3)
    rec = json.loads(path.read_text())
    assert rec["meta"]["layout"] == {"tp": 2, "pp": 1, "dp": 1, "vpp": None}
    assert rec["meta"]["accelerator"] == "cpu" and rec["meta"]["backend"]
    assert [e["iteration"] for e in rec["iterations"]] == [1, 2, 3]
    assert [e["lm_loss"] for e in rec["iterations"]] == [got[i][0] for i in (1, 2, 3)]
    assert all(e["skipped"] is False for e in rec["iterations"])


def test_interleaved_pp2_batched_p2p_is_refused(init_ckpt: str) -> None:
    """PP2 + VPP with batched p2p swaps messages on Gloo; the guard patch fails it with the fix named."""
    res = torchrun(SCRIPT, 2, [*MODEL, "--iters", "2", "--pp", "2", "--vpp", "2", "--batch-p2p-comm",
                               "--load", init_ckpt, "--finetune"], timeout=TIMEOUT)
    assert res.returncode != 0
    assert "InterleavedP2PLayoutError" in res.stderr and "overlap_p2p_comm=True" in res.stderr


def test_interleaved_pp2_batched_p2p_diverges_without_guard(init_ckpt: str, tp1: dict) -> None:
    """The guard's premise, measured: with the guard disabled the same layout runs and its losses are wrong."""
    got = _run(2, ["--pp", "2", "--vpp", "2", "--batch-p2p-comm"], init=init_ckpt, iters=2,
               env={"PORTSPEED_DISABLE": "megatron.core.p2p.interleaved_pp2_guard"})
    assert abs(got[1][0] - tp1[1][0]) > 1e-3, "expected the mismatched p2p messages to change the loss"


def test_interleaved_pp2_guard_lets_a_forward_only_pass_through() -> None:
    """Forward-only (evaluation) sends no gradients, so nothing can cross: the guard calls through; training raises."""
    from types import SimpleNamespace

    from portspeed.patches.megatron.core_p2p import InterleavedP2PLayoutError, interleaved_guard

    model = [SimpleNamespace(config=SimpleNamespace(batch_p2p_comm=True, overlap_p2p_comm=False))]
    pg = SimpleNamespace(pp=SimpleNamespace(size=lambda: 2))
    calls = []

    def schedule(**kwargs):
        calls.append(kwargs["forward_only"])
        return "ran"

    assert interleaved_guard(schedule, None, (), {"model": model, "pg_collection": pg, "forward_only": True}) == "ran"
    with pytest.raises(InterleavedP2PLayoutError, match="overlap_p2p_comm=True"):
        interleaved_guard(schedule, None, (), {"model": model, "pg_collection": pg, "forward_only": False})
    assert calls == [True]


def test_dead_rank_fails_the_job_naming_it() -> None:
    """Rank 1 exits at iteration 2: the job exits non-zero within the time limit and names rank 1 as root cause."""
    res = torchrun(SCRIPT, 2, [*MODEL, "--iters", "4", "--fail-at", "1:2"], timeout=120,
                   env={"PORTSPEED_TIMEOUT": "60"})
    assert res.returncode != 0
    root = res.stderr.split("Root Cause", 1)
    assert len(root) == 2, f"torchrun printed no root cause:\n{res.stderr[-2000:]}"
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root[1]), root[1][:800]
    assert re.search(r"exitcode\s*:\s*17", root[1]), root[1][:800]


# ---------------------------------------------------------------------- on the test device
# The same trainer on portspeed's test device (a C++ PrivateUse1 device with its own memory,
# generator and CCL; a test device, not hardware), compared with the CPU TP1 run above:
# a cross-device comparison, so a tensor left on the host, a wrong generator or a missing
# wait on a collective shows as an error or a different loss.
TESTDEV = {"PORTSPEED_ACCELERATOR": "testdev"}

TESTDEV_LAYOUTS = [
    pytest.param(2, ["--tp", "2"], id="tp2"),
    pytest.param(2, ["--pp", "2", "--vpp", "2", "--deallocate-pipeline-outputs"], id="pp2-vpp2-dealloc"),
    pytest.param(2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
                 id="dp2-distopt-overlap"),
    pytest.param(2, ["--tp", "2", "--sequence-parallel"], id="tp2-sp"),
    pytest.param(4, ["--tp", "2", "--pp", "2"], id="tp2xpp2"),
]


@pytest.mark.testdev
@pytest.mark.parametrize("nproc,extra", TESTDEV_LAYOUTS)
def test_testdev_layout_matches_cpu_tp1(nproc: int, extra: list[str], init_ckpt: str, tp1: dict, tmp_path) -> None:
    """On the test device each layout's fp32 lm loss equals the CPU TP1 run's within 1e-5."""
    record = tmp_path / "losses.json"
    got = _run(nproc, [*extra, "--loss-log", str(record)], init=init_ckpt, env=TESTDEV)
    meta = json.loads(record.read_text())["meta"]
    assert (meta["accelerator"], meta["backend"]) == ("testdev", "testccl"), meta
    _assert_close(got, tp1, FP32_TOL, "testdev " + " ".join(extra))


@pytest.mark.testdev
def test_testdev_bf16_tp2_matches_cpu_bf16_tp1(init_ckpt: str) -> None:
    """bf16 on the test device (TP2) against bf16 on CPU (TP1), within the CPU bf16 band."""
    cpu = _run(1, ["--bf16"], init=init_ckpt, iters=5)
    dev = _run(2, ["--bf16", "--tp", "2"], init=init_ckpt, iters=5, env=TESTDEV)
    worst = _assert_close(dev, cpu, BF16_TOL, "testdev bf16 tp2 vs cpu bf16 tp1")
    print(f"testdev bf16 tp2 vs cpu bf16 tp1 max |diff| {worst:.3g}")


@pytest.mark.testdev
@pytest.mark.parametrize("first,second", [("testdev", "cpu"), ("cpu", "testdev")])
def test_checkpoint_moves_between_cpu_and_testdev(first: str, second: str, init_ckpt: str, tp1: dict,
                                                  tmp_path) -> None:
    """Saved on one device, resumed on the other (model + optimizer): iterations 6..10 = the whole CPU run (1e-6)."""
    env = {"cpu": None, "testdev": TESTDEV}
    mid = str(tmp_path / "mid")
    head = _run(1, ["--save", mid], init=init_ckpt, iters=5, env=env[first])
    _assert_close(head, {i: tp1[i] for i in range(1, 6)}, FP32_TOL, f"{first} first half")
    res = torchrun(SCRIPT, 1, [*MODEL, "--iters", "5", "--load", mid], timeout=TIMEOUT, env=env[second]).check()
    tail = parse_losses(res.stdout)
    assert sorted(tail) == list(range(6, 11)), f"resumed run printed iterations {sorted(tail)}"
    _assert_close(tail, {i: tp1[i] for i in range(6, 11)}, 1e-6, f"saved on {first}, resumed on {second}")
