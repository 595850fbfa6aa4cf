"""`portspeed patches`: the manager's report, with statuses, reasons and rebinding sites.

In-process cases use a fresh PatchManager in place of the process-wide one and patch a
throwaway module, so nothing leaks into other tests; the adaptor case runs in a child.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers.launch import child_json

import portspeed
from portspeed.cli import patches as patch_report
from portspeed.patching.manager import PatchManager
from portspeed.patching.record import WRAP, Patch

_TARGET = textwrap.dedent(
    """
    def greet(name):
        return "hello " + name
    """
)
_USER = textwrap.dedent(
    """
    from ps_report_target import greet   # a second name the manager must rebind
    HELD = [greet]                       # a reference it cannot rebind
    """
)


def _shout(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    return wrapped(*args, **kwargs).upper()


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The throwaway target module and a user of it, importable and removed afterwards."""
    (tmp_path / "ps_report_target.py").write_text(_TARGET)
    (tmp_path / "ps_report_user.py").write_text(_USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for m in ("ps_report_target", "ps_report_user"):
        sys.modules.pop(m, None)


@pytest.fixture
def mgr(modules: None, monkeypatch: pytest.MonkeyPatch, portspeed_env: Any) -> Iterator[PatchManager]:
    """A fresh process-wide manager holding one patch per status, over a module not yet imported."""
    portspeed_env(PORTSPEED_DISABLE="t.disabled")
    fresh = PatchManager()
    monkeypatch.setattr(portspeed, "_manager", fresh)
    common = dict(kind=WRAP, impl=_shout, reason="tests the report")
    fresh.register([
        Patch(name="t.greet", target="ps_report_target:greet", **common),
        Patch(name="t.disabled", target="ps_report_target:greet", order=1, **common),
        Patch(name="t.not_installed", target="ps_report_target:greet", order=2,
              distribution="portspeed-no-such-dist", versions=">=1", **common),
        Patch(name="t.inactive", target="ps_report_target:greet", order=3, when=lambda acc: False, **common),
    ])
    fresh.apply()
    yield fresh
    fresh.revert()


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    rc = patch_report.main(["--adaptor", "none", "--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


def _by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in result["patches"]}


def test_statuses_and_reasons(mgr: PatchManager, capsys: pytest.CaptureFixture[str]) -> None:
    """Each patch shows its status with the reason the manager recorded."""
    rc, result = _json(capsys)
    assert rc == 0 and result["ok"]
    p = _by_name(result)
    assert p["t.greet"]["status"] == "pending" and "import ps_report_target" in p["t.greet"]["detail"]
    assert p["t.disabled"]["status"] == "disabled" and "PORTSPEED_DISABLE" in p["t.disabled"]["detail"]
    assert p["t.not_installed"]["status"] == "skipped" and "portspeed-no-such-dist" in p["t.not_installed"]["detail"]
    assert p["t.inactive"]["status"] == "inactive"
    assert result["counts"] == {"pending": 1, "disabled": 1, "skipped": 1, "inactive": 1}
    assert all(r["reason"] == "tests the report" for r in result["patches"])


def test_import_targets_applies_pending_patches(mgr: PatchManager, capsys: pytest.CaptureFixture[str]) -> None:
    """--import-targets imports the pending targets; the patch then shows applied, with its chain."""
    rc, result = _json(capsys, "--import-targets")
    assert rc == 0 and result["target_imports"] == {"ps_report_target": "ok"}
    greet = _by_name(result)["t.greet"]
    assert greet["status"] == "applied"
    assert any("t.greet" in link for link in greet["chain"])
    assert sys.modules["ps_report_target"].greet("x") == "HELLO X"  # the listing reflects what happened


def test_absent_target_module_is_not_a_failure(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A pending target whose package is not installed stays pending and is reported as absent."""
    fresh = PatchManager()
    monkeypatch.setattr(portspeed, "_manager", fresh)
    fresh.register([Patch(name="t.absent", target="ps_no_such_pkg.mod:f", kind=WRAP, impl=_shout, reason="tests")])
    fresh.apply()
    rc, result = _json(capsys, "--import-targets")
    assert rc == 0 and result["target_imports"]["ps_no_such_pkg.mod"].startswith("absent:")
    assert _by_name(result)["t.absent"]["status"] == "pending"


def test_rebinding_sites_and_deep(modules: None, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A patch applied after other modules took the original lists where it rebound names; --deep
    lists the references it could not rebind."""
    import ps_report_user  # type: ignore[import-not-found]  # binds greet, then the patch comes

    late = PatchManager()
    monkeypatch.setattr(portspeed, "_manager", late)
    late.register([Patch(name="t.late", target="ps_report_target:greet", kind=WRAP, impl=_shout, reason="tests")])
    late.apply()
    try:
        _, result = _json(capsys, "--deep")
        p = _by_name(result)["t.late"]
        assert p["status"] == "applied" and "ps_report_user.greet" in p["rebound"]
        assert ps_report_user.greet("x") == "HELLO X"
        assert any("list" in ref for ref in p["unrebindable"]), "HELD = [greet] must be found"
        _, shallow = _json(capsys)
        assert "unrebindable" not in _by_name(shallow)["t.late"]
    finally:
        late.revert()


def test_status_filter(mgr: PatchManager, capsys: pytest.CaptureFixture[str]) -> None:
    """--status keeps only the named statuses; the counts still cover everything."""
    _, result = _json(capsys, "--status", "skipped", "disabled")
    assert sorted(_by_name(result)) == ["t.disabled", "t.not_installed"]
    assert sum(result["counts"].values()) == 4


def test_failed_patch_sets_exit_status(mgr: PatchManager, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed patch (here: its condition raises) is listed as failed and the command exits 1."""
    def boom(acc: Any) -> bool:
        raise RuntimeError("condition broke")

    mgr.register([Patch(name="t.failed", target="ps_report_target:greet", kind=WRAP, impl=_shout,
                         reason="tests the report", when=boom, order=9)])
    mgr.apply()
    rc, result = _json(capsys)
    assert rc == 1 and not result["ok"]
    assert _by_name(result)["t.failed"]["status"] == "failed"
    assert "condition broke" in _by_name(result)["t.failed"]["detail"]


def test_text_listing(mgr: PatchManager, capsys: pytest.CaptureFixture[str]) -> None:
    """The text listing names every patch with its status, why, and the gate."""
    assert patch_report.main(["--adaptor", "none"]) == 0
    out = capsys.readouterr().out
    assert "4 patches" in out
    for status, name in (("PENDING", "t.greet"), ("DISABLED", "t.disabled"), ("SKIPPED", "t.not_installed")):
        assert any(line.startswith(status) and name in line for line in out.splitlines()), (status, name)
    assert "why: tests the report" in out and "[portspeed-no-such-dist >=1]" in out


def test_empty_manager_says_how_to_fill_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """With nothing registered the listing says which adaptor to import."""
    monkeypatch.setattr(portspeed, "_manager", PatchManager())
    assert patch_report.main(["--adaptor", "none"]) == 0
    assert "none registered" in capsys.readouterr().out


def test_bad_adaptor_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown --adaptor is refused listing the choices (CLI and API)."""
    with pytest.raises(SystemExit) as exc:
        patch_report.main(["--adaptor", "megatorn"])
    assert exc.value.code == 2 and "megatron" in capsys.readouterr().err
    with pytest.raises(ValueError, match="megatron, deepspeed, all, none"):
        patch_report.collect("megatorn")


def test_default_imports_both_adaptors_without_frameworks() -> None:
    """By default both adaptors are imported, their patches listed; Megatron/DeepSpeed stay unimported."""
    code = (
        "import sys, io, json, contextlib\n"
        "from portspeed.cli.patches import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    rc = main(['--json'])\n"
        "print(json.dumps({'rc': rc, 'result': json.loads(buf.getvalue()),\n"
        "                  'frameworks': [m for m in ('megatron', 'deepspeed') if m in sys.modules]}))\n"
    )
    out = child_json(code, timeout=180, drop=("PORTSPEED_DISABLE", "PORTSPEED_STRICT", "PORTSPEED_ACCELERATOR"))
    assert out["frameworks"] == []
    assert out["result"]["adaptors"] == {"portspeed.megatron_adaptor": "ok", "portspeed.deepspeed_adaptor": "ok"}
    from portspeed.patches.megatron import all_patches

    names = {p["name"]: p["status"] for p in out["result"]["patches"]}
    for p in all_patches():
        # a finder patch, and one whose target is portspeed's own import hook (the portable Transformer Engine's
        # served_import), is in place before any framework import (that is its point); the rest wait for theirs
        early = p.kind == "finder" or p.target.startswith("portspeed.")
        # a patch on torch's own code (DeviceMesh) applies as soon as that torch module is imported
        on_torch = p.target.startswith("torch.")
        waiting = (("applied",) if early else ("applied", "pending", "inactive") if on_torch
                   else ("pending", "skipped", "disabled", "inactive"))
        assert names.get(p.name) in waiting, p.name
