"""The wheel installs patches/ and adapters/ under the portspeed namespace, and nothing else at top level."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _packages_on_disk() -> set[str]:
    """Every package directory of the source tree, under the name it must install as."""
    out: set[str] = set()
    for top, name in (("portspeed", "portspeed"), ("patches", "portspeed.patches"), ("adapters", "portspeed.adapters")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            out.add(".".join((name, *rel)))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"building the wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (whl,) = out.glob("portspeed-*.whl")
    return zipfile.ZipFile(whl)


def test_only_portspeed_at_top_level(wheel: zipfile.ZipFile) -> None:
    """Nothing named plain `patches` or `adapters` may land in site-packages."""
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert {t for t in tops if not t.startswith("portspeed")} == set(), tops


def test_every_source_package_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    """A subpackage missing from pyproject's package list would silently vanish from installs."""
    in_wheel = {n.rsplit("/", 1)[0].replace("/", ".") for n in wheel.namelist() if n.endswith("/__init__.py")}
    missing = _packages_on_disk() - in_wheel
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_console_script_and_pytest_plugin_declared(wheel: zipfile.ZipFile) -> None:
    (ep,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    text = wheel.read(ep).decode()
    assert "portspeed = portspeed.cli:main" in text
    assert "portspeed = portspeed.parity.pytest_plugin" in text
