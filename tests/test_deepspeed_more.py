"""The longer DeepSpeed checks, run by `make test-deepspeed-more` (marker ``ds_more``; not in CI).

ZeRO-3 on 4 ranks, the pipeline engine (2 stages; 2 stages x 2 replicas on 4 ranks; resume;
activation checkpointing with partitioned activations), ZeRO-Infinity (NVMe through the
async I/O op), the ``deepspeed`` launcher, and stock DeepSpeed's own refusal of fp16 on CPU.
Each is compared with stock DeepSpeed (``DS_ACCELERATOR=cpu``) and/or a single process;
tolerances as in ``tests/test_deepspeed.py`` (fp32: 1e-5 relative per step; stock: 0).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import free_port, run_python
from helpers.requires import require

require("deepspeed", "pip install 'portspeed[deepspeed]'")

from test_deepspeed import (CLEAN, DS_OPS_DIR, EXAMPLE, STEPS, TIMEOUT, _assert_within, _clean_env,  # noqa: E402
                            _tail, _train)

pytestmark = [pytest.mark.deepspeed, pytest.mark.ds_more, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = str(ROOT / "examples" / "deepspeed_pipeline.py")
PIPE_STEPS, PIPE_SAVE_AT = 5, 2


# ---------------------------------------------------------------------- ZeRO-3, 4 ranks
def test_zero3_on_four_ranks_equals_stock_and_single_process(tmp_path: Path) -> None:
    """ZeRO-3 (fp32; optimizer offload with CPU Adam) on 4 ranks requested 'nccl': = stock 4 ranks, 1 process within 1e-5."""
    keys = "3:fp32,3:fp32:offload+adam"
    ported = _train(tmp_path, "p4", 4, "--runs", keys, "--dist-backend", "nccl")
    stock = _train(tmp_path, "s4", 4, "--no-portspeed", "--runs", keys, env=_clean_env(DS_ACCELERATOR="cpu"))
    single = _train(tmp_path, "s1", 1, "--runs", keys)
    assert ported["world_size"] == 4 and ported["real_backend"] == "gloo"
    for key in keys.split(","):
        assert ported["runs"][key]["partitioned_params"] == 6
        assert ported["runs"][key]["losses"] == stock["runs"][key]["losses"], key
        _assert_within(ported["runs"][key]["losses"], single["runs"][key]["losses"], key, "4 ranks vs 1 process")


# ---------------------------------------------------------------------- ZeRO-Infinity
def test_zero_infinity_nvme_equals_stock_and_cpu_offload(tmp_path: Path) -> None:
    """ZeRO-3 offload_param + offload_optimizer to nvme (async I/O op, a local directory) = stock, = CPU offload."""
    key = "3:fp32:nvme+adam"
    ported = _train(tmp_path, "nvme", 2, "--runs", key, "--nvme-dir", str(tmp_path / "nvme_p"),
                    "--dist-backend", "nccl")
    stock = _train(tmp_path, "nvme_stock", 2, "--no-portspeed", "--runs", key, "--nvme-dir",
                   str(tmp_path / "nvme_s"), env=_clean_env(DS_ACCELERATOR="cpu"))
    cpu = _train(tmp_path, "cpu_off", 2, "--runs", "3:fp32:offload_param+adam")
    assert ported["runs"][key]["losses"] == stock["runs"][key]["losses"]
    _assert_within(ported["runs"][key]["losses"], cpu["runs"]["3:fp32:offload_param+adam"]["losses"], key,
                   "nvme vs cpu offload")
    # DeepSpeed deletes its swap files at teardown; the per-rank swap folders stay
    swap = tmp_path / "nvme_p" / "zero_stage_3"
    assert (swap / "optimizer" / "rank0").is_dir() and (swap / "float32params" / "rank0").is_dir(), \
        "DeepSpeed did not swap to the nvme directory"


# ---------------------------------------------------------------------- stock DeepSpeed's own limits on CPU
def test_stock_deepspeed_refuses_fp16_on_cpu(tmp_path: Path) -> None:
    """Stock DeepSpeed (DS_ACCELERATOR=cpu, no portspeed) refuses fp16: why fp16 is compared with ZeRO-0, not stock."""
    proc = run_python([EXAMPLE, "--no-portspeed", "--runs", "2:fp16", "--steps", "1"], timeout=TIMEOUT,
                      env={"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(DS_OPS_DIR)}, drop=CLEAN)
    assert proc.returncode != 0
    assert "fp16 is not supported on your device" in proc.stderr, _tail(proc.stderr)


# ---------------------------------------------------------------------- the pipeline engine
def _pipe(tmp: Path, name: str, world: int, *args: str, stock: bool = False) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    from portspeed.testing import run_ranks

    argv = [PIPELINE, "--steps", str(PIPE_STEPS), "--out", str(out), *args]
    if stock:
        argv.append("--no-portspeed")
    env = _clean_env(DS_ACCELERATOR="cpu") if stock else _clean_env()
    results = run_ranks(argv, world, timeout=TIMEOUT, env=env)
    if any(r.returncode != 0 for r in results) or not out.exists():
        pytest.fail(f"{name} failed\n" + "\n".join(f"--- rank {r.rank} rc={r.returncode}\n{_tail(r.stderr)}"
                                                   for r in results))
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ds_pipe")
    ckpt = tmp / "ckpt"
    return {
        "one": _pipe(tmp, "one", 1, "--stages", "1"),
        "two": _pipe(tmp, "two", 2, "--stages", "2", "--dist-backend", "nccl"),
        "two_stock": _pipe(tmp, "two_stock", 2, "--stages", "2", stock=True),
        # without dropout: a replica's mask covers its half of a micro-batch (other masks than 1 replica's),
        # and DeepSpeed's checkpoint does not hold the RNG tracker's states, so a resumed dropout stream restarts
        "one_nd": _pipe(tmp, "one_nd", 1, "--stages", "1", "--dropout", "0"),
        "two_nd": _pipe(tmp, "two_nd", 2, "--stages", "2", "--dropout", "0", "--save-dir", str(ckpt),
                        "--save-at", str(PIPE_SAVE_AT)),
        "resumed": _pipe(tmp, "resumed", 2, "--stages", "2", "--dropout", "0", "--resume-from", str(ckpt),
                         "--save-at", str(PIPE_SAVE_AT)),
        "grid": _pipe(tmp, "grid", 4, "--stages", "2", "--dropout", "0", "--dist-backend", "nccl"),
        "ckpt": _pipe(tmp, "ckpt", 2, "--stages", "1", "--model-parallel", "2", "--activation-checkpointing",
                      "--dist-backend", "nccl"),
        "ckpt_stock": _pipe(tmp, "ckpt_stock", 2, "--stages", "1", "--model-parallel", "2",
                            "--activation-checkpointing", stock=True),
    }


def test_pipeline_two_stages_equal_one_stage_and_stock(pipes: dict[str, Any]) -> None:
    """PipelineModule in 2 stages, 4 micro-batches per train_batch: = 1 stage on 1 process within 1e-5, = stock."""
    two, one = pipes["two"], pipes["one"]
    assert two["stages"] == 2 and two["ds_accelerator"] == "PortspeedCpuAccelerator" and two["real_backend"] == "gloo"
    assert two["stage_params"] != one["stage_params"]  # rank 0 holds only the first stage's layers
    assert two["losses"] == pipes["two_stock"]["losses"]
    _assert_within(two["losses"], one["losses"], "pipe:fp32", "2 stages vs 1 stage", steps=PIPE_STEPS)


def test_pipeline_two_stages_by_two_replicas_on_four_ranks(pipes: dict[str, Any]) -> None:
    """2 stages x 2 data-parallel replicas (4 ranks), no dropout: = 1 stage on 1 process within 1e-5."""
    grid = pipes["grid"]
    assert grid["world_size"] == 4 and grid["data_parallel"] == 2
    _assert_within(grid["losses"], pipes["one_nd"]["losses"], "pipe:fp32", "2x2 vs 1 stage", steps=PIPE_STEPS)


def test_pipeline_checkpoint_resumes_identically(pipes: dict[str, Any]) -> None:
    """A pipeline checkpoint saved after step 2 (no dropout), loaded by fresh processes: the same later losses."""
    assert pipes["resumed"]["start_step"] == PIPE_SAVE_AT
    assert pipes["resumed"]["losses"] == pipes["two_nd"]["losses"][PIPE_SAVE_AT:]


def test_activation_checkpointing_with_partitioned_activations(pipes: dict[str, Any]) -> None:
    """deepspeed.checkpointing (RNG tracker dropout, partition_activations over 2 ranks) = no checkpointing, = stock."""
    ckpt = pipes["ckpt"]
    assert ckpt["partition_activations"] is True and ckpt["model_parallel"] == 2
    _assert_within(ckpt["losses"], pipes["one"]["losses"], "pipe:fp32", "checkpointed vs not", steps=PIPE_STEPS)
    assert ckpt["losses"] == pipes["ckpt_stock"]["losses"]


# ---------------------------------------------------------------------- the `deepspeed` launcher
def test_deepspeed_launcher_with_portspeed_worker(tmp_path: Path) -> None:
    """`deepspeed --num_gpus 2 --module portspeed.cli.worker --adaptor ... -- SCRIPT`: the adaptor in every rank."""
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert launcher, "the deepspeed launcher script is missing from the venv"
    out = tmp_path / "launcher.json"
    keys = "2:fp32,3:fp32"
    env = {k: v for k, v in _clean_env().items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    # --no_local_rank: the script reads LOCAL_RANK from the environment (no --local_rank argument)
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), "--no_local_rank",
           "--module", "portspeed.cli.worker",
           "--adaptor", "portspeed.deepspeed_adaptor", "--", EXAMPLE, "--runs", keys, "--steps", str(STEPS),
           "--dist-backend", "nccl", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
                          start_new_session=True)
    assert proc.returncode == 0 and out.exists(), f"deepspeed launcher failed:\n{_tail(proc.stdout + proc.stderr)}"
    rec = json.loads(out.read_text())
    ref = _train(tmp_path, "torchrun_ref", 2, "--runs", keys, "--dist-backend", "nccl")
    assert rec["ds_accelerator"] == "PortspeedCpuAccelerator" and rec["world_size"] == 2
    for key in keys.split(","):
        assert rec["runs"][key]["losses"] == ref["runs"][key]["losses"], key
