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

from helpers.launch import REPO, child_json, parse_losses, run_python, torchrun

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
    assert lines[0] == "    host_generator = True" and lines[2] == "    wrong_torch_ops = ('attention', 'gelu')", lines
    assert lines[3] == '    backend = "staged"', lines
    assert int(lines[1].split("=")[1]) > 0


@pytest.mark.testdev
def test_with_the_lines_pasted_conformance_exits_0(pasted: tuple[Path, int, str]) -> None:
    """The same run on the file with the lines pasted: every check passes, each declaration checked on the device."""
    _, rc, out = pasted
    assert rc == 0 and "0 failed" in out and "paste" not in out.splitlines()[-1], out[-4000:]
    assert "random ops on the device draw from the host generator, as declared (host_generator)" in out
    assert "the portable TE's attention runs portspeed's reference, which matches" in out
    assert "[  ok] kernels: torch gelu is wrong on the device, as declared (wrong_torch_ops): portspeed computes it " \
           "on the host, which matches" in out  # and the device's own gelu, asked with the host rung suspended
    assert "total memory: the device cannot say, the adapter declares total_memory_bytes" in out
    assert "[  ok] collectives: broadcast float32" in out and "[  ok] collectives: real_backend reports the real " \
        "name" in out  # every collective staged through the host, right on the stub CCL's device


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


#: (spec, layout flags) on 2 ranks: TP2 on both specs (the portable TE's linears and Megatron's own
#: tensor-parallel layers communicate differently), PP2 (send/recv; from the initial weights, TE spec) and DP2 (the
#: gradient all-reduce) once each: the pipeline schedule and DDP do not depend on the spec
BARE_LAYOUTS = [pytest.param("transformer_engine", ["--tp", "2"], id="te-tp2"),
                pytest.param("transformer_engine", ["--pp", "2"], id="te-pp2"),
                pytest.param("local", ["--tp", "2"], id="local-tp2"),
                pytest.param("local", [], id="local-dp2")]


@pytest.mark.testdev
@pytest.mark.megatron
@pytest.mark.parametrize("spec,layout", BARE_LAYOUTS)
def test_each_layout_on_the_bare_device_with_the_lines_pasted_equals_cpu_tp1(
        spec: str, layout: list[str], pasted: tuple[Path, int, str], cpu_tp1: dict,
        request: pytest.FixtureRequest) -> None:
    """The example GPT (RMSNorm) on 2 ranks of the bare device (every fault, the stub CCL included) with the pasted
    file: its losses equal CPU TP1's within 1e-5 at every iteration (grad norms within 1e-4 relative), its
    collectives staged through the host. (With the file as shipped the job ends at start: the next test.)"""
    from test_example_layouts import TE
    from test_megatron_core_parity import FP32_TOL, _assert_close

    args = [*TE, "--iters", str(ITERS), *layout]
    args[args.index("transformer_engine")] = spec
    if "--pp" in layout:
        args += ["--load", request.getfixturevalue("cpu_init"), "--finetune"]
    res = torchrun("examples/pretrain_gpt.py", 2, args, timeout=TIMEOUT,
                   env={"PORTSPEED_ACCELERATOR": f"{pasted[0]}:DayOneAccelerator", "PORTSPEED_TESTDEV_BARE": BARE}
                   ).check()
    got = parse_losses(res.stdout)
    assert sorted(got) == list(range(1, ITERS + 1)), res.stdout[-2000:]
    what = f"{spec} {' '.join(layout) or 'dp2'} on the bare device, lines pasted, vs CPU TP1"
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


_PROBE = '''
    import datetime, json
    import torch, torch.distributed as dist
    import portspeed.testing.testdev.runtime as rt
    dev = torch.device("testdev", 0)
    got = {"faults": list(rt.bare_faults()),
           "shallow": torch._has_compatible_shallow_copy_type(torch.empty(1), torch.empty(1, device=dev))}
    try:
        torch.accelerator.get_memory_info(0)
        got["memory"] = "answered"
    except NotImplementedError:
        got["memory"] = "NotImplementedError"
    q = torch.randn(1, 2, 8, 16)
    got["sdpa"] = torch.allclose(torch.nn.functional.scaled_dot_product_attention(q.to(dev), q.to(dev), q.to(dev))
                                 .cpu(), torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-5)
    x = torch.randn(64)
    got["gelu"] = [round((torch.nn.functional.gelu(x.to(dev)).cpu().abs().max() /
                         torch.nn.functional.gelu(x).abs().max()).item(), 4)]
    xd = x.to(dev).requires_grad_()
    torch.nn.functional.gelu(xd).sum().backward()
    xh = x.clone().requires_grad_()
    torch.nn.functional.gelu(xh).sum().backward()
    got["gelu"].append(round((xd.grad.cpu().abs().max() / xh.grad.abs().max()).item(), 4))
    host = torch.get_rng_state()
    torch.nn.functional.dropout(torch.ones(64, device=dev), 0.5)
    got["host_rng"] = not torch.equal(host, torch.get_rng_state())
    dist.init_process_group("testccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    out = torch.zeros(4, device=dev)
    dist.all_gather_into_tensor(out, torch.arange(1.0, 5.0, device=dev))
    got["all_gather"] = out.cpu().tolist()
    dist.destroy_process_group()
    import portspeed
    got["adapter"] = portspeed.get_accelerator().name  # selection: detects the shallow-copy answer, fixes it
    m = torch.nn.Linear(2, 2)
    w = m.weight
    w.tensor_model_parallel = True
    m.to(dev)
    got["kept"] = m.weight is w and getattr(m.weight, "tensor_model_parallel", False)
    print(json.dumps(got))
'''


@pytest.mark.testdev
@pytest.mark.parametrize("bare", ["", "all"])
def test_each_switch_plants_its_fault_and_the_default_is_unchanged(bare: str) -> None:
    """PORTSPEED_TESTDEV_BARE=all: no shallow-copy kernel, memory info raises, SDPA wrong, random ops on the host
    generator, the CCL moves nothing, gelu and its gradient 1.25x; unset: none of these. On both, module.to keeps the
    Parameter after selection (on the bare device because portspeed registered the kernel)."""
    got = child_json(_PROBE, timeout=TIMEOUT, env={"PORTSPEED_TESTDEV_BARE": bare, "PORTSPEED_ACCELERATOR": "testdev"})
    on = bool(bare)
    assert got["faults"] == (["no-memory-info", "no-shallow-copy", "wrong-sdpa", "host-rng", "stub-ccl",
                              "wrong-gelu"] if on else []), got
    assert got["gelu"] == ([1.25, 1.25] if on else [1.0, 1.0]), got
    assert got["shallow"] is not on and got["memory"] == ("NotImplementedError" if on else "answered"), got
    assert got["sdpa"] is not on and got["host_rng"] is on, got
    assert got["all_gather"] == ([0.0] * 4 if on else [1.0, 2.0, 3.0, 4.0]), got
    assert got["adapter"] == "testdev" and got["kept"] is True, got


def test_a_bare_value_that_names_no_fault_is_refused_in_one_line() -> None:
    """A typo in PORTSPEED_TESTDEV_BARE is refused before the library loads, listing the faults."""
    from portspeed.testing.testdev.bare import BareValueError, faults

    assert faults("wrong-sdpa, host-rng") == ("wrong-sdpa", "host-rng")
    assert faults("all") == ("no-memory-info", "no-shallow-copy", "wrong-sdpa", "host-rng", "stub-ccl", "wrong-gelu")
    with pytest.raises(BareValueError, match="'wrong-sdp' is not a fault of the bare test device; give a comma "
                                             "list of no-memory-info, no-shallow-copy"):
        faults("wrong-sdp")


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
