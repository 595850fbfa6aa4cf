"""Megatron-LM options that need CUDA-only machinery are refused at start-up, naming the flag.

``megatron.training.validate_args.cuda_only`` (patches/megatron/training_cuda_only.py):
context parallelism (Megatron's local attention asserts a context-parallel size of 1; only
Transformer Engine's attention does more), CUDA graphs, the flex MoE token dispatcher
(DeepEP / HybridEP / NCCL EP), ``--tp-comm-overlap`` (userbuffers) and ``--log-straggler`` (CUDA events
and NVML).

Three levels: the checks on argument namespaces (no Megatron needed); Megatron-LM's own
``parse_args`` + ``validate_args`` on real command lines in a child interpreter (the
``megatron.training`` of ``MEGATRON_LM_ROOT`` when set, else the installed one: the 0.17+
wheels ship it, the 0.16 wheel does not, so leg 1 without a checkout skips for the lack of
one); and (``stock``) the stock ``pretrain_gpt.py`` with ``--context-parallel-size 2`` on
two ranks, which must stop before it builds the model.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from pathlib import Path

import pytest
from helpers.launch import run_snippet
from helpers.requires import importable
from helpers.stock import SKIP_REASON
from helpers.stock_parity import stock_run

from portspeed.errors import UnsupportedOptionError
from portspeed.patches.megatron import training_cuda_only

pytestmark = [pytest.mark.megatron]

PATCH = "megatron.training.validate_args.cuda_only"

#: case -> (extra command-line flags, the flag text the refusal must name)
CASES: dict[str, tuple[list[str], str]] = {
    "cp2": (["--context-parallel-size", "2"], "--context-parallel-size 2"),
    "enable_cuda_graph": (["--enable-cuda-graph"], "--enable-cuda-graph"),
    "external_cuda_graph": (["--external-cuda-graph"], "--external-cuda-graph"),
    "cuda_graph_impl": (["--cuda-graph-impl", "local"], "--cuda-graph-impl local"),
    "deepep": (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"],
               "--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend deepep)"),
    "hybridep": (["--num-experts", "4", "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend",
                  "hybridep"], "--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend hybridep)"),
    "tp_comm_overlap": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"],
                        "--tp-comm-overlap"),
    "local_grouped_gemm": (["--num-experts", "4", "--moe-grouped-gemm"],
                           "--moe-grouped-gemm with --transformer-impl local"),
    "log_straggler": (["--log-straggler"], "--log-straggler"),
}


# ---------------------------------------------------------------------- the checks alone
def _ns(**kw: object) -> argparse.Namespace:
    base = dict(context_parallel_size=1, enable_cuda_graph=False, external_cuda_graph=False, cuda_graph_impl="none",
                moe_token_dispatcher_type="allgather", moe_flex_dispatcher_backend="deepep", moe_enable_deepep=False,
                tp_comm_overlap=False, transformer_impl="local")
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize(("kw", "flag"), [
    ({"context_parallel_size": 2}, "--context-parallel-size 2"),
    ({"enable_cuda_graph": True}, "--enable-cuda-graph"),
    ({"external_cuda_graph": True}, "--external-cuda-graph"),
    ({"cuda_graph_impl": "transformer_engine"}, "--cuda-graph-impl transformer_engine"),
    ({"cuda_graph_impl": "full_iteration"}, "--cuda-graph-impl full_iteration"),
    ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "ncclep"},
     "--moe-flex-dispatcher-backend ncclep"),
    ({"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True}, "--moe-enable-deepep"),
    ({"tp_comm_overlap": True}, "--tp-comm-overlap"),
    ({"moe_grouped_gemm": True, "transformer_impl": "local"}, "--moe-grouped-gemm with --transformer-impl local"),
    ({"moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True}, "--moe-use-legacy-grouped-gemm"),
    ({"log_straggler": True}, "--log-straggler"),
])
def test_each_cuda_only_option_is_named(kw: dict, flag: str) -> None:
    lines = training_cuda_only.refusals(_ns(**kw), "cpu")
    assert lines and any(line.startswith(flag) or flag in line for line in lines), lines


def test_portable_options_pass_and_validation_runs_after_the_check() -> None:
    """Nothing is refused for portable options (MoE alltoall, CP 1, no graphs); Megatron's validation then runs."""
    portable = _ns(moe_token_dispatcher_type="alltoall", context_parallel_size=1)
    assert training_cuda_only.refusals(portable, "cpu") == []
    # older releases lack some attributes: a missing one means the option is off
    assert training_cuda_only.refusals(argparse.Namespace(), "cpu") == []
    calls = []
    training_cuda_only.refuse_cuda_only_options(lambda a, d: calls.append(a), None, (portable, {}), {})
    assert calls == [portable]
    with pytest.raises(UnsupportedOptionError, match="--context-parallel-size 2.*\n  --tp-comm-overlap"):
        training_cuda_only.refuse_cuda_only_options(lambda a, d: calls.append(a), None,
                                                    (_ns(context_parallel_size=2, tp_comm_overlap=True), {}), {})
    assert len(calls) == 1, "Megatron's validation ran after a refusal"


# ---------------------------------------------------------------------- Megatron's own validation
VALIDATE = textwrap.dedent(
    """
    import json, os, sys
    import portspeed, portspeed.megatron_adaptor
    from megatron.training.arguments import parse_args, validate_args
    base, cases = json.loads(os.environ["VALIDATE_BASE"]), json.loads(os.environ["VALIDATE_CASES"])
    out = {}
    for name, flags in cases.items():
        sys.argv = ["pretrain_gpt.py", *base, *flags]
        args = parse_args()
        try:
            validate_args(args, {})
            out[name] = "accepted" + (" (moe_grouped_gemm)" if getattr(args, "moe_grouped_gemm", False) else "")
        except Exception as exc:  # what Megatron or portspeed says, whatever its type
            out[name] = f"{type(exc).__name__}: {exc}"
    status = {p["name"]: p["status"] for p in portspeed.report()}
    import megatron.training
    out["_meta"] = {"status": status.get(%r), "training": os.path.dirname(megatron.training.__file__)}
    print(json.dumps(out))
    """ % PATCH
)
BASE = ["--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "1", "--eval-interval", "1", "--lr", "1e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def _training_source() -> tuple[dict[str, str] | None, str | None]:
    """(env for the child, None) for a megatron.training to validate with, or (None, why there is none)."""
    root = os.environ.get("MEGATRON_LM_ROOT", "").strip()
    if root and (Path(root) / "megatron" / "training" / "arguments.py").is_file():
        return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}, None
    if importable("megatron.training.arguments"):
        return {}, None
    return None, ("megatron.training ships in Megatron-LM checkouts and in the megatron-core wheels from 0.17; this "
                  f"environment has neither ({SKIP_REASON})")


def _validate(cases: dict[str, list[str]], **env: str) -> dict:
    child_env, why = _training_source()
    if child_env is None:
        pytest.skip(why)
    res = run_snippet(VALIDATE, timeout=300, env={"PORTSPEED_ACCELERATOR": "cpu", "WORLD_SIZE": "2", "RANK": "0",
                                                  "VALIDATE_BASE": json.dumps(BASE),
                                                  "VALIDATE_CASES": json.dumps(cases), **child_env, **env},
                      drop=("PORTSPEED_*",))
    return res.check().last_json()


def test_megatron_validation_refuses_each_flag_by_name() -> None:
    """Megatron-LM's parse_args + validate_args on real command lines: each case refused, naming its flag."""
    out = _validate({"portable": ["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall"],
                     "te_grouped_gemm": ["--transformer-impl", "transformer_engine", "--num-experts", "4",
                                         "--moe-grouped-gemm"],
                     "te_cp2": ["--transformer-impl", "transformer_engine", "--context-parallel-size", "2"],
                     **{name: flags for name, (flags, _) in CASES.items()}})
    meta = out.pop("_meta")
    assert meta["status"] == "applied", meta
    assert out.pop("portable") == "accepted", "a portable command line was refused"
    # the TE path's grouped GEMM is the portable TE's: Megatron's compute-capability check is passed, the flag kept
    assert out.pop("te_grouped_gemm") == "accepted (moe_grouped_gemm)"
    # context parallelism on the TE path is the portable TE attention's; refused only with --transformer-impl local
    assert out.pop("te_cp2") == "accepted", "CP2 on the TE path was refused"
    for name, (_, flag) in CASES.items():
        assert out[name].startswith("UnsupportedOptionError: portspeed:"), (name, out[name])
        assert flag in out[name], (name, flag, out[name])
        assert out[name].count("\n  ") == 1, f"{name}: one flag, one line: {out[name]}"
    assert "Transformer Engine" in out["cp2"] and "DotProductAttention" in out["cp2"], out["cp2"]


def test_without_the_patch_megatron_accepts_context_parallelism() -> None:
    """Control: Megatron's own validation lets CP 2 through (it fails only when the attention is built)."""
    out = _validate({"cp2": CASES["cp2"][0]}, PORTSPEED_DISABLE=PATCH)
    assert out["_meta"]["status"] == "disabled", out["_meta"]
    assert out["cp2"] == "accepted", out["cp2"]


def test_without_the_portable_te_megatron_refuses_grouped_gemm_by_capability() -> None:
    """Control: with the portable TE off, Megatron's own compute-capability check stops --moe-grouped-gemm."""
    out = _validate({"te_grouped_gemm": ["--transformer-impl", "transformer_engine", "--num-experts", "4",
                                         "--moe-grouped-gemm"]},
                    PORTSPEED_DISABLE="megatron.core.transformer_engine.portable")
    assert out["te_grouped_gemm"].startswith("AssertionError: Unsupported compute capability"), out


# ---------------------------------------------------------------------- the stock script
@pytest.mark.stock
@pytest.mark.multiproc
@pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
def test_stock_pretrain_with_context_parallel_stops_at_start_up(tmp_path: Path) -> None:
    """pretrain_gpt.py --context-parallel-size 2 on two ranks exits before building the model, with the message."""
    log = tmp_path / "cp2.log"
    with pytest.raises(AssertionError, match="failed"):
        stock_run(2, log, "--context-parallel-size", "2", "--train-iters", "2", "--eval-interval", "2")
    text = log.read_text()
    assert "UnsupportedOptionError: portspeed:" in text and "--context-parallel-size 2" in text, text[-3000:]
    assert "building GPT model" not in text, "the model was built before the refusal"
