"""Stock Megatron-LM ``pretrain_gpt.py``, unedited, trains on CPU/Gloo through `portspeed run`.

Needs a Megatron-LM checkout (tag core_v0.16.1) in ``MEGATRON_LM_ROOT``; skipped otherwise,
with the reason. The packages its training code imports are the set-up's to install
(megatron-core: ``.[test]``/``.[megatron]``; six, regex, pyyaml: ``pip install -e '.[stock]'``,
which ``make test-stock`` runs): missing, they fail the test, naming what to install.

One indexed dataset is made with the checkout's own ``tools/preprocess_data.py``
(NullTokenizer: no download), one TP1 process trains 3 iterations on it and saves a
checkpoint, and then every layout fine-tunes 10 iterations from that checkpoint
(``--load --finetune``): pipeline stages seed their initialisation differently, on GPU
too, so layouts are compared from shared weights. Each layout's per-iteration ``lm loss``
must match the single-process TP1 run within 1e-5 (fp32). The command line is the
example's (``examples/stock/pretrain_gpt_cpu.sh``): Megatron's defaults, including
``--distributed-backend nccl`` and its CUDA-kernel fusions, are left as a GPU user has them.

A resumed run (TP2, dropout 0.1, mock data) is compared with an uninterrupted one: saved at
iteration 2 and resumed with ``--load``, its losses at the regular log windows equal the
uninterrupted run's within 1e-6; a control run with ``megatron.training.data_iterators_rng``
disabled must differ.

The first tests need no checkout (CI runs them): the megatron.training patches and import
finders against the installed megatron-core.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.launch import child_json
from helpers.requires import importable, require
from helpers.stock import checkout_skip_reason, require_stock_packages

from portspeed.parity.losslog import parse_megatron_log
from portspeed.patches.megatron import _training_common, training_arguments, training_compile_helpers

pytestmark = [pytest.mark.megatron]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "stock" / "pretrain_gpt_cpu.sh"
DATASET = REPO / "examples" / "stock" / "make_indexed_dataset.sh"
TOLERANCE = 1e-5  # absolute, per iteration, fp32
ITERS = 10
RUN_TIMEOUT = 600  # seconds per launch: a hang fails the test instead of hanging CI

#: name -> (processes, TP, PP); data parallelism is what is left
LAYOUTS = {
    "tp2": (2, 2, 1),
    "pp2": (2, 1, 2),
    "dp2": (2, 1, 1),
    "tp2pp2": (4, 2, 2),
}


#: a Megatron-LM checkout: what these tests run from MEGATRON_LM_ROOT
CHECKOUT_FILES = ("megatron/training/__init__.py", "pretrain_gpt.py", "tools/preprocess_data.py")
_NO_CHECKOUT = checkout_skip_reason(CHECKOUT_FILES)
needs_checkout = pytest.mark.skipif(_NO_CHECKOUT is not None, reason=_NO_CHECKOUT or "")


def _require_stock() -> None:
    """Fail, naming what to install or what is missing, when the checkout's runs cannot start."""
    require_stock_packages()
    for script in (EXAMPLE, DATASET):
        assert script.is_file(), f"{script} is missing from this repository"


# ---------------------------------------------------------------------- without a checkout
FINDERS_PROBE = textwrap.dedent(
    """
    import json, sys
    out = {}
    try:
        import megatron.core.transformer.custom_layers.batch_invariant_kernels
        out["without_finder"] = "imported"
    except ModuleNotFoundError as exc:
        out["without_finder"] = exc.name
    from portspeed.patches.megatron import training_imports as ti
    from portspeed.patching import finders
    finders.install(ti.BATCH_INVARIANT_FINDER, 'first')
    import megatron.core.transformer.custom_layers.batch_invariant_kernels as bik
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import enable_batch_invariant_mode
    out["standin"] = getattr(bik, "__portspeed_standin__", False)
    out["enabled"] = bik.is_batch_invariant_mode_enabled()
    try:
        enable_batch_invariant_mode()
        out["enable"] = "no error"
    except ti.BatchInvariantModeUnavailable as exc:
        out["enable"] = str(exc)
    spec = ti._HelpersFinder().find_spec(ti.HELPERS_CPP, None)
    out["helpers_origin"] = spec.origin if spec else None
    out["wheel_helpers"] = str(ti.wheel_helpers_path())
    ti._imported_core_version = lambda: "0.0.0"
    out["helpers_other_version"] = ti._HelpersFinder().find_spec(ti.HELPERS_CPP, None) is not None
    from portspeed.patches.megatron import training_compile_helpers as ch
    calls = []
    ch.skip_build_when_prebuilt(lambda: calls.append("make"), None, (), {})
    out["make_called"] = bool(calls)
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(importable("triton"), reason="triton is installed here, so Megatron's own module imports")
def test_import_finders_answer_what_cannot_import_off_cuda() -> None:
    """Without triton the batch-invariant module is a stand-in that refuses the mode; helpers come from the wheel."""
    require("megatron.core", "pip install -e '.[megatron]'")
    out = child_json(FINDERS_PROBE, timeout=300, env={"PORTSPEED_ACCELERATOR": "cpu"})
    assert out["without_finder"] == "triton", "the module imported without triton: the finder is not needed"
    assert out["standin"] is True and out["enabled"] is False
    assert "drop --batch-invariant-mode" in out["enable"]
    assert out["wheel_helpers"] != "None" and out["helpers_origin"] == out["wheel_helpers"]
    assert out["helpers_other_version"] is False, "prebuilt helpers were offered to another megatron-core version"
    assert out["make_called"] is False, "compile_helpers ran make although the extension is importable"


def _megatron_args(**kw: object) -> argparse.Namespace:
    base = dict(tensor_model_parallel_size=1, context_parallel_size=1, no_persist_layer_norm=False,
                gradient_accumulation_fusion=True, masked_softmax_fusion=True, rank=0)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture()
def fresh_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_training_common, "_said", set())
    # setenv first so that undo restores the variable's original state, whatever the test sets
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "placeholder")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.setenv("RANK", "0")


@pytest.mark.skipif(any(importable(m) for m in ("apex", "fused_weight_gradient_mlp_cuda",
                                                 "scaled_masked_softmax_cuda")),
                    reason="a CUDA kernel module is installed here, so its option would not fall back")
def test_cuda_kernel_defaults_fall_back_with_one_line_each(fresh_logs: None, caplog: pytest.LogCaptureFixture) -> None:
    """Megatron's default fusions are turned off after validation when their kernels are absent, one log line each."""
    seen = []
    caplog.set_level(logging.WARNING, logger="portspeed.megatron")
    for _ in range(2):  # a second validation (Megatron validates yaml and args paths) logs nothing new
        args = _megatron_args()
        training_arguments.fall_back_to_torch_paths(lambda a, d: seen.append(vars(a).copy()), None, (args, {}), {})
        assert args.no_persist_layer_norm is True
        assert args.gradient_accumulation_fusion is False and args.masked_softmax_fusion is False
    assert seen[0]["gradient_accumulation_fusion"] is True, "options must be changed after Megatron validated them"
    lines = [r.getMessage() for r in caplog.records]
    for flag in ("--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"):
        assert sum(flag in line for line in lines) == 1, lines


def test_tensor_parallel_gets_one_launch_queue_unless_set_or_fsdp(fresh_logs: None) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 is set before Megatron asserts it, for TP/CP without FSDP only, never overriding.
    """
    def megatron_check(a: argparse.Namespace, d: dict) -> None:
        if a.tensor_model_parallel_size > 1 and not getattr(a, "use_torch_fsdp2", False):
            assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"

    tp2 = (_megatron_args(tensor_model_parallel_size=2), {})
    training_arguments.fall_back_to_torch_paths(megatron_check, None, tp2, {})
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS")
    training_arguments.fall_back_to_torch_paths(
        megatron_check, None, (_megatron_args(tensor_model_parallel_size=2, use_torch_fsdp2=True), {}), {})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    training_arguments.fall_back_to_torch_paths(megatron_check, None, (_megatron_args(), {}), {})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    tp2 = (_megatron_args(tensor_model_parallel_size=2), {})
    training_arguments.fall_back_to_torch_paths(lambda a, d: None, None, tp2, {})
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_compile_helpers_builds_when_nothing_prebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no importable extension, Megatron's own build runs as before."""
    monkeypatch.setattr(training_compile_helpers, "_helpers_found", lambda: False)
    calls = []
    training_compile_helpers.skip_build_when_prebuilt(lambda: calls.append("make"), None, (), {})
    assert calls == ["make"]


# ---------------------------------------------------------------------- with a Megatron-LM checkout


def _env(nproc: int, tp: int, pp: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        NPROC=str(nproc), TP=str(tp), PP=str(pp), ITERS=str(ITERS),
        PORTSPEED=f"{sys.executable} -m portspeed.cli",
        # Megatron's compile_helpers runs `make` with the `python3` on PATH (pybind11 is in this venv)
        PATH=os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
    )
    return env


def _helpers_from_wheel() -> bool:
    """Whether the checkout's release equals the installed wheel's, so its prebuilt dataset helpers are used."""
    from portspeed.versions import distribution_version, package_info_version

    info = Path(os.environ["MEGATRON_LM_ROOT"]) / "megatron" / "core" / "package_info.py"
    return package_info_version(info.read_text()) == distribution_version("megatron-core")


def _run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> str:
    """Run ``cmd`` into ``log`` in its own process group, killed as a whole (ranks too) at RUN_TIMEOUT."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{' '.join(cmd)} hung for {RUN_TIMEOUT}s (killed); log {log}:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    assert rc == 0, f"{' '.join(cmd)} exited {rc}; log {log}:\n{text[-4000:]}"
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
    _require_stock()
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


@pytest.mark.stock
@pytest.mark.multiproc
@needs_checkout
def test_single_process_baseline_trains_from_the_checkpoint(stock: dict) -> None:
    """TP1 runs all iterations on the indexed dataset, learns, and says once which kernels fell back."""
    losses = stock["baseline"]
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert all(v is not None and 0 < v < 20 for v in losses.values())
    assert losses[ITERS] < losses[1], f"loss did not decrease over {ITERS} iterations: {losses}"
    log = stock["baseline_log"]
    for feature in ("persist_layer_norm", "gradient_accumulation_fusion", "masked_softmax_fusion"):
        assert log.count(f"portspeed: {feature} needs") == 1, f"expected one fallback line for {feature}"


@pytest.mark.stock
@pytest.mark.multiproc
@needs_checkout
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process_loss(stock: dict, layout: str) -> None:
    """Per-iteration lm loss of TP/PP/DP layouts equals the TP1 run within 1e-5 (fp32, shared weights)."""
    nproc, tp, pp = LAYOUTS[layout]
    text = _train(stock["work"], layout, nproc, tp, pp, stock["data"], *stock["finetune"])
    assert "distributed_backend ............................. nccl" in text, "Megatron's default backend was changed"
    assert text.count("portspeed: persist_layer_norm needs") == 1, "a fallback is said once per run, not per rank"
    # another release than the wheel's builds its own helpers (make + pybind11) instead of borrowing them
    helpers = "portspeed: megatron.core.datasets.helpers_cpp is not built"
    assert text.count(helpers) == (1 if _helpers_from_wheel() else 0), f"{helpers!r}: once, when borrowed"
    losses = _losses(text, layout)
    base = stock["baseline"]
    assert sorted(losses) == sorted(base)
    deltas = {it: abs(losses[it] - base[it]) for it in base}
    worst = max(deltas, key=deltas.get)
    assert deltas[worst] <= TOLERANCE, (
        f"{layout}: iteration {worst} lm loss {losses[worst]} vs TP1 {base[worst]} (|d|={deltas[worst]:.2e})"
    )


# ---------------------------------------------------------------------- checkpoint resume
RESUME_ITERS = 6
RESUME_AT = 2
#: every RESUME_LOG_INTERVAL iterations Megatron prints the mean over that window; with
#: --log-interval 1 its second printed line of every run (fresh or resumed) is the mean of the
#: run's first two iterations (core_v0.16.1 keeps the first iteration's totals), so a resumed
#: run is compared on the regular windows of an interval > 1 that divides the save iteration
RESUME_LOG_INTERVAL = 2
RESUME_TOLERANCE = 1e-6  # the log prints 7 significant digits; the runs are bit-identical
DATA_RNG_PATCH = "megatron.training.data_iterators_rng"


def test_data_iterator_build_leaves_the_shared_generator_alone() -> None:
    """Host draws while the data iterators are built do not move the CPU adapter's device generator."""
    import torch

    from portspeed.adapters.cpu import CpuAccelerator
    from portspeed.patches.megatron import training_data_rng

    assert training_data_rng.shares_host_generator(CpuAccelerator()) is True
    before = torch.default_generator.get_state()
    drawn = training_data_rng.keep_device_stream(lambda: torch.empty((), dtype=torch.int64).random_().item(),
                                                 None, (), {})
    assert torch.equal(before, torch.default_generator.get_state()), "the build's draw moved the generator"
    assert drawn == torch.empty((), dtype=torch.int64).random_().item(), "the build drew from another state"


@pytest.mark.stock
@pytest.mark.multiproc
@needs_checkout
def test_resume_from_checkpoint_continues_the_uninterrupted_run(tmp_path: Path) -> None:
    """TP2 with dropout: save at iteration 2, resume with --load; the losses equal an uninterrupted run's."""
    _require_stock()
    env = _env(2, 2, 1) | {"ITERS": str(RESUME_ITERS)}
    common = ["--log-interval", str(RESUME_LOG_INTERVAL), "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    ckpt = tmp_path / "ckpt"
    whole = _losses(_run(["bash", str(EXAMPLE), *common], env, tmp_path, tmp_path / "whole.log"), "whole")
    _run(["bash", str(EXAMPLE), *common, "--save", str(ckpt), "--save-interval", str(RESUME_AT),
          "--exit-interval", str(RESUME_AT)], env, tmp_path, tmp_path / "first.log")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(RESUME_AT)
    resumed = _losses(_run(["bash", str(EXAMPLE), *common, "--load", str(ckpt)], env, tmp_path,
                           tmp_path / "resumed.log"), "resumed")
    assert min(resumed) == RESUME_AT + 1, f"the resumed run did not start after the checkpoint: {sorted(resumed)}"
    windows = list(range(RESUME_AT + RESUME_LOG_INTERVAL, RESUME_ITERS + 1, RESUME_LOG_INTERVAL))
    assert set(windows) <= set(whole) and set(windows) <= set(resumed), (sorted(whole), sorted(resumed))
    for it in windows:
        assert abs(resumed[it] - whole[it]) <= RESUME_TOLERANCE, (
            f"iteration {it}: resumed lm loss {resumed[it]} vs uninterrupted {whole[it]}")

    # control: without the patch the data-iterator build moves the restored generator, and the
    # comparison above must see it (so it can fail)
    control_env = env | {"PORTSPEED_DISABLE": DATA_RNG_PATCH}
    control = _losses(_run(["bash", str(EXAMPLE), *common, "--load", str(ckpt)], control_env, tmp_path,
                           tmp_path / "control.log"), "control")
    worst = max(abs(control[it] - whole[it]) for it in windows)
    assert worst > RESUME_TOLERANCE, f"with {DATA_RNG_PATCH} disabled the resume still matched (|d|={worst:.2e})"


def test_only_scripts_of_a_megatron_lm_checkout_become_framework_modules(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """From core_v0.18 the stock script calls .cuda() itself: its checkout's top-level modules are framework code."""
    import types

    from portspeed.patches.megatron import training_script

    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "training").mkdir(parents=True)
    (checkout / "megatron" / "training" / "__init__.py").write_text("")
    script, helper, user = checkout / "pretrain_gpt.py", checkout / "gpt_builders.py", tmp_path / "mine.py"
    script.write_text("")  # only real files at the checkout's top count (tests/test_script_scope.py)
    helper.write_text("")
    assert training_script.checkout_root(str(script)) == str(checkout)
    assert training_script.checkout_root(str(user)) is None and training_script.checkout_root(None) is None
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    builders = types.ModuleType("gpt_builders")
    builders.__file__ = str(helper)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setitem(sys.modules, "gpt_builders", builders)
    assert training_script.checkout_modules(str(checkout)) == ["__main__", "gpt_builders"]
