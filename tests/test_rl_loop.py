"""Megatron-Core from an RL trainer's own loop (examples/rl_actor_loop.py): parity across layouts and devices.

The loop is the user's code: its own ``torch.cuda.set_device / current_device / synchronize /
memory_allocated`` and ``.cuda()`` calls are translated only because PORTSPEED_FRAMEWORK_MODULES
names ``__main__``. One TP1 run writes the shared initial weights and the reference records
(every policy update's loss and grad norm, every token's log-prob computed forward-only through
``get_forward_backward_func``); each layout starts from those weights and must match within
1e-5 (fp32), log-probs included. The TP2 run also saves after step 2; a TP1 run resumed from it
must give step 3 of the uninterrupted TP1 run. Kept cheap: 2 layers, hidden 64, seq 32, 3 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.launch import REPO, free_port, run_python, torchrun  # noqa: E402

from portspeed.parity import compare as compare_cli  # noqa: E402
from portspeed.parity.losslog import read_record  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]

SCRIPT = "examples/rl_actor_loop.py"
OPT_IN = {"PORTSPEED_FRAMEWORK_MODULES": "__main__"}
TESTDEV = {**OPT_IN, "PORTSPEED_ACCELERATOR": "testdev"}
STEPS, EPOCHS, TOKENS = 3, 2, 8 * 32  # the example's defaults: 3 rollout steps x 2 updates, 8 x 32 tokens each
FP32_TOL = 1e-5
TIMEOUT = 300


def _records(tmp: Path, nproc: int, args: list[str], env: dict, *, portspeed_run: bool = False) -> dict:
    """Run the loop; return {"loss": {it: (loss, grad norm)}, "logp": {token: -logp}, "meta": ...}."""
    loss, logp = tmp / "loss.json", tmp / "logp.json"
    full = [*args, "--loss-log", str(loss), "--logprob-log", str(logp)]
    if portspeed_run:  # `portspeed run`: the worker imports the adaptor before the script is __main__
        res = run_python(["-m", "portspeed.cli.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()), SCRIPT, *full], timeout=TIMEOUT, env=env)
    else:
        res = torchrun(SCRIPT, nproc, full, timeout=TIMEOUT, env=env)
    res.check()
    losses, nll = read_record(loss), read_record(logp)
    return {"loss": {e.iteration: (e.lm_loss, e.grad_norm) for e in losses.iterations},
            "logp": {e.iteration: e.lm_loss for e in nll.iterations}, "meta": losses.meta,
            "files": (loss, logp), "stdout": res.stdout}


@pytest.fixture(scope="module")
def tp1(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: TP1 writes the initial weights, then trains; its records are what every layout must give."""
    tmp = tmp_path_factory.mktemp("tp1")
    got = _records(tmp, 1, ["--save-init", str(tmp / "init")], OPT_IN)
    got["init"] = str(tmp / "init")
    assert sorted(got["loss"]) == list(range(1, STEPS * EPOCHS + 1)), got["loss"]
    assert sorted(got["logp"]) == list(range(1, STEPS * TOKENS + 1))
    assert len({round(v[0], 6) for v in got["loss"].values()}) > 2, "losses must change, or parity proves little"
    assert len({round(v, 4) for v in got["logp"].values()}) > 100, "log-probs must differ between tokens"
    return got


@pytest.fixture(scope="module")
def tp2(tp1: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """TP2 from the shared weights; it also saves model + optimizer after step 2 (for the resume test)."""
    tmp = tmp_path_factory.mktemp("tp2")
    got = _records(tmp, 2, ["--tp", "2", "--init", tp1["init"], "--save", str(tmp / "mid"), "--save-step", "2"],
                   OPT_IN)
    got["mid"] = str(tmp / "mid")
    return got


def _assert_parity(got: dict, want: dict, what: str, iterations: list[int] | None = None,
                   tokens: list[int] | None = None) -> None:
    its = iterations or sorted(want["loss"])
    assert sorted(got["loss"]) == its, f"{what}: updates {sorted(got['loss'])}"
    for it in its:
        (a, ga), (b, gb) = got["loss"][it], want["loss"][it]
        assert abs(a - b) <= FP32_TOL, f"{what}: update {it} loss {a!r} vs TP1 {b!r}"
        assert ga == pytest.approx(gb, rel=1e-4), f"{what}: update {it} grad norm {ga!r} vs TP1 {gb!r}"
    toks = tokens or sorted(want["logp"])
    assert sorted(got["logp"]) == toks, f"{what}: {len(got['logp'])} log-probs recorded, expected {len(toks)}"
    worst = max(abs(got["logp"][t] - want["logp"][t]) for t in toks)
    assert worst <= FP32_TOL, f"{what}: per-token log-probs differ from TP1 by up to {worst:.3g}"


def test_tp2_matches_tp1(tp1: dict, tp2: dict) -> None:
    _assert_parity(tp2, tp1, "tp2")
    assert tp2["meta"]["layout"]["tp"] == 2 and tp2["meta"]["accelerator"] == "cpu"
    assert (tp2["meta"]["backend"], tp2["meta"]["real_backend"]) == ("nccl", "gloo")  # the loop asked for "nccl"


LAYOUTS = [
    pytest.param(2, ["--pp", "2"], True, id="pp2-portspeed-run"),
    pytest.param(2, ["--use-distributed-optimizer"], False, id="dp2-distopt"),
    pytest.param(4, ["--tp", "2", "--pp", "2"], False, id="tp2xpp2"),
]


@pytest.mark.parametrize("nproc,extra,via_portspeed_run", LAYOUTS)
def test_layout_matches_tp1(nproc: int, extra: list[str], via_portspeed_run: bool, tp1: dict, tmp_path: Path) -> None:
    """Losses, grad norms and every token's log-prob equal TP1's (pp2 goes through `portspeed run`)."""
    got = _records(tmp_path, nproc, [*extra, "--init", tp1["init"]], OPT_IN, portspeed_run=via_portspeed_run)
    _assert_parity(got, tp1, " ".join(extra))


def test_portspeed_compare_reads_both_records(tp1: dict, tp2: dict, capsys: pytest.CaptureFixture) -> None:
    """`portspeed compare` passes TP2 against TP1 for losses and log-probs, and fails a shifted log-prob record."""
    for kind in (0, 1):
        assert compare_cli.main([str(tp1["files"][kind]), str(tp2["files"][kind])]) == 0, capsys.readouterr().out
    data = json.loads(tp2["files"][1].read_text())
    data["iterations"][7]["lm_loss"] += 1e-3  # one token's log-prob off by 1e-3: must be caught
    bad = tp2["files"][1].with_name("shifted.json")
    bad.write_text(json.dumps(data))
    assert compare_cli.main([str(tp1["files"][1]), str(bad)]) == 1


def test_resume_in_another_layout_equals_uninterrupted(tp1: dict, tp2: dict, tmp_path: Path) -> None:
    """Saved by TP2 after step 2 (model + optimizer), resumed by TP1 for step 3: equal to TP1's own step 3."""
    got = _records(tmp_path, 1, ["--resume", tp2["mid"], "--steps", "1"], OPT_IN)
    _assert_parity(got, tp1, "tp2 -> tp1 resume", iterations=[5, 6], tokens=list(range(2 * TOKENS + 1, 3 * TOKENS + 1)))


def test_without_the_opt_in_the_first_cuda_call_names_module_and_setting() -> None:
    """No PORTSPEED_FRAMEWORK_MODULES: torch's own error for the loop's torch.cuda.set_device, plus a note naming
    '__main__' and the setting; Megatron itself is still translated (the adaptor is active)."""
    res = run_python([SCRIPT, "--steps", "1"], timeout=TIMEOUT, env={"PORTSPEED_ACCELERATOR": "cpu"},
                     drop=["PORTSPEED_FRAMEWORK_MODULES"])
    assert res.returncode != 0
    err = res.stderr
    assert "torch.cuda.set_device(" in err, err[-3000:]
    assert "came from module '__main__', which portspeed does not translate" in err, err[-3000:]
    assert "PORTSPEED_FRAMEWORK_MODULES=__main__" in err, err[-3000:]


# ---------------------------------------------------------------------- on the test device
TESTDEV_LAYOUTS = [
    pytest.param(2, ["--tp", "2"], id="tp2"),
    pytest.param(2, ["--pp", "2"], id="pp2"),
    pytest.param(2, ["--use-distributed-optimizer"], id="dp2-distopt"),
    pytest.param(4, ["--tp", "2", "--pp", "2"], id="tp2xpp2"),
]


@pytest.mark.testdev
@pytest.mark.parametrize("nproc,extra", TESTDEV_LAYOUTS)
def test_testdev_layout_matches_cpu_tp1(nproc: int, extra: list[str], tp1: dict, tmp_path: Path) -> None:
    """On the test device (the loop's own torch.cuda calls answered by it) each layout equals the CPU TP1 run."""
    got = _records(tmp_path, nproc, [*extra, "--init", tp1["init"]], TESTDEV)
    assert (got["meta"]["accelerator"], got["meta"]["real_backend"]) == ("testdev", "testccl"), got["meta"]
    _assert_parity(got, tp1, "testdev " + " ".join(extra))


# ---------------------------------------------------------------------- Ray actors
def test_ray_actors_tp2_match_tp1(tp1: dict, tmp_path: Path) -> None:
    """Two Ray actors on a local cluster, each setting MASTER_ADDR/PORT, RANK, WORLD_SIZE itself and importing the
    adaptor on its module's first line (no torchrun, no `portspeed run`): TP2 equal to TP1, the adaptor active and
    torch.cuda answered by it in each actor process."""
    require("ray", "pip install -e '.[test]'")
    loss, logp = tmp_path / "loss.json", tmp_path / "logp.json"
    res = run_python(["examples/rl_ray_actors.py", "--ranks", "2", "--", "--tp", "2", "--init", tp1["init"],
                      "--loss-log", str(loss), "--logprob-log", str(logp)], timeout=TIMEOUT,
                     env={"RAY_USAGE_STATS_ENABLED": "0"}, drop=["PORTSPEED_FRAMEWORK_MODULES", "RANK", "WORLD_SIZE",
                                                                 "MASTER_*", "LOCAL_*"]).check()
    actors = [json.loads(line) for line in res.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(a["rank"] for a in actors) == [0, 1] and len({a["pid"] for a in actors}) == 2, res.stdout[-2000:]
    assert all(a["adaptor_active"] and a["torch_cuda"] == "CudaView" for a in actors), actors
    got = {"loss": {e.iteration: (e.lm_loss, e.grad_norm) for e in read_record(loss).iterations},
           "logp": {e.iteration: e.lm_loss for e in read_record(logp).iterations}}
    _assert_parity(got, tp1, "ray tp2")
    print("ray actors' CPU seconds:", [a["cpu_s"] for a in actors])


def test_import_hook_only_when_the_user_names_modules() -> None:
    """The builtins.__import__ hook that serves a module already running (the entry script) is installed only
    when the user names modules of their own, answers the view only to those, and disable() removes it."""
    from helpers.launch import child_json

    code = '''
        import builtins, json
        real = builtins.__import__
        import portspeed.megatron_adaptor
        portspeed.megatron_adaptor.activate()
        from portspeed.translation import importer as translation
        import torch                       # this module's own frame: served through the hook when named
        hooked = builtins.__import__ is not real
        view = torch is translation.torch_view()
        other = builtins.__import__("torch", {"__name__": "some_library"}) is translation.torch_view()
        portspeed.megatron_adaptor.deactivate()
        print(json.dumps({"hooked": hooked, "view": view, "other_gets_view": other,
                          "restored": builtins.__import__ is real}))
    '''
    named = child_json(code, timeout=120, env={"PORTSPEED_ACCELERATOR": "cpu", **OPT_IN})
    assert named == {"hooked": True, "view": True, "other_gets_view": False, "restored": True}, named
    plain = child_json(code, timeout=120, env={"PORTSPEED_ACCELERATOR": "cpu"}, drop=["PORTSPEED_FRAMEWORK_MODULES"])
    assert plain == {"hooked": False, "view": False, "other_gets_view": False, "restored": True}, plain
