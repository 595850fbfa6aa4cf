"""The PatchManager contract (portspeed/patching/manager.py docstring), clause by clause.

Every test writes real modules into a temporary directory under a unique package name,
imports them for real, and removes them from sys.modules afterwards (as wrapt's own
post-import hook tests do), so no test sees another's modules or patches
(tests/helpers/patch_modules.py). Drift, strictness, gating and reporting: test_manager_gating.py.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from helpers.patch_modules import Modules, imp, replace, status, wrap
from helpers.patch_modules import env, mgr, mods  # noqa: F401 - the fixtures both files use

from portspeed.errors import PatchConflictError, PatchDefinitionError
from portspeed.patching.manager import PatchManager
from portspeed.patching.record import Patch


# ---------------------------------------------------------------- import order
def test_target_imported_before_apply_is_patched_at_once(mods: Modules, mgr: PatchManager) -> None:
    """A module already imported is patched by apply() itself."""
    t = imp(mods.target())
    mgr.register([wrap("w", f"{t.__name__}:f")])
    assert t.f(1) == ("f", 1)
    mgr.apply()
    assert t.f(1) == ("w", ("f", 1))
    assert status(mgr, "w")["status"] == "applied"


def test_target_imported_after_apply_is_patched_on_import(mods: Modules, mgr: PatchManager) -> None:
    """A module imported after apply() is patched by the post-import hook, before anyone binds it."""
    name = mods.target()
    mgr.register([wrap("w", f"{name}:f")])
    mgr.apply()
    assert status(mgr, "w")["status"] == "pending"
    t = imp(name)
    assert t.f(2) == ("w", ("f", 2))
    assert status(mgr, "w")["status"] == "applied"


def test_register_and_apply_never_import_the_target(mods: Modules, mgr: PatchManager) -> None:
    """Neither register nor apply imports a target module (the import stays the user's)."""
    name = mods.write("loud", "raise RuntimeError('imported by portspeed')\ndef f():\n    pass\n")
    mgr.register([wrap("w", f"{name}:f"), replace("r", f"{name}:f2", impl=lambda: None)])
    mgr.apply()
    mgr.apply()
    assert name not in sys.modules
    assert {d["status"] for d in mgr.report()} == {"pending"}


# ---------------------------------------------------------------- stale references
@pytest.mark.parametrize("order", ["user-before-apply", "user-after-apply"])
def test_aliases_are_rebound_and_restored(mods: Modules, mgr: PatchManager, order: str) -> None:
    """from-imports, as-aliases, module aliases and class attributes see the patch; revert restores them."""
    t = imp(mods.target())
    original = t.f
    uname = mods.user(t.__name__)
    mgr.register([wrap("w", f"{t.__name__}:f")])
    if order == "user-before-apply":
        u = imp(uname)
        mgr.apply()
    else:
        mgr.apply()
        u = imp(uname)
    for fn in (u.f, u.g, u.z.f, u.D.h):
        assert fn(3) == ("w", ("f", 3))
    assert u.f is t.f and u.g is t.f and u.D.__dict__["h"] is t.f
    if order == "user-before-apply":
        rebound = status(mgr, "w")["rebound"]
        assert f"{uname}.f" in rebound and f"{uname}.g" in rebound and f"{uname}.D.h" in rebound
    mgr.revert()
    assert t.f is original
    assert u.f is original and u.g is original and u.D.__dict__["h"] is original
    assert status(mgr, "w")["status"] == "reverted"


def test_alias_bound_after_patching_is_restored_by_revert(mods: Modules, mgr: PatchManager) -> None:
    """A module that imported the patched function (after apply) gets the original back on revert."""
    t = imp(mods.target())
    original = t.f
    mgr.register([wrap("w", f"{t.__name__}:f")])
    mgr.apply()
    late = imp(mods.write("late", f"from {t.__name__} import f as late_f\n"))
    assert late.late_f is t.f and late.late_f is not original
    mgr.revert()
    assert late.late_f is original


@pytest.mark.parametrize("kind", ["wrap", "replace"])
def test_methods_plain_static_class(mods: Modules, mgr: PatchManager, kind: str) -> None:
    """Methods, staticmethods and classmethods keep their binding when wrapped or replaced."""
    t = imp(mods.target())
    raws = {a: t.C.__dict__[a] for a in ("m", "s", "c")}
    if kind == "wrap":
        mgr.register([wrap(f"w{a}", f"{t.__name__}:C.{a}", label="w") for a in ("m", "s", "c")])
    else:
        mgr.register([
            replace("rm", f"{t.__name__}:C.m", impl=lambda self, x: ("w", ("m", x))),
            replace("rs", f"{t.__name__}:C.s", impl=lambda x: ("w", ("s", x))),
            replace("rc", f"{t.__name__}:C.c", impl=lambda cls, x: ("w", (cls.__name__, x))),
        ])
    mgr.apply()
    assert t.C().m(1) == ("w", ("m", 1))
    assert t.C.s(2) == ("w", ("s", 2)) and t.C().s(2) == ("w", ("s", 2))
    assert t.C.c(3) == ("w", ("C", 3))
    assert t.Sub.c(4) == ("w", ("Sub", 4))  # subclass defined before patching inherits it
    assert t.Sub().m(5) == ("w", ("m", 5))
    mgr.revert()
    assert {a: t.C.__dict__[a] for a in ("m", "s", "c")} == raws
    assert all(t.C.__dict__[a] is raws[a] for a in raws)
    assert t.C.c(3) == ("C", 3)


def test_inherited_target_patches_only_the_named_subclass(mods: Modules, mgr: PatchManager) -> None:
    """Patching Sub.m that Sub inherits leaves C.m alone; revert removes Sub's own attribute again."""
    t = imp(mods.target())
    base_m = t.C.__dict__["m"]
    mgr.register([wrap("w", f"{t.__name__}:Sub.m")])
    mgr.apply()
    assert t.Sub().m(1) == ("w", ("m", 1))
    assert t.C().m(1) == ("m", 1)
    assert t.C.__dict__["m"] is base_m
    mgr.revert()
    assert "m" not in t.Sub.__dict__
    assert t.Sub().m(1) == ("m", 1)


def test_unrebindable_references_are_reported(mods: Modules, mgr: PatchManager) -> None:
    """Closures, default arguments, containers and subclasses of a replaced class appear under 'unrebindable'."""
    t = imp(mods.target())
    original = t.f
    holder = imp(mods.write("holder", f"""
        from {t.__name__} import f, C

        def make():
            ref = f
            def inner(x):
                return ref(x)
            return inner

        closure = make()

        def uses_default(x, cb=f):
            return cb(x)

        REG = [f]
        TABLE = {{"f": f}}

        class Child(C):
            pass

        class Outer:
            class Inner:
                cb = f
        """))
    mgr.register([wrap("w", f"{t.__name__}:f"), replace("rC", f"{t.__name__}:C", impl=type("C2", (), {}))])
    mgr.apply()
    rep = {d["name"]: d for d in mgr.report(deep=True)}
    found = " | ".join(rep["w"]["unrebindable"])
    assert "closure cell" in found and f"{holder.__name__}.make" in found
    assert f"default argument of {holder.__name__}.uses_default" in found
    assert "list container" in found and "dict container" in found
    assert f"class attribute of {holder.__name__}.Outer.Inner" in found
    classes = " | ".join(rep["rC"]["unrebindable"])
    assert f"subclass {holder.__name__}.Child" in classes
    assert f"subclass {t.__name__}.Sub" in classes
    # they really were not rebound: the report is not decoration
    assert holder.REG[0] is original and holder.TABLE["f"] is original
    assert holder.Outer.Inner.__dict__["cb"] is original
    assert holder.closure(1) == ("f", 1)
    assert holder.f(1) == ("w", ("f", 1))  # the plain alias was
    assert "unrebindable" not in mgr.report()[0]  # only on request


# ---------------------------------------------------------------- composition
def test_wrappers_chain_by_order_then_registration(mods: Modules, mgr: PatchManager) -> None:
    """Lower order is closer to the original; equal orders keep registration order; chain() prints it."""
    t = imp(mods.target())
    target = f"{t.__name__}:f"
    mgr.register([wrap("late", target, order=5), wrap("a", target, order=1), wrap("b", target, order=1)])
    mgr.apply()
    assert t.f(0) == ("late", ("b", ("a", ("f", 0))))
    assert mgr.chain(target) == [f"original {target}", "wrapper a (order 1)", "wrapper b (order 1)",
                                 "wrapper late (order 5)"]
    assert status(mgr, "a")["chain"] == mgr.chain(target)
    assert mgr.chain("nothing:here") == []


def test_replacement_plus_wrappers(mods: Modules, mgr: PatchManager) -> None:
    """Wrappers wrap the replacement, whatever the registration order."""
    t = imp(mods.target())
    target = f"{t.__name__}:f"
    mgr.register([wrap("w", target), replace("r", target, impl=lambda x: ("r", x))])
    mgr.apply()
    assert t.f(1) == ("w", ("r", 1))
    assert mgr.chain(target) == ["replacement r", "wrapper w (order 0)"]


def test_function_style_wrapper_chains_reverts_and_keeps_introspection(mods: Modules, mgr: PatchManager) -> None:
    """style="function": the factory's plain function is installed (no wrapt object), chained with
    wrapt-style wrappers by order, reported without its own closure, and reverted by identity."""
    import inspect

    t = imp(mods.target())
    target = f"{t.__name__}:f"
    original = t.f

    def factory(inner: Any) -> Any:
        def fast(*args: Any, **kwargs: Any) -> Any:
            return ("fast", inner(*args, **kwargs))
        return fast  # no functools.wraps: the manager applies it

    mgr.register([Patch(name="fast", target=target, kind="wrap", impl=factory, style="function",
                        reason="test"), wrap("w", target, order=1)])
    mgr.apply()
    assert t.f(2) == ("w", ("fast", ("f", 2)))
    assert mgr.chain(target) == [f"original {target}", "wrapper fast (order 0, plain function)",
                                 "wrapper w (order 1)"]
    fast = t.f.__wrapped__
    assert type(fast).__name__ == "function" and fast.__wrapped__ is original
    assert fast.__name__ == "f" and inspect.signature(fast) == inspect.signature(original)
    assert status(mgr, "fast")["status"] == "applied"
    assert mgr.report(deep=True)[0].get("unrebindable", []) == []
    mgr.revert()
    assert t.f is original


def test_function_style_rejects_bad_use() -> None:
    """A style other than wrapt/function, or style='function' on a replacement, is a definition error."""
    with pytest.raises(PatchDefinitionError, match="style must be 'wrapt' or 'function'"):
        Patch(name="x", target="m:f", kind="wrap", impl=lambda w, i, a, k: w(*a, **k), style="fast", reason="r")
    with pytest.raises(PatchDefinitionError, match="style='function' is for wrap patches"):
        Patch(name="x", target="m:f", kind="replace", impl=lambda: None, style="function", reason="r")


def test_wrapper_registered_on_active_manager_recomposes_and_rebinds(mods: Modules, mgr: PatchManager) -> None:
    """Adding a wrapper after apply rebuilds the chain and moves aliases of the old chain to the new one."""
    t = imp(mods.target())
    u = imp(mods.user(t.__name__))
    target = f"{t.__name__}:f"
    original = t.f
    mgr.register([wrap("w1", target)])
    mgr.apply()
    mgr.register([wrap("w2", target)])
    assert u.f(1) == ("w2", ("w1", ("f", 1))) and u.f is t.f
    mgr.revert()
    assert u.f is original and t.f is original


def test_two_replacements_conflict_and_nothing_is_half_applied(mods: Modules, mgr: PatchManager) -> None:
    """A second replacement raises naming both patches; the manager and the target are unchanged."""
    t = imp(mods.target())
    target = f"{t.__name__}:f"
    mgr.register([replace("first", target, impl=lambda x: "first")])
    mgr.apply()
    installed = t.f
    before = mgr.report()
    with pytest.raises(PatchConflictError, match="'first' and 'second'"):
        mgr.register([wrap("innocent", f"{t.__name__}:other"), replace("second", target, impl=lambda x: "2")])
    assert mgr.report() == before
    assert t.f is installed and t.other(1) == ("other", 1)
    # within a single register call too
    fresh = PatchManager()
    with pytest.raises(PatchConflictError, match="'x' and 'y'"):
        fresh.register([replace("x", target, impl=len), replace("y", target, impl=len)])
    assert fresh.records() == []


def test_conflict_is_checked_at_apply_when_disable_changed(mods: Modules, mgr: PatchManager, env: Any) -> None:
    """Registered while one was disabled, then enabled: apply raises and installs nothing."""
    t = imp(mods.target())
    original = t.f
    target = f"{t.__name__}:f"
    env(PORTSPEED_DISABLE="second")
    mgr.register([replace("first", target, impl=lambda x: 1), replace("second", target, impl=lambda x: 2),
                  wrap("w", f"{t.__name__}:other")])
    env(PORTSPEED_DISABLE=None)
    with pytest.raises(PatchConflictError, match="'first' and 'second'"):
        mgr.apply()
    assert t.f is original and t.other(0) == ("other", 0)
    assert {d["status"] for d in mgr.report()} == {"registered"}


def test_same_name_other_content_raises_identical_is_noop(mods: Modules, mgr: PatchManager) -> None:
    p = wrap("w", f"{mods.pkg}.t:f")
    mgr.register([p])
    mgr.register([p])
    assert len(mgr.records()) == 1
    with pytest.raises(PatchConflictError, match="named 'w'"):
        mgr.register([wrap("w", f"{mods.pkg}.t:other")])
    with pytest.raises(PatchDefinitionError, match="Patch records"):
        mgr.register(["not a patch"])  # type: ignore[list-item]


# ---------------------------------------------------------------- idempotent, reversible, scoped
def test_apply_twice_is_apply_once(mods: Modules, mgr: PatchManager) -> None:
    t = imp(mods.target())
    u = imp(mods.user(t.__name__))
    mgr.register([wrap("w", f"{t.__name__}:f"), wrap("wm", f"{t.__name__}:C.m")])
    mgr.apply()
    first = (t.f, t.C.__dict__["m"], u.f, mgr.report())
    mgr.apply()
    assert (t.f, t.C.__dict__["m"], u.f) == first[:3]
    assert t.f is first[0] and t.C.__dict__["m"] is first[1]
    assert mgr.report() == first[3]
    assert t.f(1) == ("w", ("f", 1))  # wrapped once, not twice


def test_reapply_after_revert(mods: Modules, mgr: PatchManager) -> None:
    """apply -> revert -> apply works for imported modules and for ones imported only later."""
    t = imp(mods.target())
    later = mods.target("later")
    mgr.register([wrap("w", f"{t.__name__}:f"), wrap("wl", f"{later}:f")])
    mgr.apply()
    mgr.revert()
    assert t.f(1) == ("f", 1)
    mgr.apply()
    assert t.f(1) == ("w", ("f", 1))
    assert imp(later).f(1) == ("wl", ("f", 1))
    assert {d["status"] for d in mgr.report()} == {"applied"}


def test_hook_from_before_revert_does_not_patch(mods: Modules, mgr: PatchManager) -> None:
    """A module first imported after revert stays unpatched."""
    name = mods.target()
    mgr.register([wrap("w", f"{name}:f")])
    mgr.apply()
    mgr.revert()
    assert imp(name).f(1) == ("f", 1)


def test_scoped_restores_on_exit_and_on_exception(mods: Modules, mgr: PatchManager) -> None:
    t = imp(mods.target())
    u = imp(mods.user(t.__name__))
    original = t.f
    with mgr.scoped([wrap("s", f"{t.__name__}:f")]):
        assert u.f(1) == ("s", ("f", 1))
    assert t.f is original and u.f is original and mgr.records() == []
    with pytest.raises(KeyError):
        with mgr.scoped([wrap("s", f"{t.__name__}:f")]):
            assert t.f(1) == ("s", ("f", 1))
            raise KeyError("boom")
    assert t.f is original and u.f is original and mgr.records() == []


def test_scoped_on_active_manager_keeps_the_rest(mods: Modules, mgr: PatchManager) -> None:
    """Leaving a scope drops only its own patches; the previous chain is back, aliases too."""
    t = imp(mods.target())
    u = imp(mods.user(t.__name__))
    base = wrap("base", f"{t.__name__}:f")
    mgr.register([base])
    mgr.apply()
    with mgr.scoped([wrap("inner", f"{t.__name__}:f", order=1), base]):
        assert u.f(1) == ("inner", ("base", ("f", 1)))
    assert t.f(1) == ("base", ("f", 1)) and u.f is t.f
    assert [r.patch.name for r in mgr.records()] == ["base"]  # 'base' was already there: kept


def test_scoped_with_module_imported_inside_block(mods: Modules, mgr: PatchManager) -> None:
    name = mods.target()
    with mgr.scoped([wrap("s", f"{name}:f")]):
        t = imp(name)
        assert t.f(1) == ("s", ("f", 1))
    assert t.f(1) == ("f", 1)
