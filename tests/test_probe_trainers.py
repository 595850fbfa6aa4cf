"""The probe and ``--perf`` under DeepSpeed's engine and the Hugging Face Trainer: iterations seen with no edit,
losses unchanged.

``tests/data/probe_trainers.py`` (no portspeed line in it) launched by ``portspeed run --probe`` / ``--perf``:
- DeepSpeed (ZeRO-0, 2 ranks, 2 accumulated micro-batches per step): the iteration is the accumulation
  cycle (``global_steps + 1``), not each ``engine.step()``; the probed launch's losses equal those of a launch
  timed with ``--perf`` bit for bit (neither changes them), and the timing has each layer's forward and backward
  twice an iteration and the gradients' all_reduce;
- the HF Trainer without DeepSpeed (2 accumulated micro-batches per step): the iteration is
  ``state.global_step + 1``; probed and timed in one launch, trained a second time in it with the probe's
  callback taken off, the losses are the same.
No launch of its own for ``--perf``: it rides on the launches the probe needs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers.requires import require

require("deepspeed", "pip install 'portspeed[deepspeed]'")
require("transformers", "pip install -e '.[test]'")

from helpers.launch import free_port, parse_losses, run_python  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.deepspeed]

SCRIPT = "tests/data/probe_trainers.py"
TIMEOUT = 300


def _run(nproc: int, adaptor: str, probe: list[str], args: list[str]):
    return run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                       "--master-port", str(free_port()), "--adaptor", adaptor, *probe, SCRIPT, *args],
                      timeout=TIMEOUT, drop=("PORTSPEED_*",))


def _step(folder: Path, step: int, rank: int) -> dict:
    text = (folder / f"step{step}" / f"rank{rank}" / "dump.json").read_text()
    assert '"_slot"' not in text, "a tensor record was written before its statistics"
    d = json.loads(text)
    d["data"] = {k: {**{f: v for f, v in e.items() if f != "ps"}, **{f"ps_{f}": v for f, v in e["ps"].items()}}
                 for k, e in d["data"].items()}
    return d


def _timed(folder: Path, rank: int, framework: str) -> list[dict]:
    """The ``--perf`` lines of ``rank``, after checking each is one iteration of ``framework`` with both layers'
    forward and backward timed once per micro-batch (2 an iteration: the accumulation cycle)."""
    got = [json.loads(t) for t in (folder / f"rank{rank}.jsonl").read_text().splitlines() if t.strip()]
    for line in got:
        calls = {(p["path"], p["phase"]): p["calls"] for p in line["parts"]}
        assert line["framework"] == framework and line["step_ms"] > 0, line
        assert all(calls.get((m, ph)) == 2 for m in ("body.0", "body.2") for ph in ("forward", "backward")), calls
    return got


def test_deepspeed_iteration_is_the_accumulation_cycle(tmp_path: Path) -> None:
    timed = tmp_path / "perf"
    base = parse_losses(_run(2, "deepspeed", ["--perf", str(timed), "--perf-iterations", "2:3"],
                             ["deepspeed"]).check().stdout)
    out = tmp_path / "probe"
    res = _run(2, "deepspeed", ["--probe", str(out), "--probe-iterations", "2:3"], ["deepspeed"]).check()
    assert sorted(base) == [1, 2, 3] and parse_losses(res.stdout) == base, \
        "probing or timing changed DeepSpeed's losses"
    for rank in (0, 1):
        lines = _timed(timed, rank, "deepspeed")
        assert [t["iteration"] for t in lines] == [2, 3], lines
        assert all([c["op"] for c in t["collectives"]] == ["all_reduce"] for t in lines), "ZeRO-0's gradient sum"
    assert sorted(str(p.relative_to(out)) for p in out.glob("step*/rank*")) == [
        "step2/rank0", "step2/rank1", "step3/rank0", "step3/rank1"]
    d = _step(out, 3, 1)
    assert d["portspeed"]["framework"] == "deepspeed" and d["portspeed"]["micro_batches"] == 2
    data = d["data"]
    assert {"Module.body.0.Linear.forward.1", "Module.body.0.Linear.backward.1"} <= set(data)  # engine stripped
    assert "Module.body.0.Linear.forward.2" not in data  # two micro-batches per iteration, not one per step()
    assert data["Module.body.0.Linear.parameters_grad.0"]["weight"][0]["shape"] == [16, 8]  # ZeRO-0: full grads
    assert "Module.body.2.Linear.parameters_updated.0" in data


def test_hf_trainer_iteration_is_the_global_step(tmp_path: Path) -> None:
    out, timed = tmp_path / "probe", tmp_path / "perf"
    res = _run(1, "megatron", ["--probe", str(out), "--probe-iterations", "2:3", "--perf", str(timed),
                               "--perf-iterations", "2:3"], ["trainer", "--out", str(tmp_path / "trainer")]).check()
    plain = {int(m[1]): m[2] for m in re.finditer(r"^plain iteration (\d+) \| lm loss: (\S+)", res.stdout, re.M)}
    probed = {int(m[1]): m[2] for m in re.finditer(r"^iteration (\d+) \| lm loss: (\S+)", res.stdout, re.M)}
    assert sorted(plain) == [1, 2, 3] and probed == plain, res.stdout[-2000:]
    assert sorted(str(p.relative_to(out)) for p in out.glob("step*/rank*")) == ["step2/rank0", "step3/rank0"]
    d = _step(out, 2, 0)
    assert d["portspeed"]["framework"] == "hf-trainer" and d["portspeed"]["micro_batches"] == 2
    assert {"Module.body.0.Linear.forward.1", "Module.body.2.Linear.backward.1",
            "Module.body.0.Linear.parameters_grad.0", "Module.body.0.Linear.parameters_updated.0"} <= set(d["data"])
    # both trainings of the launch are timed (the second Trainer counts its global steps from 0 again)
    assert [t["iteration"] for t in _timed(timed, 0, "hf-trainer")] == [2, 3, 2, 3]
