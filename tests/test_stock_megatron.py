"""Stock Megatron-LM ``pretrain_gpt.py``, unedited, trains on CPU/Gloo through `portspeed run`.

Needs a Megatron-LM checkout (tag core_v0.16.1) in ``MEGATRON_LM_ROOT`` and the few packages
its training code imports (six, regex, pyyaml); skipped otherwise, with the reason.

One indexed dataset is made with the checkout's own ``tools/preprocess_data.py``
(NullTokenizer: no download), one TP1 process trains 3 iterations on it and saves a
checkpoint, and then every layout fine-tunes 10 iterations from that checkpoint
(``--load --finetune``): pipeline stages seed their initialisation differently, on GPU
too, so layouts are compared from shared weights. Each layout's per-iteration ``lm loss``
must match the single-process TP1 run within 1e-5 (fp32). The command line is the
example's (``examples/stock/pretrain_gpt_cpu.sh``): Megatron's defaults, including
``--distributed-backend nccl`` and its CUDA-kernel fusions, are left as a GPU user has them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portspeed.losslog import parse_megatron_log

pytestmark = [pytest.mark.stock, pytest.mark.multiproc, pytest.mark.megatron]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "stock" / "pretrain_gpt_cpu.sh"
DATASET = REPO / "examples" / "stock" / "make_indexed_dataset.sh"
TOLERANCE = 1e-5  # absolute, per iteration, fp32
ITERS = 10
RUN_TIMEOUT = 600  # seconds per launch: a hang fails the test instead of hanging CI
#: Megatron-LM's training code imports these at module level (not megatron-core's requirements)
TRAINING_IMPORTS = {"six": "six", "regex": "regex", "yaml": "pyyaml"}

#: name -> (processes, TP, PP); data parallelism is what is left
LAYOUTS = {
    "tp2": (2, 2, 1),
    "pp2": (2, 1, 2),
    "dp2": (2, 1, 1),
    "tp2pp2": (4, 2, 2),
}


def _skip_reason() -> str | None:
    root = os.environ.get("MEGATRON_LM_ROOT", "").strip()
    if not root:
        return "MEGATRON_LM_ROOT is not set; point it at a Megatron-LM checkout (tag core_v0.16.1)"
    base = Path(root)
    for needed in ("megatron/training/__init__.py", "pretrain_gpt.py", "tools/preprocess_data.py"):
        if not (base / needed).is_file():
            return f"MEGATRON_LM_ROOT={root} is not a Megatron-LM checkout: {needed} is missing"
    if importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed (pip install -e '.[megatron]')"
    missing = [pkg for mod, pkg in TRAINING_IMPORTS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        return f"Megatron-LM's training code imports packages that are not installed: pip install {' '.join(missing)}"
    for script in (EXAMPLE, DATASET):
        if not script.is_file():
            return f"{script} is missing"
    return None


_REASON = _skip_reason()
if _REASON:
    pytestmark.append(pytest.mark.skip(reason=_REASON))


def _env(nproc: int, tp: int, pp: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        NPROC=str(nproc), TP=str(tp), PP=str(pp), ITERS=str(ITERS),
        PORTSPEED=f"{sys.executable} -m portspeed.cli",
    )
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> str:
    with open(log, "w") as out:
        res = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT)
    text = log.read_text()
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}; log {log}:\n{text[-4000:]}"
    return text


def _train(work: Path, name: str, nproc: int, tp: int, pp: int, data: str, *extra: str) -> str:
    env = _env(nproc, tp, pp) | {"DATA_PATH": data}
    return _run(["bash", str(EXAMPLE), *extra], env, work, work / f"{name}.log")


def _losses(text: str, name: str) -> dict[int, float]:
    record = parse_megatron_log(text, source=name)
    return {it: rec.lm_loss for it, rec in record.by_iteration().items()}


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Dataset, shared checkpoint, and the single-process TP1 baseline (built once for the module)."""
    work = tmp_path_factory.mktemp("stock")
    _run(["bash", str(DATASET), str(work)], _env(1, 1, 1) | {"PYTHON": sys.executable}, work,
         work / "preprocess.log")
    data = work / "docs_text_document"
    assert data.with_suffix(".bin").is_file() and data.with_suffix(".idx").is_file()

    ckpt = work / "ckpt"
    save_env = _env(1, 1, 1) | {"ITERS": "3", "DATA_PATH": str(data)}
    _run(["bash", str(EXAMPLE), "--save", str(ckpt), "--save-interval", "3"], save_env, work, work / "save.log")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    finetune = ("--load", str(ckpt), "--finetune")
    baseline_log = _train(work, "tp1", 1, 1, 1, str(data), *finetune)
    baseline = _losses(baseline_log, "tp1")
    return {"work": work, "data": str(data), "finetune": finetune, "baseline": baseline,
            "baseline_log": baseline_log}


def test_single_process_baseline_trains_from_the_checkpoint(stock: dict) -> None:
    """TP1 runs all iterations on the indexed dataset, learns, and says once which kernels fell back."""
    losses = stock["baseline"]
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert all(v is not None and 0 < v < 20 for v in losses.values())
    assert losses[ITERS] < losses[1], f"loss did not decrease over {ITERS} iterations: {losses}"
    log = stock["baseline_log"]
    for feature in ("persist_layer_norm", "gradient_accumulation_fusion", "masked_softmax_fusion"):
        assert log.count(f"portspeed: {feature} needs") == 1, f"expected one fallback line for {feature}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process_loss(stock: dict, layout: str) -> None:
    """Per-iteration lm loss of TP/PP/DP layouts equals the TP1 run within 1e-5 (fp32, shared weights)."""
    nproc, tp, pp = LAYOUTS[layout]
    text = _train(stock["work"], layout, nproc, tp, pp, stock["data"], *stock["finetune"])
    assert "distributed_backend ............................. nccl" in text, "Megatron's default backend was changed"
    losses = _losses(text, layout)
    base = stock["baseline"]
    assert sorted(losses) == sorted(base)
    deltas = {it: abs(losses[it] - base[it]) for it in base}
    worst = max(deltas, key=deltas.get)
    assert deltas[worst] <= TOLERANCE, (
        f"{layout}: iteration {worst} lm loss {losses[worst]} vs TP1 {base[worst]} (|d|={deltas[worst]:.2e})"
    )
