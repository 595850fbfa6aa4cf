"""`portspeed run --perf` and `portspeed compare --perf` refuse what they cannot use, in one line; off, nothing runs.

Bad switches and settings (before any worker starts, or at the settings' reading under a plain torchrun),
a folder that already holds a recording, unusable recordings: exit 2 with one line naming what was wrong.
With the recording off no perf patch is declared and nothing is installed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.launch import child_json  # noqa: E402
from portspeed.cli import run as launch  # noqa: E402
from portspeed.parity import compare as compare_cli  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron]


def compare(*args: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = compare_cli.main(["--perf", *map(str, args)], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ refusals, and nothing when off

PERF_LINES = [
    (["--perf", "rec", "--perf-level", "deep", "train.py"], ["--perf-level 'deep' is not a perf level"]),
    (["--perf", "rec", "--perf-iterations", "0:3", "train.py"], ["--perf-iterations '0:3' is not a range"]),
    (["--perf", "rec", "--perf-ranks", "one", "train.py"], ["--perf-ranks 'one' is not a list of ranks"]),
    (["--nproc-per-node", "2", "--perf", "rec", "--perf-ranks", "0,2", "train.py"],
     ["--perf-ranks '0,2': rank 2 is not in this job's ranks 0..1"]),
    (["--perf-level", "op", "train.py"], ["--perf-level needs --perf DIR"]),
    (["--perf", "/proc/portspeed-perf", "train.py"], ["--perf '/proc/portspeed-perf' is not a writable folder"]),
]


@pytest.mark.parametrize("argv,words", PERF_LINES, ids=[" ".join(r[0]) for r in PERF_LINES])
def test_a_bad_perf_switch_exits_2_with_one_line(argv: list[str], words: list[str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """Refused before any worker starts, one line naming the switch, the folder never made."""
    import torch.distributed.run as tdr

    (tmp_path / "train.py").write_text("raise SystemExit('the script ran')\n")
    monkeypatch.chdir(tmp_path)
    started: list = []
    monkeypatch.setattr(tdr, "run", lambda args: started.append(args))
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("portspeed run: error: ") and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert not started and not (tmp_path / "rec").exists()


@pytest.mark.parametrize("env,words", [
    ({"PORTSPEED_PERF_LEVEL": "op"}, "PORTSPEED_PERF_LEVEL is set but PORTSPEED_PERF is not; give the folder it "
                                     "writes (portspeed run --perf DIR)"),
    ({"PORTSPEED_PERF": "{tmp}", "PORTSPEED_PERF_LEVEL": "deep"}, "PORTSPEED_PERF_LEVEL='deep' is not a perf level"),
    ({"PORTSPEED_PERF": "{tmp}", "PORTSPEED_PERF_ITERATIONS": "3:1"}, "PORTSPEED_PERF_ITERATIONS='3:1' is not a range"),
], ids=["companion-alone", "level", "iterations"])
def test_bad_perf_settings_under_torchrun_are_refused_in_one_line(env: dict[str, str], words: str,
                                                                  tmp_path: Path) -> None:
    """What a plain torchrun launch's ranks read: refused at the settings' reading, naming the variable."""
    from portspeed import config
    from portspeed.errors import ConfigError

    with pytest.raises(ConfigError) as got:
        config.Settings.from_env({k: v.format(tmp=tmp_path) for k, v in env.items()})
    assert words in str(got.value) and "\n" not in str(got.value), got.value


def test_a_folder_holding_a_recording_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """An earlier recording is never appended to: `portspeed run --perf DIR` names it and starts nothing."""
    (tmp_path / "train.py").write_text("raise SystemExit('the script ran')\n")
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "rank0.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    assert launch.main(["--perf", "rec", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "already holds a perf recording" in err and "rank0.jsonl" in err and err.count("\n") == 1, err


def test_unusable_recordings_exit_2_with_one_line(tmp_path: Path) -> None:
    """compare --perf: a missing folder, an empty one, a damaged line, three folders, a loss option: exit 2."""
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "rank0.jsonl").write_text("not json\n")
    for args, words in (([tmp_path / "missing"], "is not a folder"), ([tmp_path / "empty"], "holds no perf recording"),
                        ([bad, bad], "rank0.jsonl:1 is not JSON"), ([bad, bad, bad], "takes one recording")):
        code, out, err = compare(*args)
        assert code == 2 and not out and err.count("\n") == 1 and words in err, (args, err)
    code, out, err = compare(tmp_path / "empty", "--rtol", "1")
    assert code == 2 and "do not apply to perf recordings" in err, err
    code, out, err = compare(bad, "--chrome", tmp_path / "trace.json")
    assert code == 2 and not out and "is not JSON" in err and not (tmp_path / "trace.json").exists(), err


def test_nothing_is_declared_or_installed_when_perf_is_off() -> None:
    """PORTSPEED_PERF unset: no perf patch among the Megatron set, no session, no wrapper target."""
    got = child_json("""
        import json
        from portspeed.integrations.megatron import megatron_patches
        from portspeed.perf import session, collectives
        from portspeed.patches import perf
        names = [p.name for p in megatron_patches()]
        print(json.dumps({"perf": [n for n in names if ".perf" in n], "declared": len(perf.all_patches()),
                          "session": session.current() is not None, "target": collectives.SLOT.target is not None,
                          "patches": len(names)}))
    """, timeout=120, drop=("PORTSPEED_*",))
    assert got == {"perf": [], "declared": 0, "session": False, "target": False, "patches": got["patches"]}, got
    assert got["patches"] > 10, got
