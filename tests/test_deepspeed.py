"""DeepSpeed on the portspeed adapter: the injected accelerator, backend routing, ZeRO 0-3 parity.

Multi-rank runs start real processes (``portspeed.testing.run_ranks``: 127.0.0.1, a free
port, a hard timeout) of ``examples/deepspeed_train.py`` (tests/helpers/ds_runs.py); the checks
that import DeepSpeed with the adaptor in one process: test_deepspeed_adaptor.py.

Tolerances, per-step loss, relative:
- portspeed vs stock DeepSpeed (``DS_ACCELERATOR=cpu``) on the same 2 Gloo ranks: 0, the
  same float operations run in the same order; portspeed only answers device questions.
- 2 ranks vs 1 process (same global batch): fp32 1e-5, bf16 5e-3. Splitting the batch
  changes the order gradients are summed in; fp32 rounding (6e-8 per op) gives ~2e-7
  after 6 steps; bf16 gradients (unit roundoff 3.9e-3) give ~2e-4. A gradient off by a
  factor of 2 (SUM where the mean is due) moves the losses by 1e-2 to 1e-1 with the SGD
  this example uses, so both bounds still catch it.
- the stand-in vendor backend vs Gloo: the dtype's bound above (its ring all-reduce sums
  in another order; with 2 ranks a+b == b+a, so 0 is what is observed).
- resume from a ZeRO checkpoint vs the uninterrupted run: 0 (the state is restored exactly).
- ZeRO-Offload with DeepSpeed's CPU Adam (``cpu_adam``, built by ``make ds-ops``): = stock, and
  fp32's 1e-5 against 1 process (the same sums reordered; Adam's step is ~lr * sign(g) at
  first, and these gradients are far from 0).
- fp16 (dynamic loss scaling; stock DeepSpeed refuses fp16 on its CPU accelerator, so ZeRO-2
  is compared with ZeRO-0 through portspeed): 1e-3, twice fp16's unit roundoff (4.9e-4); both
  keep fp32 master weights and the SGD step, so only the fp16 gradient sums differ in order.
- portspeed's test device (``PORTSPEED_ACCELERATOR=testdev``: a C++ PrivateUse1 device with
  its own memory and its CCL ``testccl``; a test device, not hardware) vs stock DeepSpeed
  on CPU, same 2 ranks (fp16, which stock refuses, and mpirun: vs the CPU adapter's run): the
  dtype's bound above. The device runs torch's CPU kernels and
  testccl stages through Gloo, so 0 is what is observed; the bound leaves room for a device
  kernel or a CCL that sums in another order, and still catches a wrong reduction.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.ds_runs import (ADAM_OFFLOAD_RUNS, ADAPTERS, ALL_RUNS, DS_OPS_DIR, EXAMPLE, FP16_RUNS, OFFLOAD_RUNS,
                             OVERFLOW_AT, OVERFLOW_RUNS, SAVE_AT, STEPS, TESTDEV, TESTDEV_FP16_RUNS, TESTDEV_RUNS,
                             TIMEOUT, TOL, assert_within, clean_env, rel, tail, train)
from helpers.requires import require

deepspeed = require("deepspeed", "pip install 'portspeed[deepspeed]'")

pytestmark = [pytest.mark.deepspeed]

def _on(adapter: str, runs: dict[str, Any], request: pytest.FixtureRequest) -> dict[str, Any]:
    """The 2-rank record of ``adapter``: the CPU run, or the test device's (fixture ``testdev_run``, only then)."""
    return runs["ported"] if adapter == "cpu" else request.getfixturevalue("testdev_run")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The ported 2-rank run (saving checkpoints), the stock run, the 1-process run, the resumed run."""
    tmp = tmp_path_factory.mktemp("ds_runs")
    ckpt = tmp / "ckpt"
    ported = train(tmp, "ported", 2, "--save-dir", str(ckpt), "--save-at", str(SAVE_AT), "--dist-backend", "nccl",
                   "--runs", f"{ALL_RUNS},{ADAM_OFFLOAD_RUNS},{FP16_RUNS},{OVERFLOW_RUNS}",
                   "--overflow-at", str(OVERFLOW_AT))
    stock = train(tmp, "stock", 2, "--no-portspeed", "--runs", f"{ALL_RUNS},{OFFLOAD_RUNS},{ADAM_OFFLOAD_RUNS}",
                  env=clean_env(DS_ACCELERATOR="cpu"))
    single = train(tmp, "single", 1, "--runs", f"{ALL_RUNS},{ADAM_OFFLOAD_RUNS},{FP16_RUNS}")
    resumed = train(tmp, "resumed", 2, "--resume-from", str(ckpt), "--save-at", str(SAVE_AT),
                    "--runs", f"{ALL_RUNS},{ADAM_OFFLOAD_RUNS},{FP16_RUNS}")
    return {"ported": ported, "stock": stock, "single": single, "resumed": resumed}


@pytest.mark.multiproc
def test_runs_used_the_accelerators_they_claim(runs: dict[str, Any]) -> None:
    """The ported run used the portspeed-backed accelerator, the stock one DeepSpeed's own (else parity is vacuous)."""
    assert runs["ported"]["ds_accelerator"] == "PortspeedCpuAccelerator"
    assert runs["stock"]["ds_accelerator"] == "CPU_Accelerator"
    assert runs["ported"]["world_size"] == 2 and runs["single"]["world_size"] == 1
    for key, run in runs["ported"]["runs"].items():
        assert len(run["losses"]) == STEPS, key
        assert all(math.isfinite(x) for x in run["losses"]), key
        assert len(set(run["losses"])) == STEPS, f"{key}: losses do not change from step to step"


@pytest.mark.multiproc
@pytest.mark.parametrize("key", ALL_RUNS.split(","))
def test_zero_losses_equal_stock_deepspeed(runs: dict[str, Any], key: str) -> None:
    """ZeRO stage/dtype on 2 Gloo ranks: portspeed's per-step losses are bit-identical to stock DeepSpeed's."""
    assert runs["ported"]["runs"][key]["losses"] == runs["stock"]["runs"][key]["losses"]


@pytest.mark.multiproc
@pytest.mark.parametrize("key", ALL_RUNS.split(","))
def test_zero_losses_match_single_process(runs: dict[str, Any], key: str) -> None:
    """ZeRO stage/dtype on 2 ranks matches one process on the same global batch within the dtype's tolerance."""
    tol = TOL[key.split(":")[1]]
    two, one = runs["ported"]["runs"][key]["losses"], runs["single"]["runs"][key]["losses"]
    worst = max(rel(a, b) for a, b in zip(two, one))
    assert worst <= tol, f"{key}: worst relative difference {worst:.3g} > {tol} ({two} vs {one})"


@pytest.mark.multiproc
@pytest.mark.parametrize("key", f"{ALL_RUNS},{ADAM_OFFLOAD_RUNS},{FP16_RUNS}".split(","))
def test_zero_checkpoint_resumes_identically(runs: dict[str, Any], key: str) -> None:
    """A ZeRO checkpoint saved after step 3 and loaded by fresh processes gives the same later losses."""
    resumed = runs["resumed"]["runs"][key]
    assert resumed["start_step"] == SAVE_AT
    assert resumed["losses"] == runs["ported"]["runs"][key]["losses"][SAVE_AT:]


@pytest.mark.multiproc
def test_routing_is_in_the_report(runs: dict[str, Any]) -> None:
    """portspeed.report() carries the backend route DeepSpeed's init_distributed took, and the accelerator patch."""
    report = {r["name"]: r for r in runs["ported"]["report"]}
    init = report["deepspeed.comm.init_distributed.backend"]
    assert init["status"] == "applied"
    assert "dist_backend 'nccl' -> 'gloo'" in init["detail"]
    assert report["deepspeed.accelerator"]["status"] == "applied"
    assert runs["ported"]["real_backend"] == "gloo"


# ---------------------------------------------------------------------- ZeRO-Offload with DeepSpeed's CPU Adam
def test_set_up_built_deepspeeds_host_ops_and_installed_mpi() -> None:
    """`make ds-ops` left DeepSpeed's CPU Adam and shm ops in the venv; `make sysdeps` Open MPI and libaio, so
    ZeRO-Infinity's async I/O op can be built (`make test-deepspeed-more` builds and runs it; no CI test loads it)."""
    missing = [op for op in ("cpu_adam", "deepspeed_shm_comm") if not (DS_OPS_DIR / op / f"{op}.so").exists()]
    assert not missing, (f"DeepSpeed ops {missing} are not built in {DS_OPS_DIR}: run `make ds-ops` (the tests would "
                         "otherwise JIT-build them inside a timed run)")
    import shutil

    assert shutil.which("mpirun"), "Open MPI's mpirun is missing: `make sysdeps` (apt-get install -y openmpi-bin)"
    require("mpi4py", "pip install mpi4py")
    from portspeed.integrations.ds_build import missing_prerequisite

    assert missing_prerequisite("async_io") is None, missing_prerequisite("async_io")


@pytest.mark.multiproc
@pytest.mark.parametrize("key", ADAM_OFFLOAD_RUNS.split(","))
def test_offload_with_cpu_adam_equals_stock_and_single_process(runs: dict[str, Any], key: str) -> None:
    """ZeRO-2/3 offload_optimizer (ZeRO-3: offload_param too) with DeepSpeedCPUAdam: = stock, 1 process within 1e-5."""
    run = runs["ported"]["runs"][key]
    assert run["optimizer"] == "DeepSpeedCPUAdam", run  # DeepSpeed's CPU Adam op, not a torch optimizer
    if "offload_param" in key:
        assert run["partition_device"] == "cpu" and run["partitioned_params"] == 6, run
    assert run["losses"] == runs["stock"]["runs"][key]["losses"]
    worst = assert_within(run["losses"], runs["single"]["runs"][key]["losses"], key, "2 ranks vs 1 process")
    print(f"{key}: vs 1 process {worst:.3g}")


# ---------------------------------------------------------------------- fp16, dynamic loss scaling
@pytest.mark.multiproc
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_fp16_zero2_matches_zero0_and_single_process(runs: dict[str, Any], adapter: str,
                                                     request: pytest.FixtureRequest) -> None:
    """fp16 ZeRO-2 vs fp16 ZeRO stage 0 (stock DeepSpeed refuses fp16 on its CPU accelerator), and vs 1 process.

    Band 1e-3 relative (fp16's unit roundoff is 4.9e-4; both keep fp32 master weights, so the
    difference is the order of the fp16 gradient sums). ZeRO-0's engine.backward leaves the loss
    unscaled in DeepSpeed 0.19.8 (deepspeedai/DeepSpeed#8393), which the example makes up for.
    On the test device also against the CPU adapter's run (the same band).
    """
    rec = _on(adapter, runs, request)
    zero0, zero2 = rec["runs"]["0:fp16"], rec["runs"]["2:fp16"]
    assert_within(zero2["losses"], zero0["losses"], "2:fp16", "ZeRO-2 vs ZeRO-0")
    for key in ("0:fp16", "2:fp16"):
        assert_within(rec["runs"][key]["losses"], runs["single"]["runs"][key]["losses"], key,
                      "2 ranks vs 1 process")
        assert rec["runs"][key]["fp16"]["skipped"] == [0] * STEPS  # no overflow at scale 2**16 here
        if adapter != "cpu":
            worst = assert_within(rec["runs"][key]["losses"], runs["ported"]["runs"][key]["losses"], key,
                                  "test device vs the CPU run")
            print(f"{key}: test device vs CPU, worst relative difference {worst:.3g}")
    # and it trains: within 1e-3 of the fp32 run (an update 2**16 times too small stays at the start)
    assert_within(zero2["losses"], rec["runs"]["2:fp32"]["losses"], "2:fp16", "fp16 vs fp32")


@pytest.mark.multiproc
@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_overflow_step_is_skipped(runs: dict[str, Any], stage: int, adapter: str,
                                       request: pytest.FixtureRequest) -> None:
    """A step whose scaled gradients overflow is skipped: parameters unchanged, loss scale halved, training goes on.

    On the test device also: the same skips and loss scales as the CPU run, losses within its band.
    """
    rec = _on(adapter, runs, request)
    got = rec["runs"][f"{stage}:fp16:overflow"]
    clean = rec["runs"][f"{stage}:fp16"]
    fp16 = got["fp16"]
    assert fp16["skipped"] == [0] * OVERFLOW_AT + [1] * (STEPS - OVERFLOW_AT), fp16
    assert fp16["param_sum"][OVERFLOW_AT] == fp16["param_sum"][OVERFLOW_AT - 1], "the overflowed step changed weights"
    assert fp16["param_sum"][OVERFLOW_AT + 1] != fp16["param_sum"][OVERFLOW_AT], "training stopped after the skip"
    assert fp16["scale"][OVERFLOW_AT] == fp16["scale"][OVERFLOW_AT - 1] / 2, fp16["scale"]
    # up to the overflowed step (its loss is computed before the step) the run is the clean run
    assert got["losses"][:OVERFLOW_AT + 1] == clean["losses"][:OVERFLOW_AT + 1]
    assert got["losses"][OVERFLOW_AT + 1] != clean["losses"][OVERFLOW_AT + 1]
    other = rec["runs"][f"{2 - stage}:fp16:overflow"]["losses"]
    assert_within(got["losses"], other, f"{stage}:fp16", "overflow run, ZeRO-0 vs ZeRO-2")
    if adapter != "cpu":
        cpu = runs["ported"]["runs"][f"{stage}:fp16:overflow"]
        assert (fp16["skipped"], fp16["scale"]) == (cpu["fp16"]["skipped"], cpu["fp16"]["scale"])
        worst = assert_within(got["losses"], cpu["losses"], f"{stage}:fp16", "overflow run, test device vs CPU")
        print(f"{stage}:fp16:overflow: test device vs CPU, worst relative difference {worst:.3g}")


# ---------------------------------------------------------------------- MPI discovery
def _mpirun(tmp_path: Path, keys: str, **env_extra: str) -> dict[str, Any]:
    """``mpirun -np 2`` of the example with no launcher variables (DeepSpeed's MPI discovery); rank 0's record."""
    import shutil
    import subprocess

    mpirun = shutil.which("mpirun")
    assert mpirun, "Open MPI's mpirun is missing: `make sysdeps` (apt-get install -y openmpi-bin libopenmpi-dev)"
    env = {k: v for k, v in clean_env(**env_extra).items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONWARNINGS="ignore", PORTSPEED_TIMEOUT="120")
    out = tmp_path / "mpi.json"
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    from helpers.launch import free_port

    cmd = [mpirun, "-np", "2", *root, "--oversubscribe", "--bind-to", "none", sys.executable, EXAMPLE,
           "--runs", keys, "--steps", str(STEPS), "--dist-backend", "nccl", "--dist-port", str(free_port()),
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, start_new_session=True)
    assert proc.returncode == 0 and out.exists(), f"mpirun failed ({proc.returncode}):\n{tail(proc.stderr)}"
    rec = json.loads(out.read_text())
    assert rec["mpi_launched"] and rec["world_size"] == 2 and rec["backend"] == "nccl"
    return rec


#: the runs the mpirun launches train
MPI_RUNS = "2:fp32,3:fp32"


@pytest.mark.multiproc
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_mpirun_discovery_matches_torchrun(runs: dict[str, Any], tmp_path: Path, adapter: str) -> None:
    """`mpirun -np 2` with no launcher variables: DeepSpeed's MPI discovery, 'nccl' routed, losses = the torchrun run.

    On the test device: 'nccl' becomes testccl, each rank on its own device (the index DeepSpeed's
    discovery derives), losses within the dtype's band of the CPU torchrun run.
    """
    rec = _mpirun(tmp_path, MPI_RUNS, **({} if adapter == "cpu" else TESTDEV))
    used = "gloo" if adapter == "cpu" else "testccl"
    assert rec["real_backend"] == used
    assert {"requested": "nccl", "used": used, "how": "mapped by portspeed.comm.router at init_process_group"} \
        in rec["routes"]
    for key in MPI_RUNS.split(","):
        got, ref = rec["runs"][key], runs["ported"]["runs"][key]
        if adapter == "cpu":
            assert got["losses"] == ref["losses"], key
        else:
            assert got["param_devices"] == ["testdev:0", "testdev:1"], key
            worst = assert_within(got["losses"], ref["losses"], key, "mpirun on the test device vs CPU torchrun")
            print(f"{key}: mpirun on the test device vs CPU torchrun, worst relative difference {worst:.3g}")


@pytest.mark.multiproc
def test_nccl_request_runs_on_standin_backend_and_matches_gloo(runs: dict[str, Any], tmp_path: Path) -> None:
    """ZeRO-2 asked for 'nccl' runs on the stand-in vendor backend, not Gloo, and matches Gloo's losses (fp32, bf16)."""
    pre = ("import portspeed, portspeed.testing.standin_ccl as standin\n"
           "portspeed.set_accelerator(standin.StandinAccelerator())")
    rec = train(tmp_path, "standin", 2, "--runs", "2:fp32,2:bf16", "--dist-backend", "nccl", pre=pre)
    assert rec["real_backend"] == "standin"
    assert rec["backend"] == "nccl"  # what the script asked for, reported back (router's two-way names)
    assert {"requested": "nccl", "used": "standin", "how": "mapped by portspeed.comm.router at init_process_group"} \
        in rec["routes"]
    for key in ("2:fp32", "2:bf16"):
        got, ref = rec["runs"][key]["losses"], runs["ported"]["runs"][key]["losses"]
        worst = max(rel(a, b) for a, b in zip(got, ref))
        tol = TOL[key.split(":")[1]]
        assert worst <= tol, f"{key} stand-in vs Gloo: {worst:.3g} > {tol} ({got} vs {ref})"


@pytest.mark.multiproc
def test_megatron_deepspeed_style_run_matches(runs: dict[str, Any], tmp_path: Path) -> None:
    """Both adaptors, Megatron-Core's parallel state as DeepSpeed's mpu: same losses as DeepSpeed alone, bit for bit."""
    require("megatron.core", "pip install 'portspeed[megatron]'")
    keys = "2:bf16,3:fp32"
    rec = train(tmp_path, "megatron_ds", 2, "--runs", keys, "--megatron")
    for key in keys.split(","):
        assert rec["runs"][key]["losses"] == runs["ported"]["runs"][key]["losses"], key
    status = {r["name"]: r["status"] for r in rec["report"]}
    assert any(n.startswith("megatron.core.parallel_state") and st == "applied" for n, st in status.items())
    assert status["deepspeed.accelerator"] == "applied"


# ---------------------------------------------------------------------- on portspeed's test device
# ZeRO on a device that is not the host (the test device: its own memory, generator and CCL;
# a test device, not hardware), compared with stock DeepSpeed on CPU: a tensor left on the
# host, a host-side assumption in an accelerator answer or a missing copy-back after a
# collective shows as an error or a different loss. The extension is built by `make test`;
# if it cannot be built, the runs fail (never skip).


@pytest.fixture(scope="module")
def testdev_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ZeRO 1-3 (fp32, bf16, offload) and fp16 (ZeRO-0/2, an overflow) on 2 test-device ranks through the adaptor."""
    tmp = tmp_path_factory.mktemp("ds_testdev")
    record = train(tmp, "testdev", 2, "--save-dir", str(tmp / "ckpt"), "--save-at", str(SAVE_AT), "--runs",
                   f"{TESTDEV_RUNS},{TESTDEV_FP16_RUNS}", "--overflow-at", str(OVERFLOW_AT), env=clean_env(**TESTDEV))
    return {**record, "ckpt": tmp / "ckpt"}


#: the test-device cases resumed from their own checkpoint: offload (a real device -> host move) and fp16
TESTDEV_RESUME_RUNS = OFFLOAD_RUNS + "," + ADAM_OFFLOAD_RUNS + "," + FP16_RUNS


@pytest.fixture(scope="module")
def testdev_resumed(testdev_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Fresh test-device processes load the checkpoints ``testdev_run`` saved after step 3 and train on."""
    tmp = tmp_path_factory.mktemp("ds_testdev_resumed")
    assert testdev_run["ckpt"].is_dir(), f"the test-device run saved no checkpoint folder {testdev_run['ckpt']}"
    return train(tmp, "testdev_resumed", 2, "--resume-from", str(testdev_run["ckpt"]), "--save-at",
                 str(SAVE_AT), "--runs", TESTDEV_RESUME_RUNS, env=clean_env(**TESTDEV))


@pytest.mark.testdev
@pytest.mark.multiproc
@pytest.mark.parametrize("key", TESTDEV_RESUME_RUNS.split(","))
def test_testdev_checkpoint_resumes_identically(testdev_run: dict[str, Any], testdev_resumed: dict[str, Any],
                                                key: str) -> None:
    """Offload and fp16 on the test device: a checkpoint saved after step 3, loaded anew, continues exactly."""
    resumed = testdev_resumed["runs"][key]
    assert resumed["start_step"] == SAVE_AT
    assert resumed["param_devices"] == ["testdev:0", "testdev:1"], key
    assert resumed["losses"] == testdev_run["runs"][key]["losses"][SAVE_AT:], key


@pytest.mark.testdev
@pytest.mark.multiproc
def test_testdev_runs_on_the_device_and_its_ccl(testdev_run: dict[str, Any]) -> None:
    """The test-device run used portspeed's device accelerator, testccl, device parameters, real ZeRO-3 partitions."""
    assert testdev_run["ds_accelerator"] == "PortspeedAccelerator"
    assert testdev_run["real_backend"] == "testccl" and testdev_run["backend"] == "testccl"
    assert set(testdev_run["runs"]) == set(f"{TESTDEV_RUNS},{TESTDEV_FP16_RUNS}".split(","))
    for key, run in testdev_run["runs"].items():
        assert run["param_device"] == "testdev:0", key  # rank 0's parameters live on its device
        assert run["param_devices"] == ["testdev:0", "testdev:1"], key  # each rank on its own device
        assert len(set(run["losses"])) == STEPS, f"{key}: losses do not change from step to step"
        if key.startswith("3:"):
            assert run["partitioned_params"] == 6, f"{key}: ZeRO-3 did not partition the 6 parameters"
        if "offload_param" in key:  # a real device -> host move: the ZeRO-3 slices live on the host
            assert run["partition_device"] == "cpu", f"{key}: {run}"
        if "adam" in key:
            assert run["optimizer"] == "DeepSpeedCPUAdam", f"{key}: {run}"


@pytest.mark.testdev
@pytest.mark.multiproc
@pytest.mark.parametrize("key", TESTDEV_RUNS.split(","))
def test_testdev_zero_losses_match_stock_deepspeed_on_cpu(testdev_run: dict[str, Any], runs: dict[str, Any],
                                                          key: str) -> None:
    """ZeRO stage/dtype (offload too) on the test device: per-step losses within the dtype's band of stock CPU."""
    got, ref = testdev_run["runs"][key]["losses"], runs["stock"]["runs"][key]["losses"]
    worst = assert_within(got, ref, key, "test device vs stock DeepSpeed on CPU")
    print(f"{key}: test device vs stock CPU, worst relative difference {worst:.3g}")


@pytest.mark.testdev
@pytest.mark.multiproc
def test_testdev_zero3_bf16_reduce_scatter_is_rewritten(testdev_run: dict[str, Any]) -> None:
    """ZeRO-3 bf16 reduce-scatters gradients in bf16, a declared testccl gap: the router upcasts (parity: above)."""
    rewrites = testdev_run["router_rewrites"]
    assert rewrites.get("reduce_scatter_tensor", {}).get("by", {}).get("upcast", 0) > 0, rewrites
