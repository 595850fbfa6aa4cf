"""End to end: where a port parts, named in the first line of `portspeed compare --probe`, on real runs.

The example trainer (megatron-core 0.16.1 on CPU + Gloo, and the C++ test device), a 2-layer GPT,
probed with no edit through `portspeed run --probe` (DP2 through torchrun and ``PORTSPEED_PROBE_DIR``).
One module fixture launches every run once, two at a time; each comparison below reads two of them:

- planted faults, each named by the parsed first line (iteration, phase, module path, op):
  a vendor ``rms_norm`` off by 1e-3 on the test device against the CPU (TE spec, RMSNorm, where the
  norm is fused into ``linear_qkv``; at op level the op itself); layer 1's row-parallel all_reduce
  averaged in a TP2 run against TP1 (a cross-layout compare); a NaN in layer 1's output at
  iteration 3 (``--probe-nan`` ends the job naming it, and the compare names it too);
- no false alarm, exit 0 against the one-rank run: TP2, TP2 + SP, PP2, DP2 (micro-batches matched
  through the example's declared ``PORTSPEED_PROBE_DP_ORDER``), CP2 (TE spec), EP2 (against EP1),
  bf16 TP2 against bf16 TP1, the test device against the CPU (op level); dropout on with another
  layout refused with its reason (exit 2);
- msprobe's own dump (tests/data/msprobe_dump: mindstudio-probe 26.2.0's PrecisionDebugger on
  tests/data/msprobe_model.py) against portspeed's dump of the same step: exit 0; with the last
  module's output planted, that module is named (before the loss's ops after it) with its parameters.

A probed run's losses equal the unprobed run's bit for bit: tests/test_probe_record.py asserts it.
The same checks on stock ``pretrain_gpt.py`` are in docs/accuracy.md (run by hand).

Weights: ``use_cpu_initialization`` builds one set of weights on the host for every TP, SP, CP and
DP layout; pipeline stages and expert ranks initialise only their own parts, so PP2 loads the
checkpoint the one-rank model wrote before training, and EP1 / EP2 the MoE model's.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.launch import REPO, Result, free_port, run_python  # noqa: E402
from test_megatron_core_parity import _run  # noqa: E402
from helpers.probe_runs import probe  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]

SCRIPT = "examples/pretrain_gpt.py"
#: the smallest GPT with two layers, two micro-batches per iteration, TP2 and 4 heads
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
         "--seed", "1234"]
TE = [*MODEL, "--transformer-impl", "transformer_engine", "--normalization", "RMSNorm"]
MOE = [*MODEL, "--num-experts", "4", "--moe-router-topk", "2"]
RMS_OFF = "tests/data/testdev_rms_off.py:TestdevRmsOff"
CKPT, MOE_CKPT = "{ckpt}", "{moe_ckpt}"  # filled with the fixture's checkpoints
TIMEOUT = 300
OP = ["--probe-level", "op"]

#: name -> (ranks, the example's flags, environment, probe switches); iteration 1 unless said
RUNS: dict[str, tuple[int, list[str], dict[str, str], list[str]]] = {
    "tp1": (1, [*MODEL, "--iters", "3"], {}, ["--probe-iterations", "1:3"]),  # iteration 3 for the NaN
    "tp2": (2, [*MODEL, "--tp", "2"], {}, []),
    "tp2-sp": (2, [*MODEL, "--tp", "2", "--sequence-parallel"], {}, []),
    "pp2": (2, [*MODEL, "--pp", "2", "--load", CKPT, "--finetune"], {}, []),
    "dp2": (2, MODEL, {}, []),  # through torchrun: see launch()
    "tp2-avg": (2, [*MODEL, "--tp", "2", "--plant-reduce-avg", "1:1"], {}, []),
    "nan": (1, [*MODEL, "--iters", "3", "--plant-nan", "3:1"], {}, ["--probe-iterations", "1:3", "--probe-nan"]),
    "dropout": (1, [*MODEL, "--hidden-dropout", "0.1"], {}, []),
    "bf16-tp1": (1, [*MODEL, "--bf16"], {}, []),
    "bf16-tp2": (2, [*MODEL, "--bf16", "--tp", "2"], {}, []),
    "ep1": (1, [*MOE, "--load", MOE_CKPT, "--finetune"], {}, []),
    "ep2": (2, [*MOE, "--ep", "2", "--load", MOE_CKPT, "--finetune"], {}, []),
    "te-tp1": (1, TE, {}, OP),
    "te-cp2": (2, [*TE, "--cp", "2"], {}, []),
    "te-testdev": (1, TE, {"PORTSPEED_ACCELERATOR": "testdev"}, OP),
    "te-rms-off": (1, TE, {"PORTSPEED_ACCELERATOR": RMS_OFF}, []),
    "te-rms-off-op": (1, TE, {"PORTSPEED_ACCELERATOR": RMS_OFF}, OP),
}
#: run -> (the reference it is compared against, the pair and bands the first line must state), the clean pairs
CLEAN = {"tp2": ("tp1", "layout pair, fp32 layout"), "tp2-sp": ("tp1", "layout pair, fp32 layout"),
         "pp2": ("tp1", "layout pair, fp32 layout"), "dp2": ("tp1", "layout pair, fp32 layout"),
         "te-cp2": ("te-tp1", "layout pair, fp32 layout"), "ep2": ("ep1", "layout pair, fp32 layout"),
         "bf16-tp2": ("bf16-tp1", "layout pair, bf16 layout"), "te-testdev": ("te-tp1", "device pair, fp32 device")}

_FIRST = re.compile(r"^first divergence: iteration (?P<iteration>\d+), micro-batch (?P<micro_batch>\S+), "
                    r"(?P<phase>forward|backward|parameters_grad|parameters_updated), (?P<module>\S+)"
                    r"(?: op (?P<op>\S+) #(?P<op_index>\d+))?(?: \(call \d+\))?, rank (?P<rank>\S+): (?P<what>.*)$")


def first(out: str) -> dict[str, Any]:
    """The first line of `compare --probe`, parsed (fail showing the report when it is no divergence)."""
    m = _FIRST.match(out.splitlines()[0] if out else "")
    assert m, f"no 'first divergence' line:\n{out[:3000]}"
    return m.groupdict()


def launch(name: str, root: Path, ckpts: dict[str, str]) -> Result:
    """One run of RUNS, its dump in root/name (a port taken between choosing and binding is retried once)."""
    n, args, env, switches = RUNS[name]
    args = [a.format(**ckpts) for a in args]
    out = root / name
    for attempt in range(2):
        port = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        if name == "dp2":  # torchrun and the environment: the script's declared order is read there too
            cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(n), *port, SCRIPT, *args]
            env = {**env, "PORTSPEED_PROBE_DIR": str(out)}
        else:
            cmd = ["-m", "portspeed.cli", "run", "--probe", str(out), *switches, "--nproc-per-node", str(n), *port,
                   SCRIPT, *args]
        res = run_python(cmd, timeout=TIMEOUT, env=env, drop=("PORTSPEED_*",))
        if res.returncode == 0 or "EADDRINUSE" not in res.stderr or attempt:
            return res
        shutil.rmtree(out, ignore_errors=True)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run of RUNS, two at a time (the CI machine has 2 cores): {"root": Path, name: Result}."""
    root = tmp_path_factory.mktemp("e2e")
    ckpts = {"ckpt": str(root / "ckpt"), "moe_ckpt": str(root / "moe_ckpt")}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda a: _run(1, ["--save", a[0]], init=None, iters=0, model=a[1]),
                      [(ckpts["ckpt"], MODEL), (ckpts["moe_ckpt"], MOE)]))
        order = sorted(RUNS, key=lambda k: -RUNS[k][0])  # two-rank runs first: the pool ends on short ones
        got = dict(zip(order, pool.map(lambda k: launch(k, root, ckpts), order)))
    return {"root": root, **got}


def dump(runs: dict[str, Any], name: str) -> Path:
    """The dump of a run that must have succeeded."""
    runs[name].check()
    return runs["root"] / name


# ------------------------------------------------------------------ planted faults


@pytest.mark.testdev
def test_a_vendor_rms_norm_off_by_1e3_is_named_at_module_and_op_level(runs: dict[str, Any]) -> None:
    """Test device with rms_norm x (1 + 1e-3) against the CPU, TP1, TE spec + RMSNorm: the first layer's norm,
    fused by the TE spec into linear_qkv, forward, iteration 1; at op level the op rms_norm itself."""
    code, out, err = probe(dump(runs, "te-tp1"), dump(runs, "te-rms-off"))
    got = first(out)
    assert code == 1 and (got["iteration"], got["phase"], got["module"], got["op"]) == (
        "1", "forward", "decoder.layers.0.self_attention.linear_qkv", None), out[:2000]
    code, out, err = probe(dump(runs, "te-tp1"), dump(runs, "te-rms-off-op"))
    got = first(out)
    assert code == 1 and (got["iteration"], got["phase"], got["module"], got["op"], got["op_index"]) == (
        "1", "forward", "decoder.layers.0.self_attention.linear_qkv", "rms_norm", "0"), out[:2000]
    m = re.search(r"(?:Max|Min|Norm) ref (\S+) run (\S+) \(band", got["what"])
    assert m and float(m[2]) / float(m[1]) == pytest.approx(1 + 1e-3, rel=1e-5), got["what"]  # the planted error


def test_an_averaged_all_reduce_is_named_across_layouts(runs: dict[str, Any]) -> None:
    """TP2 with layer 1's row-parallel all_reduce averaged, against TP1: layer 1's linear_proj, forward,
    iteration 1, its output half the reference's."""
    code, out, _ = probe(dump(runs, "tp1"), dump(runs, "tp2-avg"))
    got = first(out)
    assert code == 1 and (got["iteration"], got["micro_batch"], got["phase"], got["module"], got["op"]) == (
        "1", "0", "forward", "decoder.layers.1.self_attention.linear_proj", None), out[:2000]
    m = re.search(r"ref (\S+) run (\S+) \(band", got["what"])
    assert m and float(m[2]) / float(m[1]) == pytest.approx(0.5, rel=1e-3), got["what"]


def test_a_nan_is_named_by_probe_nan_and_by_the_compare(runs: dict[str, Any]) -> None:
    """--plant-nan 3:1 --probe-nan: the job ends non-zero naming decoder.layers.1 at iteration 3, the dump of
    iteration 3 written; compared with the clean run, the first line names the same module and iteration."""
    res = runs["nan"]
    assert res.returncode != 0, "a NaN must end the job"
    said = [ln for ln in res.stderr.splitlines() if ln.startswith("portspeed probe: non-finite")]
    assert len(said) == 1 and "at iteration 3, micro-batch 0, rank 0, forward: decoder.layers.1 (TransformerLayer)" \
        in said[0], res.stderr[-3000:]
    nan = runs["root"] / "nan"
    assert (nan / "step3" / "rank0" / "dump.json").is_file()
    code, out, _ = probe(dump(runs, "tp1"), nan)
    got = first(out)
    assert code == 1 and (got["iteration"], got["micro_batch"], got["phase"], got["module"]) == (
        "3", "0", "forward", "decoder.layers.1"), out[:2000]
    assert "nan count ref 0 run 1" in got["what"], got["what"]


# ------------------------------------------------------------------ no false alarms


@pytest.mark.parametrize("run", [pytest.param(r, marks=pytest.mark.testdev) if "testdev" in r else r for r in CLEAN])
def test_a_clean_run_agrees_with_its_reference(runs: dict[str, Any], run: str) -> None:
    """Exit 0 at the bands of its pair and dtype, and the tensors compared cover forward, backward and parameters
    (nothing passes unseen)."""
    ref, bands = CLEAN[run]
    code, out, err = probe(dump(runs, ref), dump(runs, run))
    assert code == 0 and out.startswith("no divergence: "), f"{run} vs {ref}: exit {code}\n{out[:3000]}{err}"
    assert f"({bands}" in out.splitlines()[0], out.splitlines()[0]
    from portspeed.probe.reading.compare import compare_dumps

    report = compare_dumps(runs["root"] / ref, runs["root"] / run)
    phases = {r.slot.phase for r in report.compared}
    assert phases == {"forward", "backward", "parameters_grad", "parameters_updated"}, (run, phases)
    assert len(report.compared) >= 100, (run, len(report.compared))
    if run in ("dp2", "ep2"):  # the order the example declares, seen under torchrun (dp2) and portspeed run (ep2)
        meta = json.loads((runs["root"] / run / "step1" / "rank1" / "dump.json").read_text())["portspeed"]
        assert meta["dp_order"] == "contiguous" and meta["layout"]["dp"] == 2, meta
        assert not report.notes, report.notes
        mbs = {r.slot.micro_batch for r in report.compared if r.slot.phase == "forward" and r.slot.module
               .startswith("decoder.layers.") and "experts" not in r.slot.module}
        assert mbs == {0, 1}, f"{run}: per-micro-batch entries must compare, micro-batches {mbs}"


def test_dropout_with_another_layout_is_refused(runs: dict[str, Any]) -> None:
    """A TP1 run with dropout on against the TP2 run: exit 2, one line saying why."""
    code, out, err = probe(dump(runs, "dropout"), dump(runs, "tp2"))
    assert code == 2 and not out and err.count("\n") == 1, (code, out, err)
    assert "dropout is on in the reference" in err and "tensor-parallel ranks draw different dropout masks" in err


# ------------------------------------------------------------------ msprobe's own dump

MSPROBE_DUMP = REPO / "tests" / "data" / "msprobe_dump"


def _portspeed_dump(out: Path, *plant: str) -> Path:
    run_python(["tests/data/msprobe_model.py", "--engine", "portspeed", "--out", str(out), *plant],
               timeout=TIMEOUT, drop=("PORTSPEED_*",)).check()
    return out


def test_msprobes_own_dump_agrees_with_portspeeds_dump_of_the_same_step(tmp_path: Path) -> None:
    """msprobe's real mix-level dump and portspeed's op-level dump of the same step: exit 0, the modules' outputs
    and their gradients, the ops and the parameter gradients compared; one module planted: that module named."""
    code, out, err = probe(MSPROBE_DUMP, _portspeed_dump(tmp_path / "ps"))
    assert code == 0 and "(msprobe's own dump)" in out, out + err
    from portspeed.probe.reading.compare import compare_dumps

    report = compare_dumps(MSPROBE_DUMP, tmp_path / "ps")
    keys = {r.slot.key for r in report.compared}
    assert {"Module.fc1.Linear.forward.0", "Module.norm.LayerNorm.backward.0", "Functional.gelu.0.forward",
            "Module.fc2.Linear.parameters_grad.0"} <= keys, sorted(keys)
    assert len(report.compared) >= 30, len(report.compared)
    # the last module's output planted: named before the loss's ops that follow it outside every module
    code, out, _ = probe(MSPROBE_DUMP, _portspeed_dump(tmp_path / "planted", "--plant", "fc2"))
    got = first(out)
    assert code == 1 and (got["iteration"], got["phase"], got["module"]) == (
        "1", "forward", "Module.fc2.Linear.forward.0"), out[:2000]
    lines = out.splitlines()
    at = lines.index("Module.fc2.Linear.forward.0's parameters:")
    listed = [ln for ln in lines[at + 1:] if ln.startswith("  ") and "parameters_" in ln]
    assert listed and all("Module.fc2.Linear.parameters_" in ln for ln in listed), out  # its own, no other's
