"""The PatchManager contract (portspeed/manager.py docstring), clause by clause.

Every test writes real modules into a temporary directory under a unique package name,
imports them for real, and removes them from sys.modules afterwards (as wrapt's own
post-import hook tests do), so no test sees another's modules or patches.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from portspeed.errors import PatchConflictError, PatchDefinitionError, PatchStrictError
from portspeed.patching.manager import STATUSES, PatchManager
from portspeed.patching.record import Patch
from portspeed.versions import distribution_version

_counter = itertools.count()

TARGET = '''
def f(x):
    return ("f", x)

def other(x):
    return ("other", x)

class C:
    def m(self, x):
        return ("m", x)

    @staticmethod
    def s(x):
        return ("s", x)

    @classmethod
    def c(cls, x):
        return (cls.__name__, x)

class Sub(C):
    pass
'''

USER = '''
from {t} import f, C
from {t} import f as g
import {t} as z

class D:
    h = f

class E(C):
    pass
'''


class Modules:
    """Writes modules under one unique package in a tmp dir; forgets them at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pkg = f"pstgt{next(_counter)}_{id(self) % 10000}"
        (root / self.pkg).mkdir()
        (root / self.pkg / "__init__.py").write_text("")

    def write(self, name: str, source: str) -> str:
        """Write ``<pkg>.<name>`` and return its dotted name (not imported)."""
        (self.root / self.pkg / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        return f"{self.pkg}.{name}"

    def target(self, name: str = "t") -> str:
        return self.write(name, TARGET)

    def user(self, target: str, name: str = "u") -> str:
        return self.write(name, USER.format(t=target))

    def cleanup(self) -> None:
        for name in [n for n in sys.modules if n == self.pkg or n.startswith(self.pkg + ".")]:
            del sys.modules[name]


@pytest.fixture
def env(portspeed_env: Callable[..., None]) -> Callable[..., None]:
    """Set PORTSPEED_* variables for one test (tests/conftest.py's portspeed_env, by its short name here)."""
    return portspeed_env


@pytest.fixture
def mods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Modules]:
    monkeypatch.syspath_prepend(str(tmp_path))
    m = Modules(tmp_path)
    yield m
    m.cleanup()


@pytest.fixture
def mgr(env: Callable[..., None]) -> Iterator[PatchManager]:
    m = PatchManager()
    yield m
    m.revert()


def tag(label: str) -> Callable[..., Any]:
    """A wrapt-style wrapper that tags the result, so call nesting is visible."""

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return (label, wrapped(*args, **kwargs))

    return wrapper


def wrap(name: str, target: str, label: str | None = None, **kw: Any) -> Patch:
    return Patch(name=name, target=target, kind="wrap", impl=tag(label or name), reason="test wrapper", **kw)


def replace(name: str, target: str, impl: Any, **kw: Any) -> Patch:
    return Patch(name=name, target=target, kind="replace", impl=impl, reason="test replacement", **kw)


def status(m: PatchManager, name: str) -> dict[str, Any]:
    return next(d for d in m.report() if d["name"] == name)


def imp(name: str) -> Any:
    return importlib.import_module(name)


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
