"""The longer DeepSpeed checks, run by `make test-deepspeed-more` (marker ``ds_more``; not in CI).

ZeRO-3 on 4 ranks, the pipeline engine (2 stages; 2 stages x 2 replicas on 4 ranks; resume;
activation checkpointing with partitioned activations), ZeRO-Infinity (NVMe through the
async I/O op), the ``deepspeed`` launcher, and stock DeepSpeed's own refusal of fp16 on CPU.
Each is compared with stock DeepSpeed (``DS_ACCELERATOR=cpu``) and/or a single process;
tolerances as in ``tests/test_deepspeed.py`` (fp32: 1e-5 relative per step; stock: 0).

Each case runs on the CPU adapter and on portspeed's test device (``PORTSPEED_ACCELERATOR=testdev``,
a C++ PrivateUse1 device with its CCL ``testccl``; a test device, not hardware; the parameters
marked ``testdev``). The test-device runs are compared with the CPU runs (stock DeepSpeed on CPU
where it runs the case, else the CPU adapter's run) within the dtype's band (fp32: 1e-5), never
with themselves, except a resume, which continues the device's own run.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import free_port, run_command, run_python
from helpers.requires import require

require("deepspeed", "pip install 'portspeed[deepspeed]'")

from helpers.ds_runs import (ADAPTERS, CLEAN, DS_OPS_DIR, EXAMPLE, STEPS, TESTDEV, TIMEOUT,  # noqa: E402
                             assert_within, clean_env, tail, train)

pytestmark = [pytest.mark.deepspeed, pytest.mark.ds_more, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = str(ROOT / "examples" / "deepspeed_pipeline.py")
PIPE_STEPS, PIPE_SAVE_AT = 5, 2


def _env(adapter: str, **extra: str) -> dict[str, str]:
    """A rank's environment on ``adapter`` ("cpu" or "testdev")."""
    return clean_env(**extra) if adapter == "cpu" else clean_env(**TESTDEV, **extra)


def _devices(adapter: str, world: int) -> list[str]:
    """The parameter device of each rank: the host, or the rank's own test device."""
    return ["cpu"] * world if adapter == "cpu" else [f"testdev:{r}" for r in range(world)]


# ---------------------------------------------------------------------- ZeRO-3, 4 ranks
FOUR_RANK_RUNS = "3:fp32,3:fp32:offload+adam"


@pytest.fixture(scope="module")
def four_rank_refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Stock DeepSpeed on 4 CPU ranks, and 1 process through portspeed (CPU)."""
    tmp = tmp_path_factory.mktemp("ds_four")
    return {"stock": train(tmp, "s4", 4, "--no-portspeed", "--runs", FOUR_RANK_RUNS,
                           env=clean_env(DS_ACCELERATOR="cpu")),
            "single": train(tmp, "s1", 1, "--runs", FOUR_RANK_RUNS)}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_zero3_on_four_ranks_equals_stock_and_single_process(tmp_path: Path, four_rank_refs: dict[str, Any],
                                                             adapter: str) -> None:
    """ZeRO-3 (fp32; optimizer offload, CPU Adam) on 4 ranks requested 'nccl': = stock 4 ranks, 1 process within 1e-5.

    On the test device (4 ranks, 4 devices): within 1e-5 of stock DeepSpeed's 4 CPU ranks.
    """
    ported = train(tmp_path, "p4", 4, "--runs", FOUR_RANK_RUNS, "--dist-backend", "nccl", env=_env(adapter))
    stock, single = four_rank_refs["stock"], four_rank_refs["single"]
    assert ported["world_size"] == 4 and ported["real_backend"] == ("gloo" if adapter == "cpu" else "testccl")
    for key in FOUR_RANK_RUNS.split(","):
        run = ported["runs"][key]
        assert run["partitioned_params"] == 6 and run["param_devices"] == _devices(adapter, 4), run
        if adapter == "cpu":
            assert run["losses"] == stock["runs"][key]["losses"], key
        else:
            assert run["optimizer"] == ("DeepSpeedCPUAdam" if "adam" in key else "SGD"), run
            worst = assert_within(run["losses"], stock["runs"][key]["losses"], key, "test device vs stock CPU")
            print(f"{key} 4 ranks: test device vs stock CPU, worst relative difference {worst:.3g}")
        assert_within(run["losses"], single["runs"][key]["losses"], key, "4 ranks vs 1 process")


# ---------------------------------------------------------------------- ZeRO-Infinity
NVME_RUN = "3:fp32:nvme+adam"


@pytest.fixture(scope="module")
def nvme_refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Stock DeepSpeed's nvme run on 2 CPU ranks, and the CPU-offload run through portspeed."""
    tmp = tmp_path_factory.mktemp("ds_nvme")
    return {"stock": train(tmp, "nvme_stock", 2, "--no-portspeed", "--runs", NVME_RUN, "--nvme-dir",
                           str(tmp / "nvme_s"), env=clean_env(DS_ACCELERATOR="cpu")),
            "cpu_offload": train(tmp, "cpu_off", 2, "--runs", "3:fp32:offload_param+adam")}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_zero_infinity_nvme_equals_stock_and_cpu_offload(tmp_path: Path, nvme_refs: dict[str, Any],
                                                         adapter: str) -> None:
    """ZeRO-3 offload_param + offload_optimizer to nvme (async I/O op, a local directory) = stock, = CPU offload.

    On the test device: parameters on the device, their ZeRO-3 slices swapped between disk and host
    buffers, losses within 1e-5 of stock DeepSpeed's nvme run on CPU.
    """
    key = NVME_RUN
    ported = train(tmp_path, "nvme", 2, "--runs", key, "--nvme-dir", str(tmp_path / "nvme_p"),
                   "--dist-backend", "nccl", env=_env(adapter))
    run, stock = ported["runs"][key], nvme_refs["stock"]["runs"][key]
    assert run["optimizer"] == "DeepSpeedCPUAdam" and run["partitioned_params"] == 6, run
    assert run["param_devices"] == _devices(adapter, 2), run
    if adapter == "cpu":
        assert run["losses"] == stock["losses"]
    else:
        assert ported["real_backend"] == "testccl"
        worst = assert_within(run["losses"], stock["losses"], key, "test device vs stock CPU")
        print(f"{key}: test device vs stock CPU, worst relative difference {worst:.3g}")
    assert_within(run["losses"], nvme_refs["cpu_offload"]["runs"]["3:fp32:offload_param+adam"]["losses"], key,
                  "nvme vs cpu offload")
    # DeepSpeed deletes its swap files at teardown; the per-rank swap folders stay
    swap = tmp_path / "nvme_p" / "zero_stage_3"
    missing = [f"{kind}/rank{r}" for kind in ("optimizer", "float32params") for r in (0, 1)
               if not (swap / kind / f"rank{r}").is_dir()]
    assert not missing, f"DeepSpeed did not swap to the nvme directory: no {missing} under {swap}"


# ---------------------------------------------------------------------- stock DeepSpeed's own limits on CPU
def test_stock_deepspeed_refuses_fp16_on_cpu(tmp_path: Path) -> None:
    """Stock DeepSpeed (DS_ACCELERATOR=cpu, no portspeed) refuses fp16: why fp16 is compared with ZeRO-0, not stock."""
    proc = run_python([EXAMPLE, "--no-portspeed", "--runs", "2:fp16", "--steps", "1"], timeout=TIMEOUT,
                      env={"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(DS_OPS_DIR)}, drop=CLEAN)
    assert proc.returncode != 0
    assert "fp16 is not supported on your device" in proc.stderr, tail(proc.stderr)


# ---------------------------------------------------------------------- the pipeline engine
def _pipe(tmp: Path, name: str, world: int, *args: str, stock: bool = False, adapter: str = "cpu") -> dict[str, Any]:
    out = tmp / f"{name}.json"
    from portspeed.testing import run_ranks

    argv = [PIPELINE, "--steps", str(PIPE_STEPS), "--out", str(out), *args]
    if stock:
        argv.append("--no-portspeed")
    env = clean_env(DS_ACCELERATOR="cpu") if stock else _env(adapter)
    results = run_ranks(argv, world, timeout=TIMEOUT, env=env)
    if any(r.returncode != 0 for r in results) or not out.exists():
        pytest.fail(f"{name} failed\n" + "\n".join(f"--- rank {r.rank} rc={r.returncode}\n{tail(r.stderr)}"
                                                   for r in results))
    return json.loads(out.read_text())


def _ported_pipes(tmp: Path, adapter: str) -> dict[str, Any]:
    """The pipeline runs through portspeed on ``adapter``: 2 stages, 2 stages saving / resuming, 2x2, checkpointing."""
    ckpt = tmp / "ckpt"
    return {
        "two": _pipe(tmp, "two", 2, "--stages", "2", "--dist-backend", "nccl", adapter=adapter),
        # without dropout: a replica's mask covers its half of a micro-batch (other masks than 1 replica's),
        # and DeepSpeed's checkpoint does not hold the RNG tracker's states, so a resumed dropout stream restarts
        "two_nd": _pipe(tmp, "two_nd", 2, "--stages", "2", "--dropout", "0", "--save-dir", str(ckpt),
                        "--save-at", str(PIPE_SAVE_AT), adapter=adapter),
        "resumed": _pipe(tmp, "resumed", 2, "--stages", "2", "--dropout", "0", "--resume-from", str(ckpt),
                         "--save-at", str(PIPE_SAVE_AT), adapter=adapter),
        "grid": _pipe(tmp, "grid", 4, "--stages", "2", "--dropout", "0", "--dist-backend", "nccl", adapter=adapter),
        "ckpt": _pipe(tmp, "ckpt", 2, "--stages", "1", "--model-parallel", "2", "--activation-checkpointing",
                      "--dist-backend", "nccl", adapter=adapter),
    }


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The CPU runs: the references (1 stage on 1 process, stock) and portspeed's on the CPU adapter."""
    tmp = tmp_path_factory.mktemp("ds_pipe")
    return {
        "one": _pipe(tmp, "one", 1, "--stages", "1"),
        "two_stock": _pipe(tmp, "two_stock", 2, "--stages", "2", stock=True),
        "one_nd": _pipe(tmp, "one_nd", 1, "--stages", "1", "--dropout", "0"),
        "ckpt_stock": _pipe(tmp, "ckpt_stock", 2, "--stages", "1", "--model-parallel", "2",
                            "--activation-checkpointing", stock=True),
        **_ported_pipes(tmp, "cpu"),
    }


@pytest.fixture(scope="module")
def testdev_pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same ported runs on the test device (a test device, not hardware)."""
    return _ported_pipes(tmp_path_factory.mktemp("ds_pipe_testdev"), "testdev")


def _pipes_on(adapter: str, pipes: dict[str, Any], request: pytest.FixtureRequest) -> dict[str, Any]:
    return pipes if adapter == "cpu" else request.getfixturevalue("testdev_pipes")


def _check_placement(rec: dict[str, Any], adapter: str) -> None:
    assert rec["ds_accelerator"] == ("PortspeedCpuAccelerator" if adapter == "cpu" else "PortspeedAccelerator")
    assert rec["real_backend"] == ("gloo" if adapter == "cpu" else "testccl")
    assert rec["param_devices"] == _devices(adapter, rec["world_size"]), rec["param_devices"]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_pipeline_two_stages_equal_one_stage_and_stock(pipes: dict[str, Any], adapter: str,
                                                       request: pytest.FixtureRequest) -> None:
    """PipelineModule in 2 stages, 4 micro-batches per train_batch: = 1 stage on 1 process within 1e-5, = stock.

    On the test device (p2p over testccl): within 1e-5 of stock DeepSpeed's 2 stages on CPU.
    """
    two, one = _pipes_on(adapter, pipes, request)["two"], pipes["one"]
    assert two["stages"] == 2
    _check_placement(two, adapter)
    assert two["stage_params"] != one["stage_params"]  # rank 0 holds only the first stage's layers
    if adapter == "cpu":
        assert two["losses"] == pipes["two_stock"]["losses"]
    else:
        worst = assert_within(two["losses"], pipes["two_stock"]["losses"], "pipe:fp32",
                              "test device vs stock CPU", steps=PIPE_STEPS)
        print(f"pipeline 2 stages: test device vs stock CPU, worst relative difference {worst:.3g}")
    assert_within(two["losses"], one["losses"], "pipe:fp32", "2 stages vs 1 stage", steps=PIPE_STEPS)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_pipeline_two_stages_by_two_replicas_on_four_ranks(pipes: dict[str, Any], adapter: str,
                                                           request: pytest.FixtureRequest) -> None:
    """2 stages x 2 data-parallel replicas (4 ranks), no dropout: = 1 stage on 1 process within 1e-5.

    On the test device (4 devices) also within 1e-5 of the CPU adapter's 2x2 run.
    """
    grid = _pipes_on(adapter, pipes, request)["grid"]
    assert grid["world_size"] == 4 and grid["data_parallel"] == 2
    _check_placement(grid, adapter)
    assert_within(grid["losses"], pipes["one_nd"]["losses"], "pipe:fp32", "2x2 vs 1 stage", steps=PIPE_STEPS)
    if adapter != "cpu":
        worst = assert_within(grid["losses"], pipes["grid"]["losses"], "pipe:fp32", "test device vs CPU 2x2",
                              steps=PIPE_STEPS)
        print(f"pipeline 2x2: test device vs CPU, worst relative difference {worst:.3g}")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_pipeline_checkpoint_resumes_identically(pipes: dict[str, Any], adapter: str,
                                                 request: pytest.FixtureRequest) -> None:
    """A pipeline checkpoint saved after step 2 (no dropout), loaded by fresh processes: the same later losses.

    On the test device the resume continues the device's own run (identical), whose losses are within 1e-5
    of the CPU adapter's.
    """
    on = _pipes_on(adapter, pipes, request)
    assert on["resumed"]["start_step"] == PIPE_SAVE_AT
    _check_placement(on["resumed"], adapter)
    assert on["resumed"]["losses"] == on["two_nd"]["losses"][PIPE_SAVE_AT:]
    if adapter != "cpu":
        worst = assert_within(on["two_nd"]["losses"], pipes["two_nd"]["losses"], "pipe:fp32",
                              "test device vs CPU, no dropout", steps=PIPE_STEPS)
        print(f"pipeline 2 stages without dropout: test device vs CPU, worst relative difference {worst:.3g}")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_activation_checkpointing_with_partitioned_activations(pipes: dict[str, Any], adapter: str,
                                                               request: pytest.FixtureRequest) -> None:
    """deepspeed.checkpointing (RNG tracker dropout, partition_activations over 2 ranks) = no checkpointing, = stock.

    On the test device the dropout masks come from the device generator through the tracker (restored for the
    recomputation) and the partitions are gathered over testccl: within 1e-5 of stock on CPU.
    """
    ckpt = _pipes_on(adapter, pipes, request)["ckpt"]
    assert ckpt["partition_activations"] is True and ckpt["model_parallel"] == 2
    _check_placement(ckpt, adapter)
    assert_within(ckpt["losses"], pipes["one"]["losses"], "pipe:fp32", "checkpointed vs not", steps=PIPE_STEPS)
    if adapter == "cpu":
        assert ckpt["losses"] == pipes["ckpt_stock"]["losses"]
    else:
        worst = assert_within(ckpt["losses"], pipes["ckpt_stock"]["losses"], "pipe:fp32", "test device vs stock CPU",
                              steps=PIPE_STEPS)
        print(f"activation checkpointing: test device vs stock CPU, worst relative difference {worst:.3g}")


# ---------------------------------------------------------------------- the `deepspeed` launcher
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_deepspeed_launcher_with_portspeed_worker(tmp_path: Path, adapter: str) -> None:
    """`deepspeed --num_gpus 2 --module portspeed.cli.worker --adaptor ... -- SCRIPT`: the adaptor in every rank.

    Compared with torchrun on the CPU adapter: bit for bit there; on the test device within 1e-5, each rank on
    its own device.
    """
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert launcher, "the deepspeed launcher script is missing from the venv"
    out = tmp_path / "launcher.json"
    keys = "2:fp32,3:fp32"
    env = {k: v for k, v in _env(adapter).items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    # --no_local_rank: the script reads LOCAL_RANK from the environment (no --local_rank argument)
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), "--no_local_rank",
           "--module", "portspeed.cli.worker",
           "--adaptor", "portspeed.deepspeed_adaptor", "--", EXAMPLE, "--runs", keys, "--steps", str(STEPS),
           "--dist-backend", "nccl", "--out", str(out)]
    # its own session, so a timeout ends the launcher's children too (the launcher, the ranks), not just the runner
    res = run_command(cmd, TIMEOUT, env, cwd=ROOT)
    assert res.returncode == 0 and out.exists(), f"deepspeed launcher failed:\n{tail(res.stdout + res.stderr)}"
    rec = json.loads(out.read_text())
    ref = train(tmp_path, "torchrun_ref", 2, "--runs", keys, "--dist-backend", "nccl")
    assert rec["world_size"] == 2
    assert rec["ds_accelerator"] == ("PortspeedCpuAccelerator" if adapter == "cpu" else "PortspeedAccelerator")
    assert rec["real_backend"] == ("gloo" if adapter == "cpu" else "testccl")
    for key in keys.split(","):
        assert rec["runs"][key]["param_devices"] == _devices(adapter, 2), key
        if adapter == "cpu":
            assert rec["runs"][key]["losses"] == ref["runs"][key]["losses"], key
        else:
            worst = assert_within(rec["runs"][key]["losses"], ref["runs"][key]["losses"], key,
                                  "launcher on the test device vs CPU torchrun")
            print(f"{key} deepspeed launcher: test device vs CPU torchrun, worst relative difference {worst:.3g}")
