"""DeepSpeed on the portspeed adapter: the injected accelerator, backend routing, ZeRO 0-3 parity.

Multi-rank runs start real processes (``portspeed.testing.run_ranks``: 127.0.0.1, a free
port, a hard timeout) of ``examples/deepspeed_train.py``; checks that import DeepSpeed
with the adaptor run in a child interpreter, so the patches never leak into this one.

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
import textwrap
from pathlib import Path
from typing import Any

import pytest

from helpers.launch import child_json, run_snippet
from helpers.requires import require

deepspeed = require("deepspeed", "pip install 'portspeed[deepspeed]'")

import torch  # noqa: E402

from portspeed.testing import run_ranks  # noqa: E402

pytestmark = [pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "deepspeed_train.py")
_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

ALL_RUNS = "0:fp32,1:fp32,2:fp32,3:fp32,0:bf16,1:bf16,2:bf16,3:bf16"
#: ZeRO-Offload runs with the client SGD (optimizer state and step on the host), only in the stock and test-device runs
OFFLOAD_RUNS = "2:fp32:offload,3:fp32:offload"
#: ZeRO-Offload with DeepSpeed's Adam, i.e. its CPU Adam op (built by `make ds-ops`), and ZeRO-3 parameter offload
ADAM_OFFLOAD_RUNS = "2:fp32:offload+adam,3:fp32:offload+adam,3:fp32:offload_param+adam"
#: fp16 with dynamic loss scaling (client SGD); stock DeepSpeed refuses fp16 on its CPU accelerator
FP16_RUNS = "0:fp16,2:fp16"
#: the same with step OVERFLOW_AT's scaled gradients made to overflow
OVERFLOW_RUNS = "0:fp16:overflow,2:fp16:overflow"
OVERFLOW_AT = 2
#: What runs on the test device in CI (3:bf16 meets a testccl gap the router rewrites), compared with stock CPU
TESTDEV_RUNS = "1:fp32,2:fp32,3:fp32,1:bf16,2:bf16,3:bf16," + OFFLOAD_RUNS + "," + ADAM_OFFLOAD_RUNS
#: ... and the fp16 runs there, compared with the CPU adapter's (stock DeepSpeed refuses fp16 on CPU)
TESTDEV_FP16_RUNS = FP16_RUNS + "," + OVERFLOW_RUNS
STEPS, SAVE_AT = 6, 3
TOL = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 1e-3}
#: DeepSpeed's host ops, JIT-built once by `make ds-ops` into this cache inside the venv (every child gets it)
DS_OPS_DIR = Path(sys.prefix) / "torch_extensions"
TIMEOUT = 300.0


#: what a child must not inherit: this run's portspeed settings and DeepSpeed's own accelerator choice
CLEAN = ("PORTSPEED_*", "DS_ACCELERATOR*")


def _clean_env(**extra: str) -> dict[str, str]:
    """The whole environment for ``run_ranks`` (it takes one as is): this one without ``CLEAN``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PORTSPEED_", "DS_ACCELERATOR"))}
    env.update(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(DS_OPS_DIR), **extra)
    return env


def _train(tmp: Path, name: str, world: int, *args: str, env: dict[str, str] | None = None,
           pre: str | None = None) -> dict[str, Any]:
    """Run the example on ``world`` ranks; return rank 0's JSON record (fail with every rank's output)."""
    out = tmp / f"{name}.json"
    argv = [EXAMPLE, "--runs", ALL_RUNS, "--steps", str(STEPS), "--out", str(out), *args]
    if pre is not None:  # code to run first in each rank (e.g. select the stand-in adapter)
        argv = ["-c", pre + "\nimport runpy, sys\nsys.argv = sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')", *argv]
    results = run_ranks(argv, world, timeout=TIMEOUT, env=env or _clean_env())
    failed = [r for r in results if r.returncode != 0]
    if failed or not out.exists():
        msg = "\n".join(f"--- rank {r.rank} rc={r.returncode}\n{_tail(r.stderr)}" for r in results)
        pytest.fail(f"{name}: the training run failed\n{msg}")
    return json.loads(out.read_text())


def _tail(stderr: str, chars: int = 6000) -> str:
    """The end of a rank's stderr without the FutureWarning noise of deprecated collectives."""
    lines = [ln for ln in stderr.splitlines()
             if "FutureWarning" not in ln and ln.strip() != "return func(*args, **kwargs)"]
    return "\n".join(lines)[-chars:]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


#: the adapters a case runs on: the CPU adapter, and portspeed's test device (a test device, not hardware)
ADAPTERS = ["cpu", pytest.param("testdev", marks=pytest.mark.testdev)]


def _on(adapter: str, runs: dict[str, Any], request: pytest.FixtureRequest) -> dict[str, Any]:
    """The 2-rank record of ``adapter``: the CPU run, or the test device's (fixture ``testdev_run``, only then)."""
    return runs["ported"] if adapter == "cpu" else request.getfixturevalue("testdev_run")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The ported 2-rank run (saving checkpoints), the stock run, the 1-process run, the resumed run."""
    tmp = tmp_path_factory.mktemp("ds_runs")
    ckpt = tmp / "ckpt"
    ported = _train(tmp, "ported", 2, "--save-dir", str(ckpt), "--save-at", str(SAVE_AT), "--dist-backend", "nccl",
                    "--runs", f"{ALL_RUNS},{ADAM_OFFLOAD_RUNS},{FP16_RUNS},{OVERFLOW_RUNS}",
                    "--overflow-at", str(OVERFLOW_AT))
    stock = _train(tmp, "stock", 2, "--no-portspeed", "--runs", f"{ALL_RUNS},{OFFLOAD_RUNS},{ADAM_OFFLOAD_RUNS}",
                   env=_clean_env(DS_ACCELERATOR="cpu"))
    single = _train(tmp, "single", 1, "--runs", f"{ALL_RUNS},{ADAM_OFFLOAD_RUNS},{FP16_RUNS}")
    resumed = _train(tmp, "resumed", 2, "--resume-from", str(ckpt), "--save-at", str(SAVE_AT),
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
    worst = max(_rel(a, b) for a, b in zip(two, one))
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
    worst = _assert_within(run["losses"], runs["single"]["runs"][key]["losses"], key, "2 ranks vs 1 process")
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
    _assert_within(zero2["losses"], zero0["losses"], "2:fp16", "ZeRO-2 vs ZeRO-0")
    for key in ("0:fp16", "2:fp16"):
        _assert_within(rec["runs"][key]["losses"], runs["single"]["runs"][key]["losses"], key,
                       "2 ranks vs 1 process")
        assert rec["runs"][key]["fp16"]["skipped"] == [0] * STEPS  # no overflow at scale 2**16 here
        if adapter != "cpu":
            worst = _assert_within(rec["runs"][key]["losses"], runs["ported"]["runs"][key]["losses"], key,
                                   "test device vs the CPU run")
            print(f"{key}: test device vs CPU, worst relative difference {worst:.3g}")
    # and it trains: within 1e-3 of the fp32 run (an update 2**16 times too small stays at the start)
    _assert_within(zero2["losses"], rec["runs"]["2:fp32"]["losses"], "2:fp16", "fp16 vs fp32")


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
    _assert_within(got["losses"], other, f"{stage}:fp16", "overflow run, ZeRO-0 vs ZeRO-2")
    if adapter != "cpu":
        cpu = runs["ported"]["runs"][f"{stage}:fp16:overflow"]
        assert (fp16["skipped"], fp16["scale"]) == (cpu["fp16"]["skipped"], cpu["fp16"]["scale"])
        worst = _assert_within(got["losses"], cpu["losses"], f"{stage}:fp16", "overflow run, test device vs CPU")
        print(f"{stage}:fp16:overflow: test device vs CPU, worst relative difference {worst:.3g}")


# ---------------------------------------------------------------------- MPI discovery
def _mpirun(tmp_path: Path, keys: str, **env_extra: str) -> dict[str, Any]:
    """``mpirun -np 2`` of the example with no launcher variables (DeepSpeed's MPI discovery); rank 0's record."""
    import shutil
    import subprocess

    mpirun = shutil.which("mpirun")
    assert mpirun, "Open MPI's mpirun is missing: `make sysdeps` (apt-get install -y openmpi-bin libopenmpi-dev)"
    env = {k: v for k, v in _clean_env(**env_extra).items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONWARNINGS="ignore", PORTSPEED_TIMEOUT="120")
    out = tmp_path / "mpi.json"
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    from helpers.launch import free_port

    cmd = [mpirun, "-np", "2", *root, "--oversubscribe", "--bind-to", "none", sys.executable, EXAMPLE,
           "--runs", keys, "--steps", str(STEPS), "--dist-backend", "nccl", "--dist-port", str(free_port()),
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, start_new_session=True)
    assert proc.returncode == 0 and out.exists(), f"mpirun failed ({proc.returncode}):\n{_tail(proc.stderr)}"
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
            worst = _assert_within(got["losses"], ref["losses"], key, "mpirun on the test device vs CPU torchrun")
            print(f"{key}: mpirun on the test device vs CPU torchrun, worst relative difference {worst:.3g}")


@pytest.mark.multiproc
def test_nccl_request_runs_on_standin_backend_and_matches_gloo(runs: dict[str, Any], tmp_path: Path) -> None:
    """ZeRO-2 asked for 'nccl' runs on the stand-in vendor backend, not Gloo, and matches Gloo's losses (fp32, bf16)."""
    pre = ("import portspeed, portspeed.testing.standin_ccl as standin\n"
           "portspeed.set_accelerator(standin.StandinAccelerator())")
    rec = _train(tmp_path, "standin", 2, "--runs", "2:fp32,2:bf16", "--dist-backend", "nccl", pre=pre)
    assert rec["real_backend"] == "standin"
    assert rec["backend"] == "nccl"  # what the script asked for, reported back (router's two-way names)
    assert {"requested": "nccl", "used": "standin", "how": "mapped by portspeed.comm.router at init_process_group"} \
        in rec["routes"]
    for key in ("2:fp32", "2:bf16"):
        got, ref = rec["runs"][key]["losses"], runs["ported"]["runs"][key]["losses"]
        worst = max(_rel(a, b) for a, b in zip(got, ref))
        tol = TOL[key.split(":")[1]]
        assert worst <= tol, f"{key} stand-in vs Gloo: {worst:.3g} > {tol} ({got} vs {ref})"


@pytest.mark.multiproc
def test_megatron_deepspeed_style_run_matches(runs: dict[str, Any], tmp_path: Path) -> None:
    """Both adaptors, Megatron-Core's parallel state as DeepSpeed's mpu: same losses as DeepSpeed alone, bit for bit."""
    require("megatron.core", "pip install 'portspeed[megatron]'")
    keys = "2:bf16,3:fp32"
    rec = _train(tmp_path, "megatron_ds", 2, "--runs", keys, "--megatron")
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
TESTDEV = {"PORTSPEED_ACCELERATOR": "testdev"}


def _assert_within(got: list[float], ref: list[float], key: str, what: str, steps: int = STEPS) -> float:
    tol = TOL[key.split(":")[1]]
    assert len(got) == len(ref) == steps, f"{key} {what}: {got} vs {ref}"
    worst = max(_rel(a, b) for a, b in zip(got, ref))
    assert worst <= tol, f"{key} {what}: worst relative difference {worst:.3g} > {tol} ({got} vs {ref})"
    return worst


@pytest.fixture(scope="module")
def testdev_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ZeRO 1-3 (fp32, bf16, offload) and fp16 (ZeRO-0/2, an overflow) on 2 test-device ranks through the adaptor."""
    tmp = tmp_path_factory.mktemp("ds_testdev")
    record = _train(tmp, "testdev", 2, "--save-dir", str(tmp / "ckpt"), "--save-at", str(SAVE_AT), "--runs",
                    f"{TESTDEV_RUNS},{TESTDEV_FP16_RUNS}", "--overflow-at", str(OVERFLOW_AT), env=_clean_env(**TESTDEV))
    return {**record, "ckpt": tmp / "ckpt"}


#: the test-device cases resumed from their own checkpoint: offload (a real device -> host move) and fp16
TESTDEV_RESUME_RUNS = OFFLOAD_RUNS + "," + ADAM_OFFLOAD_RUNS + "," + FP16_RUNS


@pytest.fixture(scope="module")
def testdev_resumed(testdev_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Fresh test-device processes load the checkpoints ``testdev_run`` saved after step 3 and train on."""
    tmp = tmp_path_factory.mktemp("ds_testdev_resumed")
    assert testdev_run["ckpt"].is_dir(), f"the test-device run saved no checkpoint folder {testdev_run['ckpt']}"
    return _train(tmp, "testdev_resumed", 2, "--resume-from", str(testdev_run["ckpt"]), "--save-at",
                  str(SAVE_AT), "--runs", TESTDEV_RESUME_RUNS, env=_clean_env(**TESTDEV))


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
    worst = _assert_within(got, ref, key, "test device vs stock DeepSpeed on CPU")
    print(f"{key}: test device vs stock CPU, worst relative difference {worst:.3g}")


@pytest.mark.testdev
@pytest.mark.multiproc
def test_testdev_zero3_bf16_reduce_scatter_is_rewritten(testdev_run: dict[str, Any]) -> None:
    """ZeRO-3 bf16 reduce-scatters gradients in bf16, a declared testccl gap: the router upcasts (parity: above)."""
    rewrites = testdev_run["router_rewrites"]
    assert rewrites.get("reduce_scatter_tensor", {}).get("by", {}).get("upcast", 0) > 0, rewrites


@pytest.mark.testdev
def test_testdev_offers_deepspeeds_host_op_builders_only() -> None:
    """On the test device DeepSpeed gets its host builders (CPU Adam, async I/O...), a clear error for device ops."""
    got = child_json("""
        import json, torch
        import portspeed.deepspeed_adaptor, deepspeed
        import deepspeed.ops.op_builder as ob
        import deepspeed.ops.op_builder.cpu as host
        from deepspeed.accelerator import get_accelerator
        from portspeed.errors import PortspeedError
        acc = get_accelerator()
        try:
            ob.FusedAdamBuilder().load()
            fused = "loaded"
        except PortspeedError as e:
            fused = str(e)
        free, total = torch.testdev.mem_get_info(0)
        print(json.dumps({
            "cls": type(acc).__name__, "device": acc.current_device_name(),
            "host_same": {n: issubclass(getattr(ob, n), getattr(host, n)) for n in
                          ("CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "AsyncIOBuilder",
                           "PinMemoryBuilder")},
            "cpu_adam_compatible": ob.CPUAdamBuilder().is_compatible(),
            "create_host": type(acc.create_op_builder("CPUAdamBuilder")).__module__,
            "create_device": [acc.create_op_builder(n) is None for n in ("FusedAdamBuilder", "ShareMemCommBuilder")],
            "fused_compatible": ob.FusedAdamBuilder().is_compatible(), "fused": fused,
            "memory": [acc.total_memory(0), acc.available_memory(0), total, free],
        }))
    """, timeout=TIMEOUT, env=TESTDEV, drop=CLEAN)
    assert got["cls"] == "PortspeedAccelerator" and got["device"] == "testdev:0"
    assert all(got["host_same"].values()), got["host_same"]  # stock: None, so CPUAdamBuilder() raised TypeError
    assert got["cpu_adam_compatible"] is True
    assert got["create_host"] == "deepspeed.ops.op_builder.cpu.cpu_adam"
    assert got["create_device"] == [True, True]
    assert got["fused_compatible"] is False
    assert "FusedAdamBuilder" in got["fused"] and "'testdev'" in got["fused"] and "torch_adam" in got["fused"]
    total, avail, dev_total, dev_free = got["memory"]
    assert (total, avail) == (dev_total, dev_free) and 0 < avail <= total


def test_async_io_without_libaio_says_what_to_install() -> None:
    """Where libaio is missing (a FAKE absence: DeepSpeed's probe answers no), loading the op names libaio-dev."""
    got = child_json("""
        import json
        import portspeed.deepspeed_adaptor, deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.ops.op_builder.cpu import async_io
        async_io.AsyncIOBuilder.has_function = lambda self, *a, **k: False  # FAKE: no libaio here
        try:
            AsyncIOBuilder().load()
            load = "loaded"
        except Exception as e:
            load = f"{type(e).__name__}: {e}"
        from portspeed.integrations.ds_build import missing_prerequisite
        print(json.dumps({"load": load, "build": missing_prerequisite("async_io")}))
    """, timeout=TIMEOUT, env={"TORCH_EXTENSIONS_DIR": str(DS_OPS_DIR)}, drop=CLEAN)
    assert got["load"].startswith("PortspeedError") and "apt-get install -y libaio-dev" in got["load"], got
    assert "libaio-dev" in got["build"], got


# ---------------------------------------------------------------------- single-process checks in a child
# (child_json: a fresh interpreter without CLEAN's variables; it prints one JSON line last, which is returned)
_PROBE = """
    import json, torch, portspeed
    from deepspeed.accelerator import get_accelerator
    import deepspeed.runtime.engine as engine
    acc = get_accelerator()
    print(json.dumps({
        "deepspeed_before_adaptor": DS_BEFORE,
        "cls": type(acc).__name__,
        "engine_sees_same": engine.get_accelerator() is acc,
        "device": str(acc.device()), "device_is_torch_device": isinstance(acc.device(), torch.device),
        "current_device": acc.current_device(), "current_device_type": type(acc.current_device()).__name__,
        "fp16": acc.is_fp16_supported(), "backend": acc.communication_backend_name(),
        "adapter_backend": portspeed.get_accelerator().communication_backend,
        "backed_by_adapter": acc.adapter is portspeed.get_accelerator(),
        "shm_builder": acc.create_op_builder("ShareMemCommBuilder") is None,
    }))
"""


@pytest.mark.parametrize("order", ["adaptor_first", "deepspeed_first"])
def test_deepspeed_gets_adapter_backed_accelerator(order: str) -> None:
    """Either import order: DeepSpeed's get_accelerator() is the adapter-backed object, CPU quirks fixed."""
    imports = ("import sys, portspeed.deepspeed_adaptor\nDS_BEFORE = 'deepspeed' in sys.modules\nimport deepspeed\n"
               if order == "adaptor_first" else
               "import sys, deepspeed\nDS_BEFORE = True\nimport portspeed.deepspeed_adaptor\n")
    got = child_json(imports + textwrap.dedent(_PROBE), timeout=TIMEOUT, env={"LOCAL_RANK": "1"}, drop=CLEAN)
    assert got["deepspeed_before_adaptor"] is (order == "deepspeed_first")
    assert got["cls"] == "PortspeedCpuAccelerator" and got["backed_by_adapter"] and got["engine_sees_same"]
    assert got["device_is_torch_device"] and got["device"] == "cpu"  # stock: None
    assert got["current_device_type"] == "int"  # stock: the LOCAL_RANK string
    assert isinstance(got["fp16"], bool)  # stock: None when mkldnn lacks fp16
    assert got["backend"] == got["adapter_backend"] == "gloo"
    assert got["shm_builder"], "DeepSpeed's shared-memory comm kernel would bypass the routed backend"


def test_importing_the_adaptor_does_not_import_deepspeed() -> None:
    """`import portspeed.deepspeed_adaptor` leaves DeepSpeed unimported (its hook waits for DeepSpeed's import)."""
    got = child_json("""
        import sys, json, portspeed.deepspeed_adaptor, portspeed
        print(json.dumps({"ds": "deepspeed" in sys.modules,
                          "status": {r["name"]: r["status"] for r in portspeed.report()}}))
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["ds"] is False
    assert got["status"]["deepspeed.comm.init_distributed.backend"] == "pending"


def test_ds_accelerator_env_contradiction_raises() -> None:
    """DS_ACCELERATOR naming another device than the adapter's fails `import deepspeed` with a ConfigError."""
    proc = run_snippet("import portspeed.deepspeed_adaptor, deepspeed", timeout=TIMEOUT,
                       env={"DS_ACCELERATOR": "cuda"}, drop=CLEAN)
    assert proc.returncode != 0
    assert "DS_ACCELERATOR='cuda'" in proc.stderr and "PORTSPEED_ACCELERATOR" in proc.stderr


def test_mpi_discovery_still_runs_and_nccl_is_routed() -> None:
    """Without launcher variables DeepSpeed still runs its MPI discovery (here a FAKE one), then 'nccl' becomes Gloo."""
    got = child_json("""
        import json, os, socket
        import portspeed.deepspeed_adaptor, portspeed, deepspeed
        import deepspeed.comm.comm as ds_comm
        import torch.distributed as dist
        from portspeed.comm import router
        calls = []
        def fake_mpi_discovery(distributed_port=29500, verbose=True):  # FAKE: no mpi4py here
            s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            calls.append(distributed_port)
        ds_comm.mpi_discovery = fake_mpi_discovery
        deepspeed.init_distributed(dist_backend="nccl", distributed_port=12345)
        rec = {r["name"]: r for r in portspeed.report()}
        print(json.dumps({"calls": calls, "real": router.real_backend(), "asked": dist.get_backend(),
                          "detail": rec["deepspeed.comm.init_distributed.backend"]["detail"]}))
        dist.destroy_process_group()
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["calls"] == [12345]
    assert got["real"] == "gloo" and got["asked"] == "nccl"
    assert "'nccl' -> 'gloo'" in got["detail"]


def test_nccl_is_mapped_by_the_deepspeed_patch_when_router_patches_are_disabled() -> None:
    """With the router's torch.distributed patches disabled, the DeepSpeed patch maps 'nccl' itself."""
    got = child_json("""
        import json, os, socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import portspeed.deepspeed_adaptor, portspeed, deepspeed
        import torch.distributed as dist
        deepspeed.init_distributed(dist_backend="nccl")
        rec = {r["name"]: r for r in portspeed.report()}
        print(json.dumps({"backend": dist.get_backend(),
                          "router": rec["torch.distributed.init_process_group.backend"]["status"],
                          "detail": rec["deepspeed.comm.init_distributed.backend"]["detail"]}))
        dist.destroy_process_group()
    """, timeout=TIMEOUT, env={"PORTSPEED_DISABLE": "torch.distributed.*"}, drop=CLEAN)
    assert got["router"] == "disabled"
    assert got["backend"] == "gloo"
    assert "'nccl' -> 'gloo' (mapped here" in got["detail"]


def test_both_adaptors_apply_once_and_revert_restores_everything() -> None:
    """Both adaptors in one process: every patch once, both sets reported, revert restores everything."""
    got = child_json("""
        import json, importlib, sys
        import torch.distributed, megatron.core, deepspeed
        from deepspeed.accelerator import real_accelerator
        from portspeed.patches import torch_cuda, torch_distributed, deepspeed as ds_patches
        from portspeed.patches.megatron import all_patches
        from portspeed.patching.targets import resolve_target as _resolve

        declared = torch_cuda.PATCHES + torch_distributed.PATCHES + ds_patches.PATCHES + all_patches()
        def current(target):
            mod, _, path = target.partition(":")
            if mod not in sys.modules:
                return None
            try:
                owner, attr = _resolve(sys.modules[mod], tuple(path.split(".")))
            except AttributeError:
                return None
            if hasattr(owner, "__dict__"):
                return owner.__dict__.get(attr, getattr(owner, attr))
            return getattr(owner, attr)
        before = {p.target: current(p.target) for p in declared}
        slot_before = real_accelerator.ds_accelerator

        import portspeed, portspeed.megatron_adaptor, portspeed.deepspeed_adaptor
        portspeed.deepspeed_adaptor.activate(); portspeed.megatron_adaptor.activate()  # again: no-ops
        mgr = portspeed.manager()
        report = portspeed.report()
        names = [r["name"] for r in report]
        applied = [r for r in report if r["status"] == "applied"]
        chains = {t: mgr.chain(t) for t in {r["target"] for r in applied}}
        dup_chains = {t: c for t, c in chains.items() if len(c) != len(set(c))}
        wrappers_per_target = {}
        for r in applied:
            wrappers_per_target.setdefault(r["target"], []).append(r["name"])
        chain_mismatch = {t: (chains[t], ns) for t, ns in wrappers_per_target.items()
                          if sorted(c.split(" ")[1] for c in chains[t][1:] if c.startswith("wrapper"))
                          != sorted(n for n in ns if next(x for x in report if x["name"] == n)["kind"] == "wrap")}
        slot_target = "deepspeed.accelerator.real_accelerator:ds_accelerator"
        unsnapshotted = sorted({r["target"] for r in applied} - set(before) - {slot_target})
        slot_patched = type(real_accelerator.ds_accelerator).__name__
        changed = sorted(t for t in before if before[t] is not None and current(t) is not before[t])

        mgr.revert()
        after = {t: current(t) for t in before}
        not_restored = sorted(t for t in before if before[t] is not None and after[t] is not before[t])
        print(json.dumps({
            "n": len(names), "unique": len(set(names)),
            "megatron": sum(n.startswith("megatron") for n in names),
            "deepspeed": sorted(n for n in names if n.startswith("deepspeed")),
            "router": sum(n.startswith("torch.distributed") for n in names),
            "dup_chains": dup_chains, "chain_mismatch": {k: str(v) for k, v in chain_mismatch.items()},
            "slot_patched": slot_patched, "changed": len(changed),
            "slot_after": type(real_accelerator.ds_accelerator).__name__,
            "slot_before": type(slot_before).__name__,
            "not_restored": not_restored, "unsnapshotted": unsnapshotted,
            "statuses_after": sorted({r["status"] for r in portspeed.report()}),
            "reapplied": (portspeed.deepspeed_adaptor.activate(),
                          type(real_accelerator.ds_accelerator).__name__)[1],
        }))
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["n"] == got["unique"]
    assert got["megatron"] > 0 and got["router"] > 0
    assert got["deepspeed"] == ["deepspeed.accelerator", "deepspeed.comm.init_distributed.backend"]
    assert got["dup_chains"] == {} and got["chain_mismatch"] == {}
    assert got["slot_patched"] == "PortspeedCpuAccelerator" and got["changed"] > 0
    assert got["slot_after"] == got["slot_before"] == "CPU_Accelerator"
    assert got["not_restored"] == []
    assert got["unsnapshotted"] == [], "patches applied that this test does not know to check"
    assert "applied" not in got["statuses_after"]
    assert got["reapplied"] == "PortspeedCpuAccelerator"


def test_cuda_adapter_leaves_deepspeed_its_own_accelerator() -> None:
    """On the CUDA adapter DeepSpeed keeps its own accelerator (its CUDA kernels): the patch is inactive, not failed."""
    got = child_json("""
        import json, portspeed
        from portspeed.adapters.cuda import CudaAccelerator
        portspeed.set_accelerator(CudaAccelerator())
        import portspeed.deepspeed_adaptor, deepspeed
        acc = deepspeed.accelerator.get_accelerator()
        rec = {r["name"]: r for r in portspeed.report()}
        print(json.dumps({"module": type(acc).__module__, "status": rec["deepspeed.accelerator"]["status"]}))
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["status"] == "inactive"
    assert got["module"].startswith("deepspeed.accelerator.")


def test_program_injected_accelerator_is_left_in_place() -> None:
    """An accelerator the program gave DeepSpeed's set_accelerator itself is an explicit choice: portspeed keeps it."""
    got = child_json("""
        import json
        from deepspeed.accelerator import set_accelerator, get_accelerator
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        class MyAccelerator(CPU_Accelerator):
            pass
        mine = MyAccelerator()
        set_accelerator(mine)
        import portspeed, portspeed.deepspeed_adaptor
        print(json.dumps({"kept": get_accelerator() is mine,
                          "names": [r["name"] for r in portspeed.report()]}))
    """, timeout=TIMEOUT, drop=CLEAN)
    assert got["kept"] is True
    assert "deepspeed.accelerator" not in got["names"]


# ---------------------------------------------------------------------- the accelerator object, in this process
def test_generic_accelerator_on_fake_xpu_delegates_to_adapter() -> None:
    """On a non-CPU adapter (FAKE xpu runtime) the DeepSpeed accelerator passes DeepSpeed's check and delegates."""
    from fakes import fake_torch_xpu

    from deepspeed.accelerator.real_accelerator import _validate_accelerator
    from portspeed.adapters.xpu import XpuAccelerator
    from portspeed.integrations.ds_accelerator import PortspeedAccelerator, build_ds_accelerator

    with fake_torch_xpu.installed(count=2) as state:
        adapter = XpuAccelerator()
        acc = build_ds_accelerator(adapter)
        _validate_accelerator(acc)
        assert isinstance(acc, PortspeedAccelerator)
        acc.set_device(1)
        assert acc.current_device() == 1 and acc.current_device_name() == "xpu:1"
        assert acc.device() == torch.device("xpu", 1) and acc.device_name(0) == "xpu:0"
        assert acc.device_count() == 2
        assert acc.communication_backend_name() == adapter.communication_backend
        assert not acc.is_synchronized_device()
        assert acc.create_op_builder("FusedAdamBuilder") is None
        from deepspeed.ops.op_builder.cpu import CPUAdamBuilder
        assert acc.get_op_builder("CPUAdamBuilder") is CPUAdamBuilder  # host work on every device
        before = acc.memory_allocated(1)
        state.fake_allocate(4096, 1)
        assert acc.memory_allocated(1) == before + 4096
        acc.manual_seed(7)
        assert acc.initial_seed() == 7


def test_build_rejects_non_adapter() -> None:
    """build_ds_accelerator names what it needs when given something else."""
    from portspeed.integrations.ds_accelerator import build_ds_accelerator

    with pytest.raises(TypeError, match="portspeed.get_accelerator"):
        build_ds_accelerator("cpu")  # type: ignore[arg-type]
