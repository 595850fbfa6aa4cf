"""`portspeed run --hang-timeout` never watches nothing; the launcher and its ranks read the recorder's settings alike.

A rank whose recorder never starts sends no heartbeat; the watchdog used to wait for one for ever. On
the planted skip (tests/data/trace_faults.py, 2 ranks, CPU/Gloo) under ``--adaptor none``, recording
never starts three ways (tests/data/trace_unrecorded.py): no adaptor imported, an adaptor imported whose
set-up waits for a framework that never comes, recording turned off on one rank. Each job must end (the run's kill bound
is the hang timeout plus start-up, not a timed assertion), and its closing lines must name the rank and the
reason. (The planted faults of tests/test_trace.py run with the adaptor and no framework import: the
worker sets the adaptor up at launch, so they are recorded and named.) ``PORTSPEED_TRACE`` spelt
``00``, ``²``, ``+5``, `` 7 `` with and without a hang timeout: refused in one line, or read the same by
the launcher and by its ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.launch import REPO, free_port, run_python

from portspeed import config
from portspeed.cli import run as launch

pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py
SCRIPT = REPO / "tests" / "data" / "trace_unrecorded.py"  # trace_faults.py, after the set-up each way asks for
HANG_S = 10
BOUND = 240  # kill bound of one run: start-up of 2 ranks on a loaded 2-core machine + HANG_S + the end


def _launch(env: dict, folder: Path, nproc: int = 2, script: Path = SCRIPT, args: tuple = ("skip",),
            hang: str | None = str(HANG_S)) -> tuple[int, list[str], str]:
    res = run_python(["-m", "portspeed.cli", "run", "--adaptor", "none", *(["--hang-timeout", hang] if hang else []),
                      "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                      str(script), *args],
                     timeout=BOUND, env={"PORTSPEED_ACCELERATOR": "cpu", "PORTSPEED_TRACE_DIR": str(folder), **env},
                     drop=["PORTSPEED_TRACE", "PORTSPEED_HANG_TIMEOUT", "PORTSPEED_FRAMEWORK_MODULES"])
    return res.returncode, [x for x in res.stderr.splitlines() if x.startswith("portspeed run:")], \
        res.stdout + res.stderr


#: way -> (environment, the ranks that never record, words of the reason)
WAYS = {
    "no-adaptor": ({"PLANT_BACKEND": "gloo"}, "ranks 0, 1", ["no adaptor was imported (--adaptor none"]),
    "adaptor-waits": ({"PLANT_BACKEND": "gloo", "PLANT_IMPORT": "portspeed.megatron_adaptor"}, "ranks 0, 1",
                      ["portspeed.megatron_adaptor is imported, but its set-up",
                       "waits for its framework's first import"]),
    "off-on-rank-1": ({"PLANT_IMPORT": "portspeed.megatron_adaptor", "PLANT_TRACE_OFF_RANK": "1",
                       "PORTSPEED_FRAMEWORK_MODULES": "__main__"}, "rank 1",
                      ["recording is off in this rank: PORTSPEED_TRACE reads 0 entries here"]),
}


@pytest.mark.parametrize("way", WAYS)
def test_a_rank_that_never_records_is_named_and_the_job_ends(way: str, tmp_path: Path) -> None:
    """The job ends (exit 1, as a hang), and its closing lines name the rank that never recorded and why."""
    env, ranks, words = WAYS[way]
    folder = tmp_path / "dumps"
    code, lines, text = _launch(env, folder)
    assert code == 1, text[-4000:]
    assert any(x.startswith(f"portspeed run: {ranks} recorded nothing for ") for x in lines), lines
    never = [x for x in lines if " never recorded a call: " in x]
    assert len(never) == 1 and never[0].startswith(f"portspeed run: {ranks} never recorded a call: "), lines
    for w in words:
        assert w in never[0], never[0]
    assert lines[-1].startswith(f"portspeed run: flight-recorder dumps in {folder}"), lines[-3:]
    assert lines.index(never[0]) == len(lines) - 2  # the reason closes the run, then the folder
    if way == "off-on-rank-1":  # rank 0 recorded: its dump is read, and rank 1 has nothing to read
        why = [x for x in lines if x.startswith("portspeed run: why-hung: ")]
        assert why and "rank 1 left no dump" in why[0], lines
        assert (folder / "portspeed_trace_rank_0").exists()


# ------------------------------------------------------------------ one reading of PORTSPEED_TRACE
#: PORTSPEED_TRACE as spelt -> entries (None: refused)
SPELLINGS = {"00": 0, "²": None, "+5": 5, " 7 ": 7, "-1": None, "٣": None}


@pytest.mark.parametrize("raw", SPELLINGS)
@pytest.mark.parametrize("hang", [None, "30", "env"])  # env: PORTSPEED_HANG_TIMEOUT=30 set by hand, no option
def test_launcher_and_ranks_read_portspeed_trace_alike(raw: str, hang: str | None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """`portspeed run` refuses the value in one line (exit 2, nothing started), or hands its workers an environment
    that the ranks read as the launcher did: recording on exactly when the launcher made a dump folder, with the
    launcher's hang timeout."""
    import torch.distributed.run as tdr

    seen: list[dict] = []
    monkeypatch.setattr(tdr, "run", lambda args: seen.append(dict(__import__("os").environ)))
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PORTSPEED_TRACE", raw)
    monkeypatch.setenv("PORTSPEED_TRACE_DIR", str(tmp_path / "dumps"))
    monkeypatch.delenv("PORTSPEED_HANG_TIMEOUT", raising=False)
    if hang == "env":
        monkeypatch.setenv("PORTSPEED_HANG_TIMEOUT", "30")
    option = ["--hang-timeout", hang] if hang and hang != "env" else []
    code = launch.main(["--adaptor", "none", *option, "train.py"])
    err = capsys.readouterr().err.strip()
    entries = SPELLINGS[raw]
    if entries is None or (entries == 0 and hang):
        assert code == 2 and len(err.splitlines()) == 1 and seen == [], err
        assert err.startswith("portspeed run: error: ") and f"PORTSPEED_TRACE={raw!r}" in err, err
        assert ("needs the flight recorder" in err) if entries == 0 else ("not a non-negative integer" in err), err
        return
    assert code == 0 and len(seen) == 1, err
    rank = config.Settings.from_env(seen[0])  # what a worker's portspeed.config reads from that environment
    launcher_records = "flight-recorder dumps go to" in err
    assert rank.trace == entries and launcher_records == (entries > 0), (rank, err)
    assert rank.hang_timeout == (30.0 if hang else None)


def test_a_real_rank_reads_what_the_launcher_read(tmp_path: Path) -> None:
    """One real `portspeed run` (1 rank): PORTSPEED_TRACE=' +5 ' with --hang-timeout is 5 entries and 60 s in the
    rank, which the launcher recorded for (its dump folder)."""
    script = tmp_path / "settings.py"
    script.write_text("import json\nfrom portspeed import config\ns = config.settings()\n"
                      "print(json.dumps({'trace': s.trace, 'hang': s.hang_timeout, 'dir': s.trace_dir}))\n")
    folder = tmp_path / "dumps"
    code, lines, text = _launch({"PORTSPEED_TRACE": " +5 "}, folder, nproc=1, script=script, args=(), hang="60")
    assert code == 0, text[-3000:]
    got = json.loads([x for x in text.splitlines() if x.startswith("{")][-1])
    assert got == {"trace": 5, "hang": 60.0, "dir": str(folder)}, got
    assert lines[0] == f"portspeed run: flight-recorder dumps go to {folder}", lines
