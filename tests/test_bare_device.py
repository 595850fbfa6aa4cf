"""A new vendor's day one, run on the bare test device: each fault found, the lines printed, and with them each
layout = CPU TP1.

The bare variant (``PORTSPEED_TESTDEV_BARE``, portspeed/testing/testdev/bare.py) turns off, at load, what the
test device quietly does and a new vendor's device often does not (OpenReg's faults on torch 2.13): memory info,
the PrivateUse1 shallow-copy kernel, a right fused SDPA, a device generator its random ops use, a CCL that moves
data, a right gelu (a torch op the portable TE has no other rung for: computed on the host once declared,
portspeed.accelerator.host_rung). examples/day_one_adapter.py is the file a vendor writes first (names only).
Conformance on it names every fault and ends with the lines to paste (for the CCL that moves nothing: every
collective staged through the host, portspeed.comm.staged); pasted, conformance exits 0 and the example GPT on 2
ranks of the bare device (TP2 on the TE and the local spec, PP2, DP2; TP2 with dropout) equals the CPU run; without
them the TP2 job ends when its default group is made, naming the CCL's wrong collective (portspeed.comm.ccl_check).
The Parameter identity fault is fixed by portspeed itself, detected at selection.

The runs are shared through module fixtures (two conformance runs, one CPU TP1 run, one CPU run writing the
initial weights PP2 starts from); four 2-rank training runs, and one TP2 run that ends at start.
The test device is a C++ PrivateUse1 device, not hardware.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.launch import REPO, parse_losses, run_python, torchrun

#: every fault, the stub CCL included (conformance proposes the staged backend for it: portspeed.comm.staged)
BARE = "all"
EXAMPLE = REPO / "examples" / "day_one_adapter.py"
TIMEOUT = 400
ITERS = 3


def _conformance(adapter: Path) -> tuple[int, str]:
    res = run_python(["-m", "portspeed.cli", "conformance", "--adapter", f"{adapter}:DayOneAccelerator",
                      "--suites", "device,kernels,collectives"], timeout=TIMEOUT, env={"PORTSPEED_TESTDEV_BARE": BARE})
    return res.returncode, res.stdout + res.stderr


def _pasted_lines(out: str) -> list[str]:
    lines = out.splitlines()
    heads = [i for i, ln in enumerate(lines) if "paste" in ln and not ln.startswith("  [")]
    assert len(heads) == 1, out[-3000:]
    return lines[heads[0] + 1:]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    """Conformance (device, kernels, collectives) on the day-one file as shipped, on the bare device."""
    folder = tmp_path_factory.mktemp("day-one")
    adapter = folder / "day_one.py"
    adapter.write_text(EXAMPLE.read_text())
    return _conformance(adapter)


@pytest.fixture(scope="module")
def pasted(first: tuple[int, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """The printed lines pasted at the end of the class (the last thing in the file), and conformance again."""
    folder = tmp_path_factory.mktemp("day-one-pasted")
    adapter = folder / "day_one.py"
    adapter.write_text(EXAMPLE.read_text().rstrip("\n") + "\n" + "\n".join(_pasted_lines(first[1])) + "\n")
    rc, out = _conformance(adapter)
    return adapter, rc, out


@pytest.mark.testdev
def test_each_planted_fault_is_named_and_the_lines_to_paste_printed(first: tuple[int, str]) -> None:
    """Memory info, the host generator, the wrong SDPA and the wrong gelu each fail naming what the device did; the
    Parameter check passes saying portspeed registered the kernel; the stub CCL's collectives fail value for value;
    the run ends with one heading and the four lines (the last: every collective staged through the host)."""
    rc, out = first
    assert rc == 1, out[-4000:]
    failed = {ln.split(" -- ")[0].strip() for ln in out.splitlines() if ln.startswith("  [FAIL]")}
    collectives = {f for f in failed if f.startswith("[FAIL] collectives: ")}
    assert {"[FAIL] collectives: broadcast float32", "[FAIL] collectives: all_gather_into_tensor float32",
            "[FAIL] collectives: all_reduce SUM float32 async=False", "[FAIL] collectives: isend/recv float32",
            } <= collectives, sorted(collectives)[:20]
    assert not any("undeclared gap" in f or "declaration that fits" in f for f in failed), sorted(collectives)
    assert failed - collectives == {
        "[FAIL] device: the device generator is separate from the host generator",
        "[FAIL] device: get/set_rng_state replays the device's draws",
        "[FAIL] device: the device answers its total memory (get_device_properties().total_memory, mem_get_info)",
        "[FAIL] kernels: torch scaled_dot_product_attention on the device matches the CPU",
        "[FAIL] kernels: torch layer_norm on the device matches the CPU",
        "[FAIL] kernels: torch gelu on the device matches the CPU",
    }, out[-4000:]
    assert "NotImplementedError: getMemoryInfo is not implemented" in out
    assert "random ops on the device draw from the host generator" in out
    assert 'torch scaled_dot_product_attention case "no mask", float32: output not finite' in out
    assert 'torch gelu case "exact", float32: output error 2.50e-01 > 1e-04, the band -- portspeed computes gelu on ' \
           'the host' in out  # 1.25x the right value: its error over the largest magnitude is exactly 0.25
    assert "portspeed registered one at activation" in out  # the Parameter check ran and passed through the fix
    assert "42 of the 42 torch.cuda calls the view serves" in out  # total memory degraded instead of raising
    lines = _pasted_lines(out)
    names = [ln.split("=")[0].strip() for ln in lines]
    assert names == ["host_generator", "total_memory_bytes", "wrong_torch_ops", "backend"], lines
    assert lines[0] == "    host_generator = True", lines
    assert lines[2] == "    wrong_torch_ops = ('attention', 'layer_norm', 'gelu')", lines
    assert "portspeed computes layer_norm on the host for every other caller (Megatron's local path)" in out
    assert lines[3] == '    backend = "staged"', lines
    assert int(lines[1].split("=")[1]) > 0


@pytest.mark.testdev
def test_with_the_lines_pasted_conformance_exits_0(pasted: tuple[Path, int, str]) -> None:
    """The same run on the file with the lines pasted: every check passes, each declaration checked on the device."""
    _, rc, out = pasted
    assert rc == 0 and "0 failed" in out and "paste" not in out.splitlines()[-1], out[-4000:]
    assert "random ops on the device draw from the host generator, as declared (host_generator)" in out
    assert "the portable TE's attention runs portspeed's reference, which matches" in out
    assert "[  ok] kernels: torch layer_norm is wrong on the device, as declared (wrong_torch_ops): the portable " \
           "TE's layer_norm runs portspeed's reference, which matches; torch's layer_norm (Megatron's local path) " \
           "runs on the host, which matches" in out  # the device's own layer_norm asked with the host rung suspended
    assert "[  ok] kernels: torch gelu is wrong on the device, as declared (wrong_torch_ops): portspeed computes it " \
           "on the host, which matches" in out  # and the device's own gelu, asked with the host rung suspended
    assert "total memory: the device cannot say, the adapter declares total_memory_bytes" in out
    assert "[  ok] collectives: broadcast float32" in out and "[  ok] collectives: real_backend reports the real " \
        "name" in out  # every collective staged through the host, right on the stub CCL's device


@pytest.mark.testdev
@pytest.mark.megatron
def test_the_training_suite_names_the_ops_one_step_ran_on_the_host(pasted: tuple[Path, int, str]) -> None:
    """conformance --suites training on the pasted file: the example GPT in TP2 (local spec, LayerNorm: torch's
    layer_norm, 1.25x off on the device, computed on the host once declared) matches the CPU record, and one line
    names, from the perf recording of iteration 2 on rank 0, the ops it ran through the CPU fallback and those
    portspeed computed on the host, with counts: baddbmm and _softmax once per layer and micro-batch (2 x 4), gelu
    and gelu_backward 8, native_layer_norm and its backward 20 (two per layer and the final norm, x 4)."""
    res = run_python(["-m", "portspeed.cli", "conformance", "--adapter", f"{pasted[0]}:DayOneAccelerator",
                      "--suites", "training"], timeout=TIMEOUT, env={"PORTSPEED_TESTDEV_BARE": BARE})
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "[  ok] training: example GPT TP2 matches CPU record" in out, out[-3000:]
    line = next((ln for ln in out.splitlines() if ln.startswith("host fallbacks in one training step")), "")
    assert line.startswith("host fallbacks in one training step (iteration 2, rank 0 of TP2): "), out[-3000:]
    fallback, _, host = line.partition("; computed on the host by portspeed because the adapter declares them "
                                       "wrong (wrong_torch_ops): ")
    listed = dict(item.rsplit(" x", 1) for item in fallback.split("): ", 1)[1].split(" (")[0].split(", "))
    assert listed["baddbmm"] == listed["_softmax"] == "8", line
    assert not {"gelu", "native_layer_norm", "transpose", "detach", "copy_"} & set(listed), line
    assert host.startswith("native_layer_norm x20, native_layer_norm_backward x20, gelu x8, gelu_backward x8 (56 "
                           "calls)"), line


@pytest.fixture(scope="module")
def cpu_tp1() -> dict[int, tuple[float, float | None]]:
    """The example GPT (TE spec, RMSNorm) on CPU, one rank: the reference of every bare-device layout. The local
    spec with RMSNorm gives the same losses on CPU (measured: max |diff| 4.8e-7 over 3 iterations, torch 2.13,
    megatron-core 0.16.1), so its layouts compare against this run too, within the same band."""
    from test_example_layouts import TE

    cpu = parse_losses(torchrun("examples/pretrain_gpt.py", 1, [*TE, "--iters", str(ITERS)], timeout=TIMEOUT,
                                env={"PORTSPEED_ACCELERATOR": "cpu"}).check().stdout)
    assert sorted(cpu) == list(range(1, ITERS + 1)), cpu
    return cpu


@pytest.fixture(scope="module")
def cpu_init(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The TE-spec model's initial weights, written by a CPU TP1 run: PP2 builds its stages' layers from other
    random draws than TP1, so it starts from these (the TP1 reference equals a run from them)."""
    from test_example_layouts import TE

    path = str(tmp_path_factory.mktemp("bare-init") / "ckpt")
    torchrun("examples/pretrain_gpt.py", 1, [*TE, "--iters", "0", "--save", path], timeout=TIMEOUT,
             env={"PORTSPEED_ACCELERATOR": "cpu"}).check()
    return path


@pytest.fixture(scope="module")
def cpu_tp1_layernorm() -> dict[int, tuple[float, float | None]]:
    """The example GPT on Megatron's local spec with LayerNorm (torch.nn.LayerNorm: torch's layer_norm on the
    device, wrong on the bare one: wrong-layer-norm), on CPU, one rank: the reference of the local LayerNorm run."""
    from test_example_layouts import TE

    args = [*TE, "--iters", str(ITERS)]
    args[args.index("transformer_engine")], args[args.index("RMSNorm")] = "local", "LayerNorm"
    cpu = parse_losses(torchrun("examples/pretrain_gpt.py", 1, args, timeout=TIMEOUT,
                                env={"PORTSPEED_ACCELERATOR": "cpu"}).check().stdout)
    assert sorted(cpu) == list(range(1, ITERS + 1)), cpu
    return cpu


#: (spec, normalization, layout flags) on 2 ranks: TP2 on both specs (the portable TE's linears and Megatron's own
#: tensor-parallel layers communicate differently), PP2 (send/recv; from the initial weights, TE spec) and DP2 (the
#: gradient all-reduce) once each: the pipeline schedule and DDP do not depend on the spec. DP2 runs the local spec
#: with LayerNorm: torch's layer_norm, wrong on the bare device, computed on the host once declared
BARE_LAYOUTS = [pytest.param("transformer_engine", "RMSNorm", ["--tp", "2"], id="te-tp2"),
                pytest.param("transformer_engine", "RMSNorm", ["--pp", "2"], id="te-pp2"),
                pytest.param("local", "RMSNorm", ["--tp", "2"], id="local-tp2"),
                pytest.param("local", "LayerNorm", [], id="local-dp2-layernorm")]


@pytest.mark.testdev
@pytest.mark.megatron
@pytest.mark.parametrize("spec,norm,layout", BARE_LAYOUTS)
def test_each_layout_on_the_bare_device_with_the_lines_pasted_equals_cpu_tp1(
        spec: str, norm: str, layout: list[str], pasted: tuple[Path, int, str], request: pytest.FixtureRequest
        ) -> None:
    """The example GPT on 2 ranks of the bare device (every fault, the stub CCL included) with the pasted file: its
    losses equal CPU TP1's of the same normalization within 1e-5 at every iteration (grad norms within 1e-4
    relative), its collectives staged through the host; LayerNorm on the local spec through the host rung (the
    device's own layer_norm is 1.25x off). (With the file as shipped the job ends at start: the next test.)"""
    from test_example_layouts import TE
    from test_megatron_core_parity import FP32_TOL, _assert_close

    args = [*TE, "--iters", str(ITERS), *layout]
    args[args.index("transformer_engine")], args[args.index("RMSNorm")] = spec, norm
    cpu_tp1 = request.getfixturevalue("cpu_tp1" if norm == "RMSNorm" else "cpu_tp1_layernorm")
    if "--pp" in layout:
        args += ["--load", request.getfixturevalue("cpu_init"), "--finetune"]
    res = torchrun("examples/pretrain_gpt.py", 2, args, timeout=TIMEOUT,
                   env={"PORTSPEED_ACCELERATOR": f"{pasted[0]}:DayOneAccelerator", "PORTSPEED_TESTDEV_BARE": BARE}
                   ).check()
    got = parse_losses(res.stdout)
    assert sorted(got) == list(range(1, ITERS + 1)), res.stdout[-2000:]
    what = f"{spec} {norm} {' '.join(layout) or 'dp2'} on the bare device, lines pasted, vs CPU TP1"
    worst = _assert_close(got, cpu_tp1, FP32_TOL, what)
    for it in cpu_tp1:
        assert got[it][1] == pytest.approx(cpu_tp1[it][1], rel=1e-4), f"{what}: iteration {it}: grad norm differs"
    print(f"{what}: max |diff| {worst:.3g}")


#: Megatron's attention dropout runs inside its RNG tracker's fork (the tensor-parallel region's own state), the
#: hidden dropout on the default state: both, on the local spec (its core attention forks; TP2: a state per rank)
DROPOUT = ["--tp", "2", "--attention-dropout", "0.1", "--hidden-dropout", "0.1"]


@pytest.mark.testdev
@pytest.mark.megatron
def test_dropout_on_the_host_generator_forks_as_on_cpu(pasted: tuple[Path, int, str], cpu_tp1: dict) -> None:
    """host-rng with host_generator = True pasted: Megatron's RNG tracker (tensor_parallel.random, through portspeed)
    seeds, saves, restores and forks the generator the device's dropout really draws from, the host's; so TP2 with
    dropout 0.1 on the bare device equals the same run on CPU (where the device generator is the host's too) within
    1e-5. Had the tracker forked a generator nothing draws from, the attention dropout would draw on from the
    default state and part from CPU. The dropout is on: iteration 1 differs from the run without it by > 1e-3."""
    from test_example_layouts import TE
    from test_megatron_core_parity import FP32_TOL, _assert_close

    args = [*TE, "--iters", str(ITERS), *DROPOUT]
    args[args.index("transformer_engine")] = "local"
    cpu = parse_losses(torchrun("examples/pretrain_gpt.py", 2, args, timeout=TIMEOUT,
                                env={"PORTSPEED_ACCELERATOR": "cpu"}).check().stdout)
    bare = parse_losses(torchrun("examples/pretrain_gpt.py", 2, args, timeout=TIMEOUT,
                                 env={"PORTSPEED_ACCELERATOR": f"{pasted[0]}:DayOneAccelerator",
                                      "PORTSPEED_TESTDEV_BARE": BARE}).check().stdout)
    assert sorted(cpu) == sorted(bare) == list(range(1, ITERS + 1)), (cpu, bare)
    assert abs(cpu[1][0] - cpu_tp1[1][0]) > 1e-3, (cpu, cpu_tp1)
    worst = _assert_close(bare, cpu, FP32_TOL, "TP2 with dropout on the bare device (host-rng) vs CPU")
    print(f"TP2 with dropout, bare device vs CPU: max |diff| {worst:.3g}")


@pytest.mark.testdev
@pytest.mark.megatron
def test_without_the_lines_the_tp2_job_ends_at_start_naming_the_stub_ccls_wrong_collective() -> None:
    """The day-one file as shipped, TP2 on the bare device: the start check (portspeed.comm.ccl_check) ends the job
    when its default group is made, before iteration 1, in one line naming the stub's wrong collective, what it got
    and the line to paste."""
    from test_example_layouts import TE

    res = torchrun("examples/pretrain_gpt.py", 2, [*TE, "--iters", "1", "--tp", "2"], timeout=TIMEOUT,
                   env={"PORTSPEED_ACCELERATOR": f"{EXAMPLE}:DayOneAccelerator", "PORTSPEED_TESTDEV_BARE": BARE})
    assert res.returncode != 0 and "iteration 1" not in res.stdout, (res.stdout + res.stderr)[-3000:]
    line = next((ln for ln in res.stderr.splitlines() if "CclCheckError: " in ln), "")
    assert "portspeed: the collective library 'testccl' of adapter 'day-one' is wrong, found when the default " \
           "group was made (2 ranks): all_reduce: rank " in line, res.stderr[-3000:]
    assert "want [3, 6, 9, 12] (wrong: all_reduce, broadcast, all_gather_into_tensor" in line, line
    assert 'paste into the adapter class DayOneAccelerator: backend = "staged"' in line, line


def test_every_view_call_that_reaches_the_adapter_is_made_by_conformance() -> None:
    """conformance/view_calls.CALLS covers each name of the torch.cuda view that reaches the adapter (its Delegate
    and hand-written entries, the nvtx and amp namespaces); constants, refusals and torch's types are not asked."""
    from portspeed.translation.cuda_rules import Delegate, Namespace, Use
    from portspeed.translation.cuda_view import CUDA_API
    from portspeed.conformance.view_calls import CALLS

    served = {n for n, r in CUDA_API.items() if isinstance(r, (Delegate, Use))}
    served |= {f"{n}.{m}" for n, r in CUDA_API.items() if isinstance(r, Namespace) and n in ("nvtx", "amp")
               for m in r.members}
    served -= {"_lazy_call", "_initialized"}  # not calls into the adapter: run the callback now; a constant
    served |= {"reset_max_memory_allocated"}  # an Alias of reset_peak_memory_stats, made on its own
    assert served == set(CALLS), (sorted(served - set(CALLS)), sorted(set(CALLS) - served))


@pytest.mark.parametrize("line,words", [
    ("wrong_torch_ops = ('sdpa',)", "wrong_torch_ops names 'sdpa', not an operation of the portable Transformer"),
    ("total_memory_bytes = -1", "total_memory_bytes = -1; give the device's memory in bytes as a positive int"),
])
def test_a_declaration_of_the_wrong_kind_is_refused_naming_it(line: str, words: str) -> None:
    """wrong_torch_ops naming no TE operation, or a total_memory_bytes that is no byte count: refused at class
    definition with AdapterContractError naming the attribute."""
    from portspeed.vendor import AdapterContractError, PrivateUse1Accelerator

    with pytest.raises(AdapterContractError, match=words.replace("(", r"\(")):
        exec(f"class Acme(PrivateUse1Accelerator):\n    name = 'acme'\n    device_type = 'acme'\n"
             f"    backend = 'accl'\n    {line}\n", {"PrivateUse1Accelerator": PrivateUse1Accelerator})


def test_a_view_call_the_device_cannot_serve_is_named_with_the_method_to_override() -> None:
    """An adapter whose current_stream raises: the view checks name torch.cuda.current_stream, what it raised and
    the adapter method to override; the summary line fails."""
    from portspeed.accelerator import reset_accelerator, set_accelerator
    from portspeed.adapters.cpu import CpuAccelerator
    from portspeed.conformance.report import Report
    from portspeed.conformance.view_calls import CALLS, run_view_checks

    class NoStreams(CpuAccelerator):
        name = "no-streams"

        def current_stream(self, index: int | None = None) -> None:
            raise RuntimeError("streams are not implemented")

    acc = NoStreams()
    set_accelerator(acc)
    try:
        report = Report("no-streams")
        run_view_checks(acc, report)
    finally:
        reset_accelerator()
    failed = {c.name: c.detail for c in report.checks if not c.ok}
    assert failed["torch.cuda.current_stream answers on the device"] == (
        "raised RuntimeError: streams are not implemented -- override NoStreams.current_stream in the adapter")
    summary = f"{len(CALLS) - 3} of the {len(CALLS)} torch.cuda calls the view serves to Megatron and DeepSpeed " \
              "answer on the device"
    assert set(failed) == {"torch.cuda.current_stream answers on the device", "torch.cuda.stream answers on the "
                           "device", "torch.cuda.set_stream answers on the device", summary}, failed
