"""Checkpoints and faults of the example trainer under `portspeed run`: layouts, a crashed save, a dead rank, two nodes.

Each is a real multi-process run on 127.0.0.1 (Megatron-Core, Gloo), compared with an
uninterrupted run of the same layout from the same initial checkpoint:

- cross-layout resume: saved in TP2xPP2, resumed in TP1 and in DP2;
- crash during save: a rank dies half-way through writing checkpoint 4; the tracker stays on 2,
  checkpoint 4 is refused as incomplete, and a resume from the tracker continues identically;
- restart: `portspeed run --max-restarts 1` with a rank that dies once (not again after the
  restart: TORCHELASTIC_RESTART_COUNT), resumed from the last checkpoint, names the rank last;
- two nodes: two `portspeed run` agents (static rendezvous, --node-rank 0/1) on this machine,
  TP2 inside each node and DP2 across, equal to the one-node run of 4 ranks.

Slow (15 minutes on the 2 cores shared with other jobs; the restart test alone 40 s when they were quiet):
`make test-faults`, not CI. No timed assertions: each
run is bounded by its subprocess timeout only; measured figures are in docs/reliability.md.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.gpt_example import MODEL, SCRIPT  # noqa: E402
from helpers.launch import REPO, Result, _env, free_port, parse_losses, run_python  # noqa: E402

from portspeed.parity import checkpoints  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron, pytest.mark.faults]

TIMEOUT = 400
#: fp32 resume tolerance (the issue's): a resumed run continues the uninterrupted one within this
RESUME_TOL = 1e-6


def _prun(nproc: int, args: list[str], *, launcher: list[str] = (), env: dict | None = None) -> Result:
    """`portspeed run --nproc-per-node N [launcher...] examples/pretrain_gpt.py MODEL args`; not checked."""
    cmd = ["-m", "portspeed.cli", "run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *launcher, SCRIPT, *MODEL, *args]
    return run_python(cmd, timeout=TIMEOUT, env=env)


def _losses(res: Result, first: int, last: int) -> dict[int, float]:
    got = {i: v[0] for i, v in parse_losses(res.stdout).items()}
    assert sorted(got) == list(range(first, last + 1)), f"iterations {sorted(got)}\n{res.stderr[-3000:]}"
    return got


def _worst(got: dict[int, float], want: dict[int, float]) -> float:
    return max(abs(got[i] - want[i]) for i in got)


@pytest.fixture(scope="module")
def init(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("init") / "ckpt")
    _prun(1, ["--iters", "0", "--save", path]).check()
    return path


@pytest.fixture(scope="module")
def tp1(init: str) -> dict[int, float]:
    return _losses(_prun(1, ["--iters", "10", "--load", init, "--finetune"]).check(), 1, 10)


@pytest.fixture(scope="module")
def tp2(init: str) -> dict[int, float]:
    """Uninterrupted TP2, 6 iterations: the reference of the crash and restart tests."""
    return _losses(_prun(2, ["--tp", "2", "--train-iters", "6", "--load", init, "--finetune"]).check(), 1, 6)


def test_tp2xpp2_checkpoint_resumes_in_tp1_and_dp2(init: str, tp1: dict, tmp_path: Path) -> None:
    """Saved by TP2xPP2 after 5 iterations (model + optimizer); resumed in TP1 and DP2, iterations 6..10
    equal the uninterrupted run of the new layout (TP1 and DP2 agree with each other within 1e-5 anyway)."""
    mid = str(tmp_path / "mid")
    head = _losses(_prun(4, ["--tp", "2", "--pp", "2", "--iters", "5", "--load", init, "--finetune", "--save", mid])
                   .check(), 1, 5)
    assert _worst(head, {i: tp1[i] for i in head}) <= 1e-5
    dp2 = _losses(_prun(2, ["--iters", "10", "--load", init, "--finetune"]).check(), 1, 10)
    for nproc, ref, name in ((1, tp1, "tp1"), (2, dp2, "dp2")):
        tail = _losses(_prun(nproc, ["--iters", "5", "--load", mid]).check(), 6, 10)
        worst = _worst(tail, ref)
        print(f"tp2xpp2 -> {name}: max |diff| {worst:.3g}")
        assert worst <= RESUME_TOL, f"resumed in {name}: max |diff| {worst:.3g} > {RESUME_TOL}"


def test_crash_during_save_keeps_the_previous_checkpoint(init: str, tp2: dict, tmp_path: Path) -> None:
    save = tmp_path / "ck"
    common = ["--tp", "2", "--load", init, "--finetune", "--save", str(save), "--save-interval", "2", "--resume",
              "--train-iters", "6"]
    res = _prun(2, [*common, "--fail-at", "1:4:save"], env={"PORTSPEED_TIMEOUT": "60"})
    assert res.returncode == 1, res.stderr[-3000:]
    assert "dying while writing checkpoint 4" in res.stderr
    assert checkpoints.read_tracker(save) == 2, "the tracker moved to a checkpoint that was never completed"
    assert (save / "iter_0000004").is_dir(), "the save of checkpoint 4 did not start: the fault tested nothing"
    with pytest.raises(checkpoints.CheckpointError, match="incomplete"):
        checkpoints.resolve(save / "iter_0000004")
    assert checkpoints.resolve(save) == (save / "iter_0000002", 2)
    resumed = _prun(2, common).check()
    tail = _losses(resumed, 3, 6)
    worst = _worst(tail, tp2)
    print(f"crash during save: resumed from 2, max |diff| {worst:.3g}")
    assert worst <= RESUME_TOL
    assert checkpoints.read_tracker(save) == 6


def test_restart_after_a_dead_rank_resumes_and_names_it(init: str, tp2: dict, tmp_path: Path) -> None:
    """Rank 1 dies at iteration 3 (after checkpoint 2) in the first attempt only; torchrun restarts the group,
    which resumes from checkpoint 2 and ends with the uninterrupted losses; the last line names rank 1."""
    save = tmp_path / "ck"
    res = _prun(2, ["--tp", "2", "--load", init, "--finetune", "--save", str(save), "--save-interval", "2",
                    "--resume", "--train-iters", "6", "--fail-at", "1:3"],
                launcher=["--max-restarts", "1"], env={"PORTSPEED_TIMEOUT": "60"}).check()
    assert res.stderr.count("exiting on purpose") == 1, "the fault fired again after the restart"
    last = res.stderr.strip().splitlines()[-1]
    assert re.search(r"finished after 1 restart \(attempt 1: rank 1 \(local rank 1 on \S+\) exit code 17\)", last), last
    # the second attempt printed 3..6 after the first printed 1..2: the last value of each iteration wins
    got = {i: v[0] for i, v in parse_losses(res.stdout).items()}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert len(re.findall(r"iteration 3 \|", res.stdout)) == 1, "iteration 3 ran twice: not resumed from checkpoint 2"
    worst = _worst(got, tp2)
    print(f"restart: max |diff| {worst:.3g}")
    assert worst <= RESUME_TOL


def test_two_nodes_equal_one_node(init: str, tmp_path: Path) -> None:
    """Two agents, --nnodes 2 --node-rank 0/1, static rendezvous on 127.0.0.1: TP2 per node, DP2 across (4 ranks)."""
    port = free_port()
    args = [SCRIPT, *MODEL, "--tp", "2", "--iters", "5", "--load", init, "--finetune"]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "portspeed.cli", "run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env({"PORTSPEED_TIMEOUT": "120"}), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for _, e in outs)
    # the loss is printed by the last pipeline stage's TP rank 0 of DP rank 0: global rank 0, on node 0
    two = {i: v[0] for i, v in parse_losses(outs[0][0]).items()}
    assert sorted(two) == [1, 2, 3, 4, 5] and not parse_losses(outs[1][0])
    one = _losses(_prun(4, ["--tp", "2", "--iters", "5", "--load", init, "--finetune"]).check(), 1, 5)
    worst = _worst(two, one)
    print(f"two nodes vs one node: max |diff| {worst:.3g}")
    assert worst <= RESUME_TOL
