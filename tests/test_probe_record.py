"""The probe's recording side (``portspeed run --probe``): it observes and never changes a run.

Real runs of the example trainer (megatron-core on CPU + Gloo, a 2-layer GPT, 3 iterations) and of an
own torch loop (torch's DDP, Gloo, 2 ranks) that marks its iterations with ``portspeed.probe.iteration``:

- a probed run's losses equal the unprobed run's bit for bit: module level (TP1), op level with
  ``--probe-nan`` (TP1, and TP2 where the collectives are recorded), the own loop;
- the dump: only the step folders of ``--probe-iterations``, only the ranks of ``--probe-ranks``,
  msprobe's keys and fields with portspeed's ``ps_*`` additions and the run meta, float64
  statistics equal to a float64 recomputation of the tensor ``--probe-tensors`` saved;
- ``--probe-nan`` names the module where a planted NaN was made (iteration 3), writes the dump and
  ends the job with a non-zero status (the example's ``--plant-nan``, and the own loop's);
- probing off installs no probe patch and no hook.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.launch import Result, child_json, free_port, parse_losses, run_python, torchrun  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]

SCRIPT = "examples/pretrain_gpt.py"
LOOP = "tests/data/probe_loop.py"
#: small enough to keep a launch short, big enough for TP2, two micro-batches and a layer 1
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
         "--seed", "1234", "--iters", "3"]
TIMEOUT = 300
STATS = ("Max", "Min", "Mean", "Norm")


def portspeed_run(nproc: int, probe: list[str], script: str, args: list[str], adaptor: str = "megatron",
                  env: dict[str, str] | None = None) -> Result:
    """``portspeed run`` with the probe switches on 127.0.0.1 (a taken port is retried once)."""
    for attempt in range(2):
        res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", str(nproc), "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), "--adaptor", adaptor, *probe, script,
                          *args], timeout=TIMEOUT, env=env, drop=("PORTSPEED_*",))
        if res.returncode != 0 and "EADDRINUSE" in res.stderr and attempt == 0:
            continue
        return res
    return res


def losses(res: Result) -> dict[int, tuple[float, float | None]]:
    got = parse_losses(res.check().stdout)
    assert sorted(got) == [1, 2, 3], f"expected iterations 1..3, got {sorted(got)}\n{res.stdout[-2000:]}"
    return got


def dump(folder: Path, step: int, rank: int) -> dict[str, Any]:
    text = (folder / f"step{step}" / f"rank{rank}" / "dump.json").read_text()
    assert '"_slot"' not in text and '"_numel"' not in text, "a tensor record was written before its statistics"
    return flat(json.loads(text))


def flat(d: dict[str, Any]) -> dict[str, Any]:
    """A dump with each entry's ``ps`` field (portspeed's keys, written there for msprobe's compare) back as
    ``ps_*`` keys."""
    for key, entry in d["data"].items():
        assert isinstance(entry.get("ps"), dict), f"{key}: portspeed's keys belong in one 'ps' field"
        d["data"][key] = {**{k: v for k, v in entry.items() if k != "ps"},
                          **{f"ps_{k}": v for k, v in entry["ps"].items()}}
    return d


def folders(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.glob("step*/rank*"))


@pytest.fixture(scope="module")
def tp1() -> dict:
    """The unprobed TP1 run (losses and grad norms)."""
    return losses(torchrun(SCRIPT, 1, MODEL, timeout=TIMEOUT, env={"PORTSPEED_PROBE_DIR": ""}))


@pytest.fixture(scope="module")
def tp2() -> dict:
    return losses(torchrun(SCRIPT, 2, [*MODEL, "--tp", "2"], timeout=TIMEOUT, env={"PORTSPEED_PROBE_DIR": ""}))


def test_module_level_is_bit_for_bit_records_the_range_and_names_a_planted_nan(tp1: dict, tmp_path: Path) -> None:
    """Module level, iteration 2 in full with one module's full tensors, --probe-nan on every iteration, and the
    example's planted NaN in decoder layer 1's output at iteration 3: iterations 1-2 lose nothing to probing (bit
    for bit), the dump is as documented, and the NaN is named with its iteration, its dump written, the job ended."""
    out = tmp_path / "probe"
    res = portspeed_run(1, ["--probe", str(out), "--probe-iterations", "2", "--probe-nan",
                            "--probe-tensors", "Module.decoder.layers.1.mlp.linear_fc1.*"], SCRIPT,
                        [*MODEL, "--plant-nan", "3:1"])
    assert res.returncode != 0, "a NaN must end the job"
    got = parse_losses(res.stdout)
    assert got == {i: tp1[i] for i in (1, 2)}, "probing changed the losses (or the NaN came early)"
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("portspeed probe: non-finite")]
    assert len(lines) == 1, res.stderr[-3000:]
    assert ("iteration 3, micro-batch 0, rank 0, forward: decoder.layers.1 (TransformerLayer) output 0" in lines[0]
            and str(out / "step3" / "rank0") in lines[0]), lines[0]
    assert folders(out) == ["step2/rank0", "step3/rank0"]  # the range, and the iteration with the NaN
    assert dump(out, 3, 0)["data"]["Module.decoder.layers.1.TransformerLayer.forward.0"]["output"][0][
        "ps_finite"] is False
    d = dump(out, 2, 0)
    assert (d["task"], d["level"], d["framework"]) == ("statistics", "L0", "pytorch")
    meta = d["portspeed"]
    assert meta["format"] == "portspeed-probe" and meta["iteration"] == 2 and meta["level"] == "module"
    assert meta["layout"]["tp"] == 1 and meta["micro_batches"] == 2 and meta["global_batch_size"] == 4
    assert meta["model"]["num_layers"] == 2 and meta["model"]["hidden_size"] == 32
    assert meta["backend"] == "gloo" and "backend_requested" not in meta  # the example asks for the adapter's own
    data = d["data"]
    fwd = data["Module.decoder.layers.1.mlp.linear_fc1.ColumnParallelLinear.forward.1"]
    assert (fwd["ps_phase"], fwd["ps_micro_batch"], fwd["ps_layer"], fwd["ps_iteration"]) == ("forward", 1, 1, 2)
    assert len(fwd["output"]) == 2 and fwd["output"][0]["shape"] == [16, 2, 128]  # (output, bias): every tensor
    assert fwd["output"][0]["ps_layout"]["kind"] == "full"  # TP1: nothing is split
    assert "Module.decoder.layers.1.mlp.linear_fc1.ColumnParallelLinear.backward.1" in data
    assert "Module.embedding.word_embeddings.VocabParallelEmbedding.forward.0" in data  # wrappers stripped
    grads = data["Module.decoder.layers.0.self_attention.linear_qkv.ColumnParallelLinear.parameters_grad.0"]
    assert set(grads) >= {"weight", "bias"} and grads["ps_micro_batch"] == -1
    assert grads["weight"][0]["Norm"] > 0 and grads["weight"][0]["shape"] == [96, 32]
    assert "Module.decoder.final_layernorm.LayerNorm.parameters_updated.0" in data
    assert [e["ps_seq"] for e in data.values()] == list(range(len(data)))
    construct = json.loads((out / "step2" / "rank0" / "construct.json").read_text())
    assert set(construct) == set(data)
    assert json.loads((out / "step2" / "rank0" / "stack.json").read_text())
    # the float64 statistics of a saved tensor equal a float64 recomputation of it
    import torch

    saved = out / "step2" / "rank0" / "tensors" / (
        "Module.decoder.layers.1.mlp.linear_fc1.ColumnParallelLinear.forward.0.output.0.pt")
    t = torch.load(saved).double().flatten().tolist()
    rec = data["Module.decoder.layers.1.mlp.linear_fc1.ColumnParallelLinear.forward.0"]["output"][0]
    assert rec["Max"] == max(t) and rec["Min"] == min(t) and rec["ps_nan"] == 0 and rec["ps_inf"] == 0
    assert rec["Mean"] == pytest.approx(math.fsum(t) / len(t), rel=1e-12, abs=1e-15)
    assert rec["Norm"] == pytest.approx(math.sqrt(math.fsum(x * x for x in t)), rel=1e-12)


def test_the_dump_records_the_backend_that_ran_and_the_one_asked_for(tmp_path: Path) -> None:
    """The script asks for nccl, as Megatron-LM's own pretrain_gpt.py does; on the CPU adapter the group runs on
    Gloo: the run meta says gloo ran and nccl was asked for, and `portspeed compare --probe` reads the dump."""
    out = tmp_path / "probe"
    portspeed_run(1, ["--probe", str(out), "--probe-iterations", "1"], SCRIPT,
                  [*MODEL, "--iters", "1", "--backend", "nccl"], env={"PORTSPEED_ACCELERATOR": "cpu"}).check()
    meta = dump(out, 1, 0)["portspeed"]
    assert (meta["adapter"], meta["backend"], meta["backend_requested"]) == ("cpu", "gloo", "nccl"), meta
    from portspeed.parity import compare

    said = io.StringIO()
    assert compare.main(["--probe", str(out), str(out)], out=said, err=said) == 0, said.getvalue()
    assert "cpu/gloo (asked: nccl)" in said.getvalue(), said.getvalue()


def test_op_level_and_nan_watch_are_bit_for_bit(tp1: dict, tmp_path: Path) -> None:
    """Op level with --probe-nan on every iteration (flags) and iteration 2 in full: the same losses."""
    out = tmp_path / "probe"
    res = portspeed_run(1, ["--probe", str(out), "--probe-iterations", "2", "--probe-level", "op", "--probe-nan"],
                        SCRIPT, MODEL)
    assert losses(res) == tp1, "op-level probing or the NaN watch changed the losses"
    assert folders(out) == ["step2/rank0"]  # the NaN watch writes nothing while every value is finite
    d = dump(out, 2, 0)
    assert d["level"] == "mix" and d["portspeed"]["nan_check"] is True
    ops = {k: e for k, e in d["data"].items() if not k.startswith("Module.")}
    assert any(k.startswith("Functional.linear.") or k.startswith("Torch.matmul.") for k in ops), list(ops)[:20]
    inner = [e for e in ops.values() if e["ps_module"] == "decoder.layers.0.self_attention.linear_qkv"]
    assert inner and all(e["ps_class"] == "ColumnParallelLinear" and e["ps_op_index"] >= 0 for e in inner)
    assert all("input_args" in e and "output" in e for e in ops.values())


def test_tp2_op_level_records_collectives_on_the_ranks_asked(tp2: dict, tmp_path: Path) -> None:
    """TP2, op level, --probe-ranks 1, --probe-nan: the same losses; rank 1's TP all_reduces with their group."""
    out = tmp_path / "probe"
    res = portspeed_run(2, ["--probe", str(out), "--probe-level", "op", "--probe-ranks", "1", "--probe-nan"],
                        SCRIPT, [*MODEL, "--tp", "2"])
    assert losses(res) == tp2, "probing a TP2 run changed the losses"
    assert folders(out) == ["step1/rank1"]
    d = dump(out, 1, 1)
    assert d["portspeed"]["layout"]["tp"] == 2 and d["portspeed"]["ranks"]["tp"] == 1
    reduces = [e for k, e in d["data"].items() if k.startswith("Distributed.all_reduce.")]
    proj = [e for e in reduces if e["ps_module"] == "decoder.layers.1.self_attention.linear_proj"]
    assert proj and proj[0]["input_kwargs"]["group"]["group_ranks"] == [0, 1] and proj[0]["output"]
    before = [e for e in d["data"].values() if e.get("ps_op") == "matmul"
              and e["ps_module"] == "decoder.layers.1.self_attention.linear_proj"]
    assert before and before[0]["output"][0]["ps_layout"]["kind"] == "partial"  # before the TP reduce
    out_proj = d["data"]["Module.decoder.layers.1.self_attention.linear_proj.RowParallelLinear.forward.0"]
    assert out_proj["output"][0]["ps_layout"] == {"kind": "full", "groups": ["tp"], "dims": {}}
    qkv = d["data"]["Module.decoder.layers.1.self_attention.linear_qkv.ColumnParallelLinear.forward.0"]
    assert qkv["output"][0]["ps_layout"]["kind"] == "split" and qkv["output"][0]["ps_layout"]["dims"] == {"tp": -1}


def _loop_losses(text: str, prefix: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(rf"^{prefix}iteration (\d+) \| lm loss: (\S+)", text,
                                                            re.MULTILINE)}


def test_own_loop_marks_iterations_with_one_call(tmp_path: Path) -> None:
    """A plain torch loop (DDP, Gloo, 2 ranks) with portspeed.probe.iteration(), trained a second time in the same
    launch with the call: the same losses; both ranks' dumps of iteration 2 (DDP's wrapper stripped, two
    micro-batches, inputs, only the modules asked for, parameters around the torch optimizer's step); a NaN
    planted at iteration 3 named, job ended."""
    out = tmp_path / "probe"
    res = portspeed_run(2, ["--probe", str(out), "--probe-iterations", "2", "--probe-nan", "--probe-inputs",
                            "--probe-modules", "body*"], LOOP, ["--nan-at", "3"], adaptor="none")
    assert res.returncode != 0, "a NaN must end the job"
    plain, probed = _loop_losses(res.stdout, "plain "), _loop_losses(res.stdout, "")
    assert sorted(plain) == [1, 2, 3] and probed == {i: plain[i] for i in (1, 2)}, res.stdout[-2000:]
    line = [ln for ln in res.stderr.splitlines() if "rank 0, forward" in ln]
    assert line and "non-finite at iteration 3, micro-batch 0, rank 0, forward: body.1 (GELU) output 0" in line[0]
    assert {"step2/rank0", "step2/rank1", "step3/rank0"} <= set(folders(out))
    d = dump(out, 2, 1)
    assert d["portspeed"]["framework"] == "loop" and d["portspeed"]["micro_batches"] == 2
    data = d["data"]
    for key in ("Module.body.0.Linear.forward.1", "Module.body.0.Linear.backward.1",
                "Module.body.0.Linear.parameters_grad.0", "Module.body.2.LayerNorm.parameters_updated.0"):
        assert key in data, key
    assert not any("Module.head." in k for k in data), "--probe-modules body*: the head is not recorded"
    fwd = data["Module.body.0.Linear.forward.1"]
    assert fwd["ps_micro_batch"] == 1 and fwd["input_args"][0]["shape"] == [4, 8]  # --probe-inputs


def test_probing_off_installs_nothing() -> None:
    """Without PORTSPEED_PROBE_DIR no probe patch is registered, Megatron's schedule and torch.distributed's
    collectives are not wrapped by the probe, and no session exists."""
    got = child_json("""
        import json, types
        import torch
        import portspeed, portspeed.megatron_adaptor
        import megatron.core.pipeline_parallel.schedules as sched
        import megatron.core.optimizer.optimizer as opt
        from portspeed.probe import session
        names = [r.patch.name for r in portspeed.manager().records()]
        hooks = torch.nn.modules.module
        print(json.dumps({"probe_patches": [n for n in names if "probe" in n], "session": session.current() is None,
                          "plain": [type(f) is types.FunctionType for f in (
                              sched.get_forward_backward_func, opt.MixedPrecisionOptimizer.__dict__["step"],
                              opt.FP32Optimizer.__dict__["step"], opt.ChainedOptimizer.__dict__["step"])],
                          "global_hooks": len(hooks._global_forward_hooks) + len(hooks._global_forward_pre_hooks),
                          "registered": len(names) > 0}))
    """, timeout=TIMEOUT, drop=("PORTSPEED_*",))
    assert got == {"probe_patches": [], "session": True, "plain": [True] * 4, "global_hooks": 0,
                   "registered": True}, got


def test_portspeed_patches_lists_op_level_probe_and_perf_collectives_once(tmp_path: Path) -> None:
    """`portspeed patches` sets up both integrations, each declaring the collective wrappers: with op-level probing
    and the perf recording on, each wrapper is one patch, applied (it was a PatchConflictError: a new record per
    call)."""
    env = {"PORTSPEED_PROBE_DIR": str(tmp_path / "probe"), "PORTSPEED_PROBE_LEVEL": "op",
           "PORTSPEED_PERF": str(tmp_path / "perf")}
    res = run_python(["-m", "portspeed.cli", "patches"], timeout=TIMEOUT, env=env, drop=("PORTSPEED_*",)).check()
    for name in ("probe", "perf"):
        rows = re.findall(rf"^(\S+) +torch\.distributed\.all_reduce\.{name} ", res.stdout, re.M)
        assert rows == ["APPLIED"], (name, rows, res.stdout[-3000:])


@pytest.mark.testdev
def test_test_device_op_level_is_bit_for_bit(tmp_path: Path) -> None:
    """On the test device (a C++ PrivateUse1 device and its CCL): op level with the NaN watch changes no loss,
    raises no false alarm on memory Megatron allocates without writing (its attention buffer), and the dump
    says where it ran."""
    def launch(probe: list[str]) -> Result:
        return run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()), *probe, SCRIPT, *MODEL], timeout=TIMEOUT,
                          env={"PORTSPEED_ACCELERATOR": "testdev"}, drop=("PORTSPEED_*",))

    base = losses(launch([]))
    out = tmp_path / "probe"
    assert losses(launch(["--probe", str(out), "--probe-iterations", "2", "--probe-level", "op",
                          "--probe-nan"])) == base
    d = dump(out, 2, 0)
    assert (d["portspeed"]["device"], d["portspeed"]["adapter"]) == ("testdev", "testdev")
    assert any(e.get("ps_uninitialized") for e in d["data"].values())  # the buffer: recorded, no statistics
