"""`portspeed info` builds nothing and loads no device runtime, even where the test device was never built.

A new user's first `portspeed info` printed nothing for minutes: filling the adapters table
imported the test device's runtime, which compiled its C++ extension (issue 22). Here, in a
fresh process whose build cache (``PORTSPEED_TESTDEV_BUILD_DIR``) is an empty folder and
whose PATH starts with stand-in compilers that record being called: both the text and the
JSON report come back, no compiler was started, the cache folder stays empty,
``torch.utils.cpp_extension`` and the runtime were never imported, and the test device's
row says "not built: `make testdev`". No timing is asserted: what makes info slow is the
build, and these checks see the build.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from helpers.launch import run_python  # noqa: E402

#: what torch.utils.cpp_extension starts to build an extension (and the names it may try first)
COMPILERS = ("c++", "g++", "gcc", "cc", "clang", "clang++", "ninja", "nvcc", "x86_64-linux-gnu-g++")

NOT_BUILT = "not built: `make testdev`"

INFO_RUN = '''
import contextlib, io, json, sys
from portspeed.cli.main import main
text, out = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(text):
    text_rc = main(["info"])
with contextlib.redirect_stdout(out):
    rc = main(["info", "--json"])
report = json.loads(out.getvalue())
watched = ("torch.utils.cpp_extension", "portspeed.testing.testdev.runtime", "portspeed_testdev_ext")
print(json.dumps({"rc": [text_rc, rc], "text": text.getvalue(), "adapters": report["adapters"],
                  "imported": [m for m in watched if m in sys.modules]}))
'''


def _stand_in_compilers(folder: Path, log: Path) -> Path:
    folder.mkdir()
    for name in COMPILERS:
        tool = folder / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 1\n')
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return folder


def test_info_builds_nothing_where_the_test_device_is_not_built(tmp_path: Path) -> None:
    """Text and JSON reports: no compiler started, no build folder made, the row says how to build."""
    cache, log = tmp_path / "cache", tmp_path / "compilers.log"
    cache.mkdir()
    fake_bin = _stand_in_compilers(tmp_path / "bin", log)
    env = {"PORTSPEED_TESTDEV_BUILD_DIR": str(cache), "PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    got = run_python(["-c", INFO_RUN], timeout=240, env=env, drop=["PORTSPEED_*"]).check().last_json()
    assert got["rc"] == [0, 0] and got["imported"] == [], got
    row = next((line for line in got["text"].splitlines() if line.strip().startswith("testdev ")), None)
    assert row is not None and NOT_BUILT in row, got["text"]
    testdev = next(a for a in got["adapters"] if a["name"] == "testdev")
    assert testdev["package_installed"] is False and testdev["available"] is False, testdev
    assert testdev["note"].startswith(NOT_BUILT), testdev

    assert not log.exists(), f"a compiler was started: {log.read_text()}"
    assert list(cache.iterdir()) == [], f"info created {sorted(p.name for p in cache.iterdir())} in the build cache"


@pytest.mark.testdev
def test_info_json_reports_available_as_unknown_for_an_unloaded_runtime(tmp_path: Path) -> None:
    """Where a build exists but the runtime is not loaded, the row says so instead of loading it."""
    from portspeed.testing.testdev import build

    if build.built() is None:  # the suite builds it (make test-leg1); a missing build must not pass silently
        raise AssertionError("the test device is not built here: run `make testdev` before the suite")
    got = run_python(["-c", INFO_RUN], timeout=240, drop=["PORTSPEED_*"]).check().last_json()
    testdev = next(a for a in got["adapters"] if a["name"] == "testdev")
    assert testdev["package_installed"] is True and testdev["available"] is None, testdev
    assert "not loaded" in testdev["note"] and got["imported"] == [], got
