"""DeepSpeed started by the Hugging Face Trainer (``TrainingArguments(deepspeed=...)``) through the adaptor.

``examples/hf_trainer_deepspeed.py`` trains a tiny Llama (2 layers, hidden 64, one saved
checkpoint) for STEPS Trainer steps, ZeRO-2, ZeRO-3 and ZeRO-2 with the optimizer offloaded,
one Trainer after the other in one launch; each rank runs ``portspeed.cli.worker --adaptor
portspeed.deepspeed_adaptor`` (what every `portspeed run` worker runs), the script itself has
no portspeed line. Launches: the CPU run (2 ranks, checkpoints every SAVE_AT steps), its resume
from step SAVE_AT (2 fresh ranks), stock DeepSpeed (``DS_ACCELERATOR=cpu``, no adaptor), and
the test device (2 ranks, marker ``testdev``).

The reference is stock DeepSpeed on **one** process with the 2 ranks' global batch, not on 2
ranks: Accelerate (1.15) finds no process-group backend for a DeepSpeed rank on a device it
does not know (CPU without ``use_cpu``, any out-of-tree device), then counts one process and
feeds every rank the same batches, so stock 2-rank CPU runs are not data parallel. The
adaptor's ``accelerate.state.*`` patches give Accelerate DeepSpeed's own answers (the
adapter's backend and device), so 2 ranks split the data as on CUDA; with Accelerate's
batch sharding, one process with a batch of 4 sees the same samples per step as 2 ranks
with 2 each.

Tolerances, per-step loss, relative: 2 ranks vs 1 process: 1e-5 (fp32; the gradient sums
reordered, ~1e-7 observed; the unsharded stock 2-rank run differs by 8e-4 at step 2, 1e-2 at step 3).
Resume vs the uninterrupted run, and the test device (torch's CPU kernels, testccl stages
through Gloo) vs the CPU run: the same bound, 0 is what is observed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.requires import require

deepspeed = require("deepspeed", "pip install 'portspeed[deepspeed]'")
require("transformers", "pip install -e '.[test]'")
require("accelerate", "pip install -e '.[test]'")

from portspeed.parity.losslog import read_record  # noqa: E402
from portspeed.testing import run_ranks  # noqa: E402

pytestmark = [pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "hf_trainer_deepspeed.py")
RUNS = ["2", "3", "2:offload"]
STEPS, SAVE_AT = 5, 3
TOL = 1e-5
#: DeepSpeed's host ops (stock CPU's shm comm), built by `make ds-ops` into the venv
DS_OPS_DIR = Path(sys.prefix) / "torch_extensions"
TIMEOUT = 420.0
ADAPTOR = ["-m", "portspeed.cli.worker", "--adaptor", "portspeed.deepspeed_adaptor", "--"]


def _env(**extra: str) -> dict[str, str]:
    """This environment without portspeed's, DeepSpeed's and Accelerate's choices; offline, one thread."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PORTSPEED_", "DS_ACCELERATOR", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(DS_OPS_DIR), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


def _file(key: str) -> str:
    return key.replace(":", "_") + ".json"


def _launch(tmp: Path, name: str, world: int, model: Path, *args: str, adaptor: bool = True,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """Train every RUNS item on ``world`` ranks; the loss records by run (fail with every rank's output)."""
    out = tmp / name
    argv = [*(ADAPTOR if adaptor else []), EXAMPLE, "--model", str(model), "--runs", ",".join(RUNS),
            "--steps", str(STEPS), "--out", str(out), *args]
    results = run_ranks(argv, world, timeout=TIMEOUT, env=env or _env())
    if any(r.returncode != 0 for r in results) or not all((out / _file(k)).exists() for k in RUNS):
        msg = "\n".join(f"--- rank {r.rank} rc={r.returncode}\n{r.stderr[-5000:]}" for r in results)
        pytest.fail(f"{name}: the Trainer run failed\n{msg}")
    return {k: read_record(out / _file(k)) for k in RUNS}


def _losses(record: Any) -> list[float]:
    return [it.lm_loss for it in record.iterations]


def _assert_close(got: list[float], ref: list[float], what: str) -> None:
    assert len(got) == len(ref) and got, f"{what}: {got} vs {ref}"
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= TOL, f"{what}: worst relative difference {worst:.3g} > {TOL} ({got} vs {ref})"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama every run starts from, saved once."""
    path = tmp_path_factory.mktemp("hf_llama") / "llama"
    proc = subprocess.run([sys.executable, EXAMPLE, "--init-model", str(path)], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return path


@pytest.fixture(scope="module")
def cpu(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 CPU ranks through the adaptor (saving checkpoints), the resume from step SAVE_AT, stock on 1 process."""
    tmp = tmp_path_factory.mktemp("hf_cpu")
    trainer_dir = str(tmp / "trainer")
    ported = _launch(tmp, "ported", 2, model, "--output-dir", trainer_dir, "--save-at", str(SAVE_AT))
    resumed = _launch(tmp, "resumed", 2, model, "--output-dir", trainer_dir, "--resume-at", str(SAVE_AT))
    stock = _launch(tmp, "stock", 1, model, "--output-dir", str(tmp / "stock"), "--batch", "4", adaptor=False,
                    env=_env(DS_ACCELERATOR="cpu"))
    return {"ported": ported, "resumed": resumed, "stock": stock}


@pytest.mark.multiproc
def test_runs_used_what_they_claim(cpu: dict[str, Any]) -> None:
    """The ported runs were 2 data-parallel ranks on portspeed's accelerator with Accelerate's patches applied;
    stock was DeepSpeed's own CPU accelerator (else the comparison is vacuous)."""
    for key in RUNS:
        ported, stock = cpu["ported"][key].meta, cpu["stock"][key].meta
        assert ported["accelerator"] == "PortspeedCpuAccelerator" and stock["accelerator"] == "CPU_Accelerator"
        assert ported["ranks"] == 2 and ported["layout"]["dp"] == 2, key  # Accelerate counts both ranks
        assert stock["ranks"] == 1 and stock["layout"]["dp"] == 1, key
        assert ported["patches"] == {"accelerate.state.backend": "applied", "accelerate.state.device": "applied"}
        assert ported["batch_device"] == ported["param_device"] == "cpu", key
        losses = _losses(cpu["ported"][key])
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), key
        assert len(set(losses)) == STEPS, f"{key}: the loss does not change from step to step: {losses}"
        assert ported["zero"] == int(key[0]) and ported["offload"] is key.endswith("offload"), key


@pytest.mark.multiproc
@pytest.mark.parametrize("key", RUNS)
def test_trainer_zero_on_cpu_matches_stock_deepspeed(cpu: dict[str, Any], key: str) -> None:
    """ZeRO-2/3 (+ offload) from the Trainer, 2 ranks through the adaptor = stock DeepSpeed, same global batch."""
    _assert_close(_losses(cpu["ported"][key]), _losses(cpu["stock"][key]), f"{key} vs stock")


@pytest.mark.multiproc
@pytest.mark.parametrize("key", RUNS)
def test_trainer_checkpoint_resumes_identically(cpu: dict[str, Any], key: str) -> None:
    """The Trainer's checkpoint of step SAVE_AT, resumed by fresh ranks: the uninterrupted run's later losses."""
    resumed = cpu["resumed"][key]
    assert [it.iteration for it in resumed.iterations] == list(range(SAVE_AT + 1, STEPS + 1)), key
    _assert_close(_losses(resumed), _losses(cpu["ported"][key])[SAVE_AT:], f"{key} resumed")


@pytest.fixture(scope="module")
def testdev(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same runs on 2 ranks of portspeed's test device (a test device, not hardware)."""
    tmp = tmp_path_factory.mktemp("hf_testdev")
    return _launch(tmp, "testdev", 2, model, "--output-dir", str(tmp / "trainer"),
                   env=_env(PORTSPEED_ACCELERATOR="testdev"))


@pytest.mark.testdev
@pytest.mark.multiproc
@pytest.mark.parametrize("key", RUNS)
def test_testdev_trainer_zero_matches_the_cpu_run(testdev: dict[str, Any], cpu: dict[str, Any], key: str) -> None:
    """On the test device the Trainer's batches and DeepSpeed's model are on the device, losses = the CPU run's."""
    meta = testdev[key].meta
    assert meta["accelerator"] == "PortspeedAccelerator" and meta["backend"] == "testccl", key
    assert meta["args_device"] == meta["batch_device"] == meta["param_device"] == "testdev:0", key
    assert meta["layout"]["dp"] == 2, key
    _assert_close(_losses(testdev[key]), _losses(cpu["ported"][key]), f"{key} on the test device vs CPU")
