"""Where a port is slow: `portspeed run --perf` recordings of the example trainer, read by `portspeed compare --perf`.

The example trainer (megatron-core on CPU + Gloo, and the C++ test device), a 2-layer GPT, timed with no
edit through `portspeed run --perf` (and once through torchrun and ``PORTSPEED_PERF``). One module fixture
launches every run once, two at a time; each check reads one or two of them:

- planted slowness, named by the parsed first line: decoder layer 1's MLP sleeping on the test device
  (against the CPU: across devices), ``.item()`` host round trips in the same MLP (named with their
  count: 4 per forward x 2 micro-batches), and, in TP2, rank 1 sleeping in every layer's MLP (named from
  the one run as the slow rank, busy computing; against the clean TP2 run, rank 1 is in the first line);
- no false alarm: two clean runs of the same configuration exit 0, and the clean TP2 run has no slow rank;
- an own loop marked with ``portspeed.perf.iteration``: its spans, backward included, and its syncs.

No check reads a time against a bound: the plants are an order of magnitude above the threshold, and the
threshold is the one `portspeed compare --perf` uses. What is refused, and nothing when off: test_perf_refusals.py.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.launch import Result, child_json, free_port, run_python  # noqa: E402
from portspeed.parity import compare as compare_cli  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]

SCRIPT = "examples/pretrain_gpt.py"
#: the smallest GPT with two layers and two micro-batches per iteration; iterations 2-6 timed (1 warms up)
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
         "--seed", "1234", "--iters", "6"]
MICRO_BATCHES = 2
ITEMS = 4  # .item() calls per planted forward
TIMEOUT = 300
PERF = ["--perf-iterations", "2:6"]

#: name -> (ranks, the example's flags, environment); "clean-b" goes through torchrun and PORTSPEED_PERF*
RUNS: dict[str, tuple[int, list[str], dict[str, str]]] = {
    "tp2": (2, [*MODEL, "--tp", "2"], {}),
    "tp2-slow-rank": (2, [*MODEL, "--tp", "2", "--plant-slow", "*:60:1"], {}),
    "testdev-slow": (1, [*MODEL, "--plant-slow", "1:40"], {"PORTSPEED_ACCELERATOR": "testdev"}),
    "clean-a": (1, MODEL, {}),
    "clean-b": (1, MODEL, {}),
    "item": (1, [*MODEL, "--plant-item", f"1:{ITEMS}"], {}),
}

_FIRST = re.compile(r"^slowest part: iteration (?P<iteration>\d+), (?P<module>\S+) (?P<phase>\S+)"
                    r"(?: op (?P<op>\S+))?, rank (?P<rank>\d+): (?P<run>[\d.]+)% of the step on RUN vs "
                    r"(?P<ref>[\d.]+)% on REF \(\+(?P<points>[\d.]+) points, (?P<ms>-?[\d.]+) ms\): (?P<cause>.*)$")


def launch_run(name: str, root: Path) -> Result:
    """One run of RUNS, its recording in root/name (a port taken between choosing and binding is retried once)."""
    n, args, env = RUNS[name]
    out = root / name
    for attempt in range(2):
        port = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        if name == "clean-b":  # plain torchrun: the settings alone switch the recording on
            cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(n), *port, SCRIPT, *args]
            env = {**env, "PORTSPEED_PERF": str(out), "PORTSPEED_PERF_ITERATIONS": "2:6"}
        else:
            cmd = ["-m", "portspeed.cli", "run", "--perf", str(out), *PERF, "--nproc-per-node", str(n), *port, SCRIPT,
                   *args]
        res = run_python(cmd, timeout=TIMEOUT, env=env, drop=("PORTSPEED_*",))
        if res.returncode == 0 or "EADDRINUSE" not in res.stderr or attempt:
            return res
        shutil.rmtree(out, ignore_errors=True)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run of RUNS: {"root": Path, name: Result}. The two TP2 runs go alone, one after the other: beside
    other jobs on two cores one of their ranks is starved, a real slow rank that the clean run's report would
    rightly name, and that made the planted slow rank wait too (read as "waiting", not "busy computing", with
    another run beside it at load 10, 2026-11-29); then the others two at a time."""
    root = tmp_path_factory.mktemp("perf")
    alone = ("tp2", "tp2-slow-rank")
    got = {k: launch_run(k, root) for k in alone}
    rest = [k for k in RUNS if k not in alone]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got.update(zip(rest, pool.map(lambda k: launch_run(k, root), rest)))
    return {"root": root, **got}


def recording(runs: dict[str, Any], name: str) -> Path:
    runs[name].check()
    return runs["root"] / name


def compare(*args: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = compare_cli.main(["--perf", *map(str, args)], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def first(out: str) -> dict[str, str]:
    m = _FIRST.match(out.splitlines()[0] if out else "")
    assert m, f"no 'slowest part' line:\n{out[:3000]}"
    return m.groupdict()


def lines(folder: Path, rank: int = 0) -> list[dict[str, Any]]:
    return [json.loads(t) for t in (folder / f"rank{rank}.jsonl").read_text().splitlines() if t.strip()]


# ------------------------------------------------------------------ no false alarm, and what a recording holds


def test_two_clean_runs_of_the_same_configuration_name_no_part(runs: dict[str, Any]) -> None:
    """portspeed run --perf and torchrun + PORTSPEED_PERF, same configuration: exit 0, the threshold printed."""
    code, out, err = compare(recording(runs, "clean-a"), recording(runs, "clean-b"))
    assert code == 0 and out.startswith("no slow part: no part's share of the step grew by more than "), out + err
    assert re.search(r"threshold \d+(\.\d+)? points", out.splitlines()[1]), out[:2000]


def test_a_recording_times_every_layer_forward_and_backward_on_the_host_clock(runs: dict[str, Any]) -> None:
    """Iterations 2-6, one line each; every decoder layer's module has a forward and a backward part, the step is
    covered by the parts (their own times add up to the step), the clock and what saw the host syncs are named."""
    got = lines(recording(runs, "clean-a"))
    assert [g["iteration"] for g in got] == [2, 3, 4, 5, 6]
    for line in got:
        assert (line["clock"], line["syncs_seen_by"], line["layout"]["tp"]) == ("host", "tensor-methods", 1), line
        keys = {(p["path"], p["phase"]) for p in line["parts"]}
        for layer in (0, 1):
            for sub in ("", ".self_attention", ".mlp", ".mlp.linear_fc1"):
                for phase in ("forward", "backward"):
                    assert (f"decoder.layers.{layer}{sub}", phase) in keys, (layer, sub, phase, sorted(keys))
        own = sum(p["self_ms"] for p in line["parts"])
        assert own == pytest.approx(line["step_ms"], rel=0.02), (own, line["step_ms"])
        mlp = next(p for p in line["parts"] if p["path"] == "decoder.layers.1.mlp" and p["phase"] == "forward")
        assert mlp["calls"] == MICRO_BATCHES and not mlp["syncs"], mlp
        assert not any("peak_bytes" in p for p in line["parts"])  # the CPU adapter keeps no allocator statistics


# ------------------------------------------------------------------ planted slowness, named


@pytest.mark.testdev
def test_a_module_slowed_on_the_test_device_is_named_against_the_cpu(runs: dict[str, Any]) -> None:
    """Layer 1's MLP sleeping 40 ms a forward on the test device, against the clean CPU run: that module, forward,
    named; the test device's timing events are the clock, its CPU-fallback ops are counted, and each module has
    its peak device memory."""
    run = recording(runs, "testdev-slow")
    assert {(line["clock"], line["syncs_seen_by"]) for line in lines(run)} == {("device-events", "dispatch")}
    for line in lines(run):  # the device keeps allocator statistics: a peak per module, an outer one no lower
        peak = {(p["path"], p["phase"]): p.get("peak_bytes") for p in line["parts"]}
        chain = [peak[(m, "forward")] for m in ("decoder", "decoder.layers.1", "decoder.layers.1.mlp")]
        assert all(isinstance(b, int) and b > 0 for b in chain) and chain == sorted(chain, reverse=True), chain
    code, out, _ = compare(recording(runs, "clean-a"), run)
    got = first(out)
    assert code == 1 and (got["module"], got["phase"], got["rank"]) == ("decoder.layers.1.mlp", "forward", "0"), out
    assert "ran through the CPU fallback" in got["cause"], got["cause"]


def test_a_planted_item_round_trip_is_named_with_its_count(runs: dict[str, Any]) -> None:
    """.item() x4 in layer 1's MLP forward: that module named, the cause counting 4 x 2 micro-batches, REF none."""
    code, out, _ = compare(recording(runs, "clean-a"), recording(runs, "item"))
    got = first(out)
    assert code == 1 and (got["module"], got["phase"]) == ("decoder.layers.1.mlp", "forward"), out[:2000]
    n = ITEMS * MICRO_BATCHES
    assert f"{n} host syncs (.item() x{n}; REF 0)" in got["cause"], got["cause"]


def test_a_slow_rank_in_tp2_is_named_from_one_run(runs: dict[str, Any], tmp_path: Path) -> None:
    """Rank 1 sleeping in every layer's MLP: the one run names rank 1, busy computing, and its slowest part (and
    its Chrome trace has both ranks' spans and collectives); the clean TP2 run names no slow rank."""
    run = recording(runs, "tp2-slow-rank")
    code, out, _ = compare(run, "--chrome", tmp_path / "trace.json")
    head = out.splitlines()[0]
    assert code == 1 and head.startswith("slow rank: rank 1 arrives last at "), out[:2000]
    assert "busy computing" in head and re.search(r"decoder\.layers\.\d\.mlp forward took", head), head
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        calls = sum(len(line["collectives"]) for line in lines(run, rank))
        assert len([e for e in mine if e["cat"] == "collective"]) == calls > 0, rank
        assert {("decoder.layers.1.mlp", "forward"), ("decoder.layers.1.mlp", "backward")} <= {
            (e["name"], e["cat"]) for e in mine}, rank
    code, out, _ = compare(recording(runs, "tp2"))
    assert code == 0 and out.startswith("no slow rank: "), out[:2000]


def test_the_slow_rank_is_in_the_first_line_against_the_clean_tp2_run(runs: dict[str, Any]) -> None:
    """Against the clean TP2 run, the first line names rank 1's MLP, or a rank 0 part waiting for rank 1."""
    code, out, _ = compare(recording(runs, "tp2"), recording(runs, "tp2-slow-rank"))
    got = first(out)
    assert code == 1, out[:2000]
    assert (got["rank"], got["phase"]) == ("1", "forward") and ".mlp" in got["module"] \
        or "rank 1 arrived last" in got["cause"], out[:2000]


def test_the_shares_are_drawn_with_the_planted_module_and_the_slow_rank_in_red(runs: dict[str, Any],
                                                                                tmp_path: Path) -> None:
    """--png: against the clean run, the .item() plant's module is the bar in red, each run titled with its device
    and layout; from the one TP2 run, rank 1 is the rank in red (none in the clean TP2 run's). Each PNG is read
    back at the size drawn (tests/test_perf_plot.py checks the drawing's rules on written recordings)."""
    require("matplotlib", "pip install 'portspeed[plot]'")
    import matplotlib.image

    from portspeed.perf.reading import plot as perf_plot
    from portspeed.perf.reading.compare import THRESHOLD_POINTS, compare_runs
    from portspeed.perf.reading.recordings import read_run
    from portspeed.perf.reading.slow_rank import find_slow_rank

    code, out, _ = compare(recording(runs, "clean-a"), recording(runs, "item"), "--png", tmp_path / "cmd.png")
    assert code == 1 and first(out)["module"] == "decoder.layers.1.mlp", out[:2000]
    assert (tmp_path / "cmd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ref, run = read_run(str(recording(runs, "clean-a"))), read_run(str(recording(runs, "item")))
    drawn = perf_plot.draw_shares(ref, run, compare_runs(ref, run), THRESHOLD_POINTS, str(tmp_path / "pair.png"))
    assert drawn.highlighted == "decoder.layers.1.mlp forward" in drawn.labels, drawn.labels
    assert "REF clean-a: cpu, tp1 pp1" in drawn.title and "RUN item: cpu, tp1 pp1" in drawn.title, drawn.title
    for name, red in (("tp2-slow-rank", "rank 1"), ("tp2", None)):
        run = read_run(str(recording(runs, name)))
        ranks = perf_plot.draw_ranks(run, find_slow_rank(run), str(tmp_path / f"{name}.png"))
        assert (ranks.labels, ranks.highlighted) == (["rank 0", "rank 1"], red), (name, ranks)
    for png, size in (("cmd.png", drawn.size), ("pair.png", drawn.size), ("tp2.png", ranks.size)):
        assert matplotlib.image.imread(str(tmp_path / png)).shape[:2] == size[::-1], png


def test_an_own_loop_marked_with_the_documented_call_is_timed(tmp_path: Path) -> None:
    """portspeed.perf.iteration(n, model) on a plain torch loop: iterations 2-3 written, forward and backward of
    each layer, the .item() inside one layer counted there."""
    got = child_json(f"""
        import json, torch
        import portspeed.perf

        class Noisy(torch.nn.Linear):
            def forward(self, x):
                x.sum().item()
                return super().forward(x)

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), Noisy(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for n in range(1, 4):
            with portspeed.perf.iteration(n, model):
                model(torch.randn(4, 8, requires_grad=True)).square().sum().backward()
                portspeed.perf.forward_backward_done()
                opt.step()
                opt.zero_grad()
        rows = [json.loads(t) for t in open({str(tmp_path / 'rank0.jsonl')!r})]
        print(json.dumps([{{f"{{p['path']}} {{p['phase']}}": p["syncs"] for p in r["parts"]}} | {{"n": r["iteration"]}}
                          for r in rows]))
    """, timeout=120, env={"PORTSPEED_PERF": str(tmp_path), "PORTSPEED_PERF_ITERATIONS": "2:3",
                           "PORTSPEED_ACCELERATOR": "cpu"}, drop=("PORTSPEED_*",))
    assert [g.pop("n") for g in got] == [2, 3]
    for parts in got:
        assert {"0 forward", "0 backward", "2 forward", "2 backward", "(model) forward"} <= set(parts), parts
        assert parts["2 forward"] == {".item()": 1} and parts["0 forward"] == {}, parts


_LOOP = """
import sys, torch
import portspeed.perf

class Heavy(torch.nn.Linear):
    def forward(self, x):
        for _ in range(int(sys.argv[1])):
            x = torch.mm(x, self.weight) / 8
        return super().forward(x)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), Heavy(64, 64))
for n in range(1, 6):
    with portspeed.perf.iteration(n, model):
        model(torch.randn(256, 64)).square().sum().backward()
"""


def test_at_op_level_the_operator_that_grew_is_named(tmp_path: Path) -> None:
    """An own loop at --perf-level op, one module doing 40 extra matrix products on RUN: that module and the
    operator aten::mm are in the first line, and no other module grew (the model's output is that module's: its
    backward stays its own)."""
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    for name, extra in (("ref", "0"), ("run", "40")):
        run_python([str(script), extra], timeout=120, drop=("PORTSPEED_*",), env={
            "PORTSPEED_PERF": str(tmp_path / name), "PORTSPEED_PERF_LEVEL": "op", "PORTSPEED_PERF_ITERATIONS": "2:5",
            "PORTSPEED_ACCELERATOR": "cpu"}).check()
    code, out, _ = compare(tmp_path / "ref", tmp_path / "run")
    got = first(out)
    # the products run forward and again (twice) backward: either phase may have grown most on a loaded machine
    assert code == 1 and (got["module"], got["op"]) == ("2", "aten::mm") and got["phase"] in ("forward", "backward")
    others = [float(m[1]) for m in re.finditer(r"^ +\+([\d.]+) points .* (?:0|1|\(model\)) (?:forward|backward)$", out,
                                                  re.M)]
    assert all(p < 10 for p in others), out[:2000]  # no other module beyond the threshold
    assert {line["syncs_seen_by"] for line in lines(tmp_path / "run")} == {"dispatch"}


def _line(iteration: int, parts: list[dict[str, Any]], calls: list[dict[str, Any]] | None = None) -> str:
    rows = [{"class": "", "calls": 1, "total_ms": p["self_ms"], "syncs": {}, "copies": {}, "fallbacks": {},
             "collective_ms": 0.0, "collectives": 0, **p} for p in parts]
    return json.dumps({"format": "portspeed-perf", "version": 1, "iteration": iteration, "rank": 0, "world": 1,
                       "clock": "host", "step_ms": sum(p["self_ms"] for p in parts), "parts": rows,
                       "collectives": calls or []}) + "\n"


def test_the_cause_names_kernels_copies_and_rewrites_seen_inside(tmp_path: Path) -> None:
    """Written recordings (no run): the part that grew carries a reference kernel, a device-to-host copy and an
    AVG the router rewrote; the first line says each, with REF's kernels beside."""
    fast = {"path": "decoder.layers.0.self_attention.linear_qkv", "phase": "forward", "self_ms": 10.0,
            "kernels": {"rms_norm torch": 2}}
    rest = {"path": "decoder", "phase": "forward", "self_ms": 90.0}
    slow = dict(fast, self_ms=60.0, kernels={"rms_norm reference": 2}, copies={"d2h": [1, 4096]})
    call = {"op": "all_reduce", "group": [0], "seq": 0, "bytes": 4096, "dtype": "float32", "module": fast["path"],
            "phase": "forward", "enter": 1.0, "leave": 1.001, "rewrites": {"avg_as_sum": 1}}
    for name, part in (("ref", fast), ("run", slow)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.jsonl").write_text("".join(_line(i, [part, rest], [call]) for i in (2, 3, 4)))
    code, out, _ = compare(tmp_path / "ref", tmp_path / "run")
    got = first(out)
    assert code == 1 and (got["module"], got["phase"]) == (fast["path"], "forward"), out
    assert float(got["run"]) == pytest.approx(40.0, abs=0.05) and float(got["ref"]) == pytest.approx(10.0, abs=0.05)
    for said in ("portable TE kernels not as on REF (rms_norm reference x2; REF rms_norm torch)",
                 "1 d2h copies (4.0 KiB)", "the router rewrote collectives (all_reduce avg_as_sum x1), 1.0 ms in them"):
        assert said in got["cause"], got["cause"]


def test_a_device_without_timing_events_gets_the_host_clock_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter whose events fail: the host clock, the device synchronized at the iteration's start and end
    only (never per stamp), and the reason in the line's clock note."""
    import portspeed
    from portspeed.perf.clock import make_clock

    syncs: list[int] = []

    class NoEvents:
        device_is_host = False

        def Event(self, **kwargs: Any) -> Any:  # noqa: N802
            raise NotImplementedError("this runtime has no events")

        def synchronize(self) -> None:
            syncs.append(1)

    monkeypatch.setattr(portspeed, "get_accelerator", lambda: NoEvents())
    clock = make_clock()
    clock.start()
    stamps = [clock.stamp() for _ in range(5)]
    assert len(syncs) == 1
    ms = clock.resolve(stamps)
    assert len(syncs) == 2 and ms[0] == 0.0 and ms == sorted(ms)
    said = clock.describe()
    assert said["clock"] == "host-synchronized" and "no timing events (NotImplementedError: this runtime has no " \
        "events)" in said["clock_note"], said


@pytest.mark.testdev
def test_one_run_on_the_test_device_names_its_host_fallbacks_with_counts(runs: dict[str, Any]) -> None:
    """`compare --perf RUN` on the test device's recording ends its report with the line of the ops its first timed
    iteration ran through the CPU fallback: gelu and gelu_backward (the test device has no kernel of its own for
    them) once per layer and micro-batch, 2 x 2; views and copies, which no fallback serves, are not named."""
    _, out, _ = compare(recording(runs, "testdev-slow"))
    line = next((ln for ln in out.splitlines() if ln.startswith("host fallbacks in one training step")), "")
    assert line.startswith("host fallbacks in one training step (iteration 2, rank 0): "), out[:3000]
    named = dict(item.rsplit(" x", 1) for item in line.split(": ", 1)[1].split(" (")[0].split(", "))
    n = 2 * MICRO_BATCHES
    assert named.get("gelu") == named.get("gelu_backward") == str(n), line
    assert not {"transpose", "detach", "view", "t", "copy_", "_to_copy"} & set(named), line
    assert "register PrivateUse1 kernels for them" in line, line
