"""Megatron-Core text generation (examples/generate_gpt.py): TP2 and PP2 give TP1's tokens, on CPU and the test device.

One CPU TP1 run of examples/pretrain_gpt.py trains 3 iterations and saves; every generation
run loads that checkpoint and decodes the same 4 prompts with Megatron-Core's static
inference engine, greedily and then sampled (top-k 20, the controller's seeded sampling
generator). With PP2 the last stage's logits reach the first through
``broadcast_from_last_pipeline_stage``. The reference is the CPU PP1 run; CPU PP2 and PP2 on
the test device (a C++ PrivateUse1 test device, not hardware), and CPU TP2 and TP2 on the test
device (the vocabulary-parallel logits gathered over the tensor-parallel group before
sampling), must produce the same tokens and the same per-token log-probabilities (fp32,
within 1e-5). Each run is a real torchrun job with a hard time limit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.gpt_example import MODEL, SCRIPT  # noqa: E402
from helpers.launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]

GENERATE = "examples/generate_gpt.py"
TOKENS = 12
SAMPLE_TOP_K = 20
#: fp32 log-probabilities of the same tokens from the same weights in another layout or on the test device.
LOGPROB_TOL = 1e-5
TIMEOUT = 300


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A TP1 checkpoint after 3 training iterations on CPU (long enough to leave the initial weights)."""
    path = str(tmp_path_factory.mktemp("gen") / "ckpt")
    torchrun(SCRIPT, 1, [*MODEL, "--iters", "3", "--save", path], timeout=TIMEOUT).check()
    return path


def _generate(nproc: int, ckpt: str, out: Path, extra: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    torchrun(GENERATE, nproc, [*MODEL, *extra, "--load", ckpt, "--tokens", str(TOKENS),
                               "--sample-top-k", str(SAMPLE_TOP_K), "--out", str(out)],
             timeout=TIMEOUT, env=env).check()
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cpu_pp1(trained_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: CPU, one rank; its tokens must vary or equality would prove little."""
    ref = _generate(1, trained_ckpt, tmp_path_factory.mktemp("pp1") / "gen.json", [])
    greedy = ref["greedy"]
    assert all(len(r["generated_tokens"]) == TOKENS for r in greedy), [r["generated_tokens"] for r in greedy]
    distinct = {t for r in greedy for t in r["generated_tokens"]}
    assert len(distinct) > 3, (
        f"greedy reference is degenerate (tokens {sorted(distinct)}): train longer or change prompts")
    margins = [m for r in greedy for m in r["top1_top2_margin"]]
    print(f"reference greedy tokens: {[r['generated_tokens'] for r in greedy]}; "
          f"smallest top-1/top-2 log-prob margin {min(margins):.3g}")
    return ref


def _assert_same(got: dict[str, Any], ref: dict[str, Any], what: str) -> float:
    """Same tokens in both passes, log-probabilities within LOGPROB_TOL; returns the largest difference."""
    worst = 0.0
    for name in ("greedy", "sampled"):
        assert len(got[name]) == len(ref[name]), f"{what} {name}: {len(got[name])} results, reference {len(ref[name])}"
        for g, r in zip(got[name], ref[name]):
            assert g["prompt"] == r["prompt"]
            assert g["generated_tokens"] == r["generated_tokens"], (
                f"{what} {name} {r['prompt']!r}: tokens {g['generated_tokens']} vs reference {r['generated_tokens']}")
            diff = max(abs(a - b) for a, b in zip(g["generated_log_probs"], r["generated_log_probs"]))
            worst = max(worst, diff)
            assert diff <= LOGPROB_TOL, f"{what} {name} {r['prompt']!r}: log-prob |diff| {diff:.3g} > {LOGPROB_TOL}"
    return worst


def test_cpu_pp2_generates_pp1_tokens(trained_ckpt: str, cpu_pp1: dict, tmp_path: Path) -> None:
    """CPU PP2 (logits broadcast from the last stage over Gloo) equals CPU PP1."""
    got = _generate(2, trained_ckpt, tmp_path / "gen.json", ["--pp", "2"])
    assert (got["meta"]["pp"], got["meta"]["backend"]) == (2, "gloo"), got["meta"]
    worst = _assert_same(got, cpu_pp1, "cpu pp2")
    print(f"cpu pp2 vs cpu pp1: max log-prob |diff| {worst:.3g}")


@pytest.mark.testdev
def test_testdev_pp2_generates_cpu_tokens(trained_ckpt: str, cpu_pp1: dict, tmp_path: Path) -> None:
    """PP2 on the test device (testccl, device-side sampling generator) equals the CPU PP1 run."""
    got = _generate(2, trained_ckpt, tmp_path / "gen.json", ["--pp", "2"], env={"PORTSPEED_ACCELERATOR": "testdev"})
    meta = got["meta"]
    assert meta["device"].startswith("testdev") and meta["backend"] == "testccl", meta
    assert meta["patches"].get("megatron.core.inference_comm.device_check") == "applied", meta["patches"]
    worst = _assert_same(got, cpu_pp1, "testdev pp2")
    print(f"testdev pp2 vs cpu pp1: max log-prob |diff| {worst:.3g}")


def test_cpu_tp2_generates_tp1_tokens(trained_ckpt: str, cpu_pp1: dict, tmp_path: Path) -> None:
    """CPU TP2 (vocabulary-parallel logits gathered over Gloo, sampling generator on each rank) equals CPU TP1."""
    got = _generate(2, trained_ckpt, tmp_path / "gen.json", ["--tp", "2"])
    assert (got["meta"]["tp"], got["meta"]["pp"], got["meta"]["backend"]) == (2, 1, "gloo"), got["meta"]
    worst = _assert_same(got, cpu_pp1, "cpu tp2")
    print(f"cpu tp2 vs cpu tp1: max log-prob |diff| {worst:.3g}")


@pytest.mark.testdev
def test_testdev_tp2_generates_cpu_tokens(trained_ckpt: str, cpu_pp1: dict, tmp_path: Path) -> None:
    """TP2 on the test device (testccl) equals the CPU TP1 run."""
    got = _generate(2, trained_ckpt, tmp_path / "gen.json", ["--tp", "2"], env={"PORTSPEED_ACCELERATOR": "testdev"})
    meta = got["meta"]
    assert meta["device"].startswith("testdev") and meta["backend"] == "testccl" and meta["tp"] == 2, meta
    worst = _assert_same(got, cpu_pp1, "testdev tp2")
    print(f"testdev tp2 vs cpu tp1: max log-prob |diff| {worst:.3g}")
