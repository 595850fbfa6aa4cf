"""Drift check: patches whose target moved or changed in a Megatron release, found without importing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portspeed.patching import drift
from portspeed.patching.record import Patch
from portspeed.patches.megatron import all_patches

#: megatron-core releases checked in CI (cp312 wheels from PyPI, read from the archive)
WHEELS = ("0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")
#: Megatron-LM tags, and main at d98e8a64dd (reporting 0.20.0, recorded 2026-11-26), checked when
#: MEGATRON_LM_GIT names the repository's git directory
TAGS = ("core_v0.15.3", "core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0", "d98e8a64dd")

BODY = '''
import os

def target(x):
    """docstring v1"""
    # a comment
    return x + 1

class Owner:
    def method(self):
        return 1

if os.name:
    def guarded():
        return 2
'''


def test_fingerprint_ignores_docstrings_comments_and_position_but_not_code() -> None:
    base = drift.fingerprint(BODY, ("target",))
    moved = "\n\nX = 1\n" + BODY.replace('"""docstring v1"""', '"""docstring v2"""').replace("# a comment", "")
    assert base is not None and drift.fingerprint(moved, ("target",)) == base
    assert drift.fingerprint(BODY.replace("x + 1", "x + 2"), ("target",)) != base
    assert drift.fingerprint(BODY, ("Owner", "method")) is not None
    assert drift.fingerprint(BODY, ("guarded",)) is not None
    assert drift.fingerprint(BODY, ("Owner", "gone")) is None and drift.fingerprint(BODY, ("gone",)) is None


def _tree(root: Path, version: str, body: str = BODY) -> Path:
    major, minor, patch = version.split(".")
    core = root / "megatron" / "core"
    core.mkdir(parents=True, exist_ok=True)
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    (core / "mod.py").write_text(body)
    return root


def _patch(name: str, target: str, versions: str = ">=0.15", **fps: str) -> Patch:
    return Patch(name=name, target=target, kind="wrap", impl=lambda w, i, a, k: w(*a, **k), reason="test",
                 distribution="megatron-core", versions=versions,
                 fingerprints={k.replace("_", "."): v for k, v in fps.items()})


def test_every_status_with_its_reason(tmp_path: Path) -> None:
    fp = drift.fingerprint(BODY, ("target",))
    tree = drift.open_source(str(_tree(tmp_path, "0.18.2", BODY.replace("x + 1", "x - 1"))))
    patches = [
        _patch("same", "megatron.core.mod:Owner.method", **{"0_16_1": drift.fingerprint(BODY, ("Owner", "method"))}),
        _patch("changed", "megatron.core.mod:target", **{"0_16_1": fp}),
        _patch("gone", "megatron.core.mod:vanished", **{"0_16_1": fp}),
        _patch("gone_module", "megatron.core.elsewhere:f", **{"0_16_1": fp}),
        _patch("old", "megatron.core.mod:target", versions="<0.17", **{"0_16_1": fp}),
        _patch("training", "megatron.training.arguments:validate_args", **{"0_16_1": fp}),
        _patch("never", "megatron.core.mod:guarded"),
    ]
    release, found = drift.check(patches, tree)
    by = {f.name: f for f in found}
    assert str(release) == "0.18.2"
    assert by["same"].status == "ok" and "0.16.1" in by["same"].detail
    assert by["changed"].status == "changed" and "since 0.16.1" in by["changed"].detail
    assert by["gone"].status == "missing" and "vanished" in by["gone"].detail
    assert by["gone_module"].status == "missing" and "megatron/core/elsewhere.py" in by["gone_module"].detail
    assert by["old"].status == "inactive"
    assert by["training"].status == "absent" and "megatron/training" in by["training"].detail
    assert by["never"].status == "unrecorded"
    # a release recorded on purpose (its target legitimately differs) is not flagged again
    changed_fp = by["changed"].fingerprint
    again = drift.check_one(_patch("changed", "megatron.core.mod:target", **{"0_16_1": fp, "0_18_2": changed_fp}),
                            tree, release)
    assert again.status == "ok"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "portspeed.cli", "patches", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_exit_status_names_a_bad_source(tmp_path: Path) -> None:
    res = _cli("--check", str(tmp_path))
    assert res.returncode == 2 and "no megatron/core inside" in res.stderr
    res = _cli("--check", "not-a-version")
    assert res.returncode == 2 and "neither a folder" in res.stderr
    res = _cli("--record")
    assert res.returncode == 2 and "--record needs --check" in res.stderr


@pytest.mark.parametrize("version", WHEELS)
def test_megatron_core_wheel_has_no_drift(version: str) -> None:
    """The patch set against each release's cp312 wheel, downloaded with pip and read from the archive."""
    res = _cli("--check", version, "--json")
    assert res.returncode in (0, 1), res.stderr
    out = json.loads(res.stdout)
    assert out["release"] == version
    bad = [f for f in out["findings"] if f["status"] in drift.DRIFT]
    assert not bad, "\n".join(f"{f['status']} {f['name']}: {f['detail']}" for f in bad)
    assert res.returncode == 0
    assert any(f["status"] == "ok" for f in out["findings"])


GIT = os.environ.get("MEGATRON_LM_GIT", "").strip()


@pytest.mark.skipif(not GIT, reason="MEGATRON_LM_GIT is not set: point it at the git directory of a "
                    "Megatron-LM clone (a bare one from `fetch` is enough) that has the core_v0.15-0.19 tags")
@pytest.mark.parametrize("tag", TAGS)
def test_megatron_lm_tag_has_no_drift(tag: str) -> None:
    """Every patch, megatron.training ones included, against a Megatron-LM tag read with `git show`."""
    res = _cli("--check", f"{GIT}@{tag}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "CHANGED" not in res.stdout and "MISSING" not in res.stdout


def test_the_shipped_patch_set_carries_its_fingerprints() -> None:
    """Every Megatron attribute patch has a fingerprint recorded for at least one release (drift can be shown).

    Finder patches change sys.meta_path, not a Megatron source object: nothing to fingerprint; nor do
    patches in the Megatron set whose target is torch's or portspeed's (drift reads Megatron sources only).
    """
    missing = [p.name for p in all_patches()
               if not p.fingerprints and p.kind != "finder" and p.target.startswith("megatron")]
    assert not missing, f"patches without recorded fingerprints: {missing}"


def test_watched_sources_say_present_absent_or_unknown(tmp_path: Path) -> None:
    """A name bound by tuple unpacking counts; a missing one is None; a wheel says nothing of megatron.training."""
    body = BODY + "\nif os.name:\n    pass\nelse:\n    (te_gemm, other) = (None, None)\n"
    tree = drift.open_source(str(_tree(tmp_path, "0.17.1", body)))
    watched = drift.scan_watched(tree, ["megatron.core.mod:te_gemm", "megatron.core.mod:absent",
                                        "megatron.training.training:pretrain", "pretrain_gpt:get_batch"])
    assert watched["megatron.core.mod:te_gemm"] is not None
    assert watched["megatron.core.mod:absent"] is None
    # no megatron/training here (a wheel): it says nothing about the training package or the scripts
    assert "megatron.training.training:pretrain" not in watched and "pretrain_gpt:get_batch" not in watched
    (tmp_path / "megatron" / "training").mkdir()
    (tmp_path / "pretrain_gpt.py").write_text("def get_batch(it):\n    return next(it)\n")
    watched = drift.scan_watched(tree, ["megatron.training.training:pretrain", "pretrain_gpt:get_batch"])
    assert watched["megatron.training.training:pretrain"] is None and watched["pretrain_gpt:get_batch"] is not None
