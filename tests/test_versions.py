"""Gate versions: the imported megatron.core's release (a checkout shadows the wheel), untested releases."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from portspeed.versions import SUPPORTED, distribution_version, package_info_version

INFO = '''
# a Megatron-style package_info.py: only the constants are read
MAJOR = {major}
MINOR = {minor}
PATCH = {patch}
PRE_RELEASE = "{pre}"
VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
import os as _os
raise RuntimeError("package_info.py must not be executed by portspeed")
'''


def fake_tree(root: Path, version: str, pre: str = "") -> Path:
    """A Megatron-LM-like tree (namespace ``megatron``, package ``megatron.core``) declaring ``version``."""
    major, minor, patch = version.split(".")
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise RuntimeError('megatron.core must not be imported to read its version')\n")
    (core / "package_info.py").write_text(INFO.format(major=major, minor=minor, patch=patch, pre=pre))
    (root / "target_mod.py").write_text("def f(x):\n    return x\n")
    return root


def run(code: str, tree: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PORTSPEED_")}
    full.update(PYTHONPATH=str(tree), PORTSPEED_ACCELERATOR="cpu", **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                          text=True, timeout=120)


def test_package_info_constants_are_read_without_running_the_file() -> None:
    assert str(package_info_version(INFO.format(major=0, minor=19, patch=1, pre=""))) == "0.19.1"
    assert str(package_info_version(INFO.format(major=0, minor=20, patch=0, pre="rc1"))) == "0.20.0rc1"
    assert package_info_version("X = 1\n") is None


GATE = '''
import sys
from portspeed.versions import gate_version
gv = gate_version("megatron-core")
print(gv.version, gv.source, gv.shadowed)
print(gv.describe("megatron-core"))
print("imported" if "megatron.core" in sys.modules else "not imported")
'''


def test_a_checkout_on_pythonpath_shadows_the_wheel_and_is_what_gates_read(tmp_path: Path) -> None:
    tree = fake_tree(tmp_path, "0.17.1")
    out = run(GATE, tree)
    assert out.returncode == 0, out.stderr
    first, describe, imported = out.stdout.splitlines()
    version, source, shadowed = first.split()
    assert version == "0.17.1" and source == str(tree / "megatron" / "core")
    assert imported == "not imported"
    installed = distribution_version("megatron-core")
    assert installed is not None, "the test environment installs megatron-core (constraints*.txt)"
    assert shadowed == "True" and f"shadows the installed megatron-core {installed}" in describe


APPLY = '''
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from portspeed.patching.manager import PatchManager
from portspeed.patching.record import Patch
m = PatchManager()
m.register([Patch(name="t.any", target="target_mod:f", kind="wrap", impl=lambda w, i, a, k: ("patched", w(*a, **k)),
                  reason="test", distribution="megatron-core", versions=">=0.15")])
m.apply(); m.apply()
import target_mod
print("RESULT", target_mod.f(1), m.report()[0]["status"])
'''


def test_an_untested_newer_release_warns_once_naming_the_range_and_still_applies(tmp_path: Path) -> None:
    out = run(APPLY, fake_tree(tmp_path, "0.20.0"))
    assert out.returncode == 0, out.stderr
    assert "RESULT ('patched', 1) applied" in out.stdout
    warnings = [ln for ln in out.stderr.splitlines() if "outside the range" in ln]
    assert len(warnings) == 1, out.stderr
    assert "megatron-core 0.20.0" in warnings[0] and f"megatron-core {SUPPORTED['megatron-core']}" in warnings[0]
    assert "--check 0.20.0" in warnings[0]


def test_an_untested_release_is_an_error_in_strict_mode(tmp_path: Path) -> None:
    out = run(APPLY, fake_tree(tmp_path, "0.20.0"), PORTSPEED_STRICT="1")
    assert out.returncode != 0
    assert "PatchStrictError" in out.stderr and "megatron-core 0.20.0" in out.stderr
    assert SUPPORTED["megatron-core"] in out.stderr and "RESULT" not in out.stdout


@pytest.mark.parametrize("release", ["0.15.3", "0.19.0"])
def test_a_supported_release_applies_without_the_range_warning(tmp_path: Path, release: str) -> None:
    out = run(APPLY, fake_tree(tmp_path, release), PORTSPEED_STRICT="1")
    assert out.returncode == 0, out.stderr
    assert "RESULT ('patched', 1) applied" in out.stdout
    assert "outside the range" not in out.stderr
