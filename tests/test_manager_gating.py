"""The PatchManager contract, continued: what decides whether a patch is applied, and how that is reported.

Drift (a target missing, a version out of range, a distribution not installed), strictness (all or nothing),
install failures, PORTSPEED_DISABLE, declared conditions, the report's statuses, rebinding rules, run-time
status notes, and finder patches. Import order, stale references, composition and scoping: test_manager.py.
Modules are written and imported for real (tests/helpers/patch_modules.py).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

import pytest

from helpers.patch_modules import Modules, imp, replace, status, tag, wrap
from helpers.patch_modules import env, mgr, mods  # noqa: F401 - the fixtures both files use

from portspeed.errors import PatchDefinitionError, PatchStrictError
from portspeed.patching.manager import STATUSES, PatchManager
from portspeed.patching.record import Patch
from portspeed.versions import distribution_version


# ---------------------------------------------------------------- drift
def test_missing_target_is_skipped_naming_target_and_version(mods: Modules, mgr: PatchManager) -> None:
    t = imp(mods.target())
    mgr.register([wrap("gone", f"{t.__name__}:C.vanished", distribution="wrapt")])
    mgr.apply()
    d = status(mgr, "gone")
    assert d["status"] == "skipped"
    assert f"{t.__name__}:C.vanished" in d["detail"]
    assert f"wrapt {distribution_version('wrapt')}" in d["detail"]


def test_missing_target_in_module_imported_later(mods: Modules, mgr: PatchManager) -> None:
    name = mods.target()
    mgr.register([wrap("gone", f"{name}:nope"), wrap("ok", f"{name}:f")])
    mgr.apply()
    t = imp(name)
    assert status(mgr, "gone")["status"] == "skipped" and f"{name}:nope" in status(mgr, "gone")["detail"]
    assert t.f(1) == ("ok", ("f", 1))


def test_out_of_range_is_inactive_and_not_installed_is_skipped(mods: Modules, mgr: PatchManager) -> None:
    """A range that excludes the running version is a declared decision (inactive); a missing distribution is not."""
    t = imp(mods.target())
    version = distribution_version("wrapt")
    mgr.register([
        wrap("old", f"{t.__name__}:f", distribution="wrapt", versions="<1"),
        wrap("absent", f"{t.__name__}:f", distribution="portspeed-no-such-distribution", versions=">=1"),
        wrap("inrange", f"{t.__name__}:f", distribution="wrapt", versions=f"=={version}"),
    ])
    mgr.apply()
    assert status(mgr, "old")["status"] == "inactive"
    assert f"wrapt {version}" in status(mgr, "old")["detail"] and "'<1'" in status(mgr, "old")["detail"]
    assert status(mgr, "absent")["status"] == "skipped"
    assert "portspeed-no-such-distribution" in status(mgr, "absent")["detail"]
    assert t.f(1) == ("inrange", ("f", 1))


def _broken(t: str) -> dict[str, Patch]:
    return {
        "missing target": wrap("bad", f"{t}:nope"),
        "not installed": wrap("bad", f"{t}:f", distribution="portspeed-no-such-distribution"),
        "condition raised": wrap("bad", f"{t}:f", when=lambda acc: 1 / 0),
    }


@pytest.mark.parametrize("case", list(_broken("x")))
def test_strict_raises_at_apply_with_nothing_half_applied(mods: Modules, mgr: PatchManager, env: Any,
                                                          case: str) -> None:
    t = imp(mods.target())
    later = mods.target("later")
    original, original_m = t.f, t.C.__dict__["m"]
    env(PORTSPEED_STRICT="1")
    mgr.register([wrap("good", f"{t.__name__}:C.m"), _broken(t.__name__)[case], wrap("hook", f"{later}:f")])
    with pytest.raises(PatchStrictError, match="'bad'"):
        mgr.apply()
    assert t.f is original and t.C.__dict__["m"] is original_m
    assert status(mgr, "good")["status"] == "registered" and status(mgr, "hook")["status"] == "registered"
    assert status(mgr, "bad")["status"] in ("skipped", "failed")
    assert imp(later).f(1) == ("f", 1)  # no hook was left behind


def test_strict_accepts_a_range_that_excludes_the_running_version(mods: Modules, mgr: PatchManager,
                                                                  env: Any) -> None:
    """PORTSPEED_STRICT=1 fails on drift, not on a patch written for other releases (torch 2.6-2.12 vs >=2.13)."""
    t = imp(mods.target())
    env(PORTSPEED_STRICT="1")
    mgr.register([wrap("newer", f"{t.__name__}:f", distribution="wrapt", versions=">=999"),
                  wrap("now", f"{t.__name__}:C.m")])
    mgr.apply()
    assert status(mgr, "newer")["status"] == "inactive" and status(mgr, "now")["status"] == "applied"
    assert t.f(1) == ("f", 1)


def test_strict_raises_from_import_when_target_missing(mods: Modules, mgr: PatchManager, env: Any) -> None:
    """Under strict, importing a module whose patch has drifted fails; fix the env, apply, import again."""
    name = mods.target()
    env(PORTSPEED_STRICT="yes")
    mgr.register([wrap("ok", f"{name}:f"), wrap("gone", f"{name}:nope")])
    mgr.apply()
    with pytest.raises(PatchStrictError, match="'gone'"):
        imp(name)
    assert name not in sys.modules
    assert status(mgr, "ok")["status"] == "registered"
    env(PORTSPEED_STRICT=None)
    mgr.apply()
    assert imp(name).f(1) == ("ok", ("f", 1))
    assert status(mgr, "gone")["status"] == "skipped"


def test_install_failure_is_failed_and_strict_rolls_back(mods: Modules, mgr: PatchManager, env: Any) -> None:
    """An owner that refuses setattr makes the patch failed; under strict the whole batch is undone."""
    t = imp(mods.write("ro", """
        def f(x):
            return ("f", x)

        class ReadOnly:
            def go(self):
                return "go"
            def __setattr__(self, key, value):
                raise AttributeError("read-only object")

        ro = ReadOnly()
        """))
    original = t.f
    mgr.register([wrap("good", f"{t.__name__}:f"), wrap("bad", f"{t.__name__}:ro.go")])
    mgr.apply()
    assert status(mgr, "bad")["status"] == "failed" and "read-only" in status(mgr, "bad")["detail"]
    assert t.f(1) == ("good", ("f", 1))
    mgr.revert()
    env(PORTSPEED_STRICT="on")
    with pytest.raises(PatchStrictError, match="'bad'"):
        mgr.apply()
    assert t.f is original and status(mgr, "good")["status"] == "reverted"


def test_disable_by_name_and_prefix(mods: Modules, mgr: PatchManager, env: Any) -> None:
    t = imp(mods.target())
    env(PORTSPEED_DISABLE="exact, fam.*")
    mgr.register([wrap("exact", f"{t.__name__}:f"), wrap("fam.one", f"{t.__name__}:f"),
                  wrap("fam.two", f"{t.__name__}:other"), wrap("exactly", f"{t.__name__}:f")])
    mgr.apply()
    got = {d["name"]: d["status"] for d in mgr.report()}
    assert got == {"exact": "disabled", "fam.one": "disabled", "fam.two": "disabled", "exactly": "applied"}
    assert t.f(1) == ("exactly", ("f", 1)) and t.other(1) == ("other", 1)


def test_condition_false_is_inactive_even_when_strict(mods: Modules, mgr: PatchManager, env: Any) -> None:
    """A false `when` is a decision, not drift: 'inactive', and strict mode does not raise."""
    t = imp(mods.target())
    env(PORTSPEED_STRICT="1")
    seen: list[str] = []
    mgr.register([wrap("never", f"{t.__name__}:f", when=lambda acc: seen.append(acc.name) or False),
                  wrap("always", f"{t.__name__}:f", when=lambda acc: True)])
    mgr.apply()
    d = status(mgr, "never")
    assert d["status"] == "inactive" and repr(seen[0]) in d["detail"]
    assert t.f(1) == ("always", ("f", 1))


def test_condition_that_raises_is_failed(mods: Modules, mgr: PatchManager) -> None:
    t = imp(mods.target())
    mgr.register([wrap("boom", f"{t.__name__}:f", when=lambda acc: {}["nope"])])
    mgr.apply()
    d = status(mgr, "boom")
    assert d["status"] == "failed" and "KeyError" in d["detail"]
    assert t.f(1) == ("f", 1)


def test_report_statuses_are_known(mods: Modules, mgr: PatchManager) -> None:
    t = imp(mods.target())
    mgr.register([wrap("a", f"{t.__name__}:f"), wrap("b", f"{t.__name__}:nope")])
    assert {d["status"] for d in mgr.report()} == {"registered"}
    mgr.apply()
    for d in mgr.report():
        assert d["status"] in STATUSES
        assert set(d) >= {"name", "target", "kind", "status", "detail", "reason", "distribution", "versions"}


def test_replaced_constant_does_not_rebind_equal_immutables(mods: Modules, mgr: PatchManager) -> None:
    """Rebinding is by identity, so shared immutables (small ints, strings) are never swept."""
    t = imp(mods.write("consts", "LIMIT = 0\nNAME = 'cuda'\n"))
    u = imp(mods.write("cu", f"from {t.__name__} import LIMIT, NAME\nOTHER = 0\nLABEL = 'cuda'\n"))
    mgr.register([replace("lim", f"{t.__name__}:LIMIT", impl=7), replace("nm", f"{t.__name__}:NAME", impl="cpu")])
    mgr.apply()
    assert (t.LIMIT, t.NAME) == (7, "cpu")
    assert (u.OTHER, u.LABEL) == (0, "cuda")  # unrelated names that happen to share the object
    assert (u.LIMIT, u.NAME) == (0, "cuda")   # documented limit: copies of immutables stay as they were
    mgr.revert()
    assert (t.LIMIT, t.NAME) == (0, "cuda")


@pytest.mark.parametrize("order", ["import-first", "apply-first"])
def test_package_reexport_of_a_submodule_function(mods: Modules, mgr: PatchManager, order: str) -> None:
    """`pkg/__init__.py: from .impl import f` sees the patch of pkg.impl:f, whichever comes first."""
    (mods.root / mods.pkg / "__init__.py").write_text("from .impl import f\n")
    mods.write("impl", "def f(x):\n    return ('f', x)\n")
    mgr.register([wrap("w", f"{mods.pkg}.impl:f")])
    if order == "import-first":
        pkg = imp(mods.pkg)
        mgr.apply()
    else:
        mgr.apply()
        pkg = imp(mods.pkg)
    assert pkg.f(1) == ("w", ("f", 1)) and pkg.f is sys.modules[f"{mods.pkg}.impl"].f
    mgr.revert()
    assert pkg.f(1) == ("f", 1)


def test_only_portspeed_itself_is_exempt_from_rebinding(mods: Modules, mgr: PatchManager) -> None:
    """Modules of the portspeed package keep originals on purpose; a user module named portspeed_* does not."""
    t = imp(mods.target())
    name = f"portspeed_user_{mods.pkg}"
    (mods.root / f"{name}.py").write_text(f"from {t.__name__} import f\n")
    importlib.invalidate_caches()
    try:
        u = imp(name)
        mgr.register([wrap("w", f"{t.__name__}:f")])
        mgr.apply()
        assert u.f is t.f and u.f(1) == ("w", ("f", 1))
    finally:
        sys.modules.pop(name, None)


def test_status_and_note_are_the_way_a_patch_reports_at_run_time(mgr: PatchManager) -> None:
    """A patch reads another's status and sets its own report line through the manager, not its records."""
    import types

    mod = types.ModuleType("ps_note_target")
    mod.f = lambda: 1
    sys.modules["ps_note_target"] = mod
    try:
        mgr.register([Patch(name="t.note", target="ps_note_target:f", impl=tag("n"), reason="test", kind="wrap")])
        mgr.apply()
        assert mgr.status("t.note") == "applied" and mgr.status("t.absent") is None
        mgr.note("t.note", "routed nccl -> gloo")
        row = next(r for r in mgr.report() if r["name"] == "t.note")
        assert row["status"] == "applied" and row["detail"] == "routed nccl -> gloo"
        with pytest.raises(KeyError, match="t.absent"):
            mgr.note("t.absent", "x")
    finally:
        mgr.revert()
        del sys.modules["ps_note_target"]


def test_finder_patches_are_gated_reported_disabled_and_reverted(env: Callable[..., None]) -> None:
    """A declared import finder goes first at apply, is in the report, obeys PORTSPEED_DISABLE, leaves on revert."""
    import importlib.abc

    from portspeed.patching.record import FINDER, FINDER_TARGET

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
            return None

    first, last = Finder(), Finder()
    patches = [Patch(name="t.first", target=FINDER_TARGET, kind=FINDER, impl=first, placement="first", reason="t"),
               Patch(name="t.last", target=FINDER_TARGET, kind=FINDER, impl=last, placement="last", reason="t")]
    m = PatchManager()
    m.register(patches)
    m.apply()
    try:
        assert sys.meta_path[0] is first and sys.meta_path[-1] is last
        assert {r["name"]: r["status"] for r in m.report()} == {"t.first": "applied", "t.last": "applied"}
    finally:
        m.revert()
    assert first not in sys.meta_path and last not in sys.meta_path
    assert {r["status"] for r in m.report()} == {"reverted"}
    env(PORTSPEED_DISABLE="t.first")
    m.apply()
    try:
        assert first not in sys.meta_path and sys.meta_path[-1] is last
        assert m.status("t.first") == "disabled"
    finally:
        m.revert()
    with pytest.raises(PatchDefinitionError, match="find_spec"):
        Patch(name="t.bad", target=FINDER_TARGET, kind=FINDER, impl=object(), reason="t")


def test_megatron_import_finders_are_declared_patches() -> None:
    """The two Megatron import finders are in the Megatron patch set, so they are reported and revertable."""
    from portspeed.integrations.patch_sets import load
    from portspeed.patches.megatron import training_imports as ti

    finders = {p.name: p for p in load("megatron") if p.kind == "finder"}
    assert {p.impl for p in finders.values()} == {ti.BATCH_INVARIANT_FINDER, ti.HELPERS_FINDER}
