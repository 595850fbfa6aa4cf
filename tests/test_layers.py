"""The import direction of portspeed's layers (docs/architecture.md), checked over every module's source.

Every ``import`` and ``from ... import`` in portspeed, ``portspeed.patches`` and
``portspeed.adapters`` counts, at module level or inside a function (a deferred import is
still a dependency). One failure lists every violation: importing module, imported module,
and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: source directory -> the package it installs as
SOURCES = {ROOT / "portspeed": "portspeed", ROOT / "patches": "portspeed.patches",
           ROOT / "adapters": "portspeed.adapters"}

#: layer -> module prefixes (longest prefix wins: a feature's folder holds modules of several floors, e.g.
#: ``portspeed.probe`` (plugins), ``portspeed.probe.reading`` (parity), ``portspeed.probe.cli`` (top))
LAYERS: dict[str, tuple[str, ...]] = {
    "foundation": ("portspeed.errors", "portspeed.config", "portspeed.settings", "portspeed.versions",
                   "portspeed.lazy", "portspeed.teardown", "portspeed.plotting"),
    "patching": ("portspeed.patching",),
    "accelerator": ("portspeed.accelerator", "portspeed.vendor"),
    "translation": ("portspeed.translation",),
    "trace": ("portspeed.trace",),
    "comm": ("portspeed.comm",),
    "plugins": ("portspeed.patches", "portspeed.adapters", "portspeed.testing", "portspeed.portable_te",
                "portspeed.probe", "portspeed.perf"),
    "parity": ("portspeed.parity", "portspeed.trace.dumps", "portspeed.probe.reading", "portspeed.perf.reading"),
    "integrations": ("portspeed.integrations", "portspeed.megatron_adaptor", "portspeed.deepspeed_adaptor"),
    "top": ("portspeed.cli", "portspeed.conformance", "portspeed.trace.cli", "portspeed.probe.cli",
            "portspeed.perf.cli"),
}

#: the package ``portspeed`` itself (``portspeed/__init__.py``: the public surface, ``portspeed.manager()``,
#: ``portspeed.report()``, lazy names) is placed by its exact name (as a prefix it is every module's): above the
#: engine whose names it serves, below the plugins and integrations that import it
ROOT_LAYER = "surface"

#: layer -> the layers it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": set(),
    "patching": {"foundation"},
    "accelerator": {"foundation"},
    "translation": {"foundation", "accelerator"},
    "trace": {"foundation"},
    "comm": {"foundation", "accelerator", "trace"},
    ROOT_LAYER: {"foundation", "patching", "accelerator"},
    "plugins": {"foundation", "patching", "accelerator", "translation", "trace", "comm", ROOT_LAYER},
    "parity": {"foundation"},
    "integrations": {"foundation", "patching", "accelerator", "translation", "trace", "comm", ROOT_LAYER, "plugins",
                     "parity"},
    "top": {"foundation", "patching", "accelerator", "translation", "trace", "comm", ROOT_LAYER, "plugins", "parity",
            "integrations"},
}

#: single edges allowed across the rule above, each with its reason: (importing module, imported module)
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("portspeed.patching.manager", "portspeed.accelerator"):
        "the manager asks for the selected adapter (get_accelerator) to hand it to a patch's when= condition",
    ("portspeed.patching.record", "portspeed.accelerator"):
        "a type annotation only (under TYPE_CHECKING): a when= condition takes the Accelerator",
}

#: only these layers may import ``portspeed.patches`` (patch modules are data the integrations register)
PATCHES_IMPORTERS = {"integrations"}


def _layer(module: str) -> str | None:
    if module == "portspeed":
        return ROOT_LAYER
    best, found = "", None
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, found = p, layer
    return found


def _modules() -> dict[str, Path]:
    out = {}
    for src, pkg in SOURCES.items():
        for path in src.rglob("*.py"):
            rel = path.relative_to(src).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((pkg, *rel))] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:  # `from pkg import submodule` depends on the submodule
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
    return {m for m in found if m == "portspeed" or m.startswith("portspeed.")}


def test_every_module_has_a_layer() -> None:
    """A new module must be placed in a layer (and the docs' table) before it can be checked."""
    unplaced = sorted(m for m in _modules() if _layer(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS and docs/architecture.md): {unplaced}"


def test_imports_run_one_way() -> None:
    """foundation <- engine (patching; accelerator <- translation; trace <- comm) <- plugins <- integrations <- top;
    parity (and each feature's reading): foundation."""
    modules = _modules()
    known = set(modules)
    violations = []
    for name, path in sorted(modules.items()):
        src = _layer(name)
        if src is None:
            continue
        for target in sorted(_imports(name, path, known)):
            dst = _layer(target)
            if dst is None or dst == src or (name, target) in EXCEPTIONS:
                continue
            if target.startswith("portspeed.patches") and src not in PATCHES_IMPORTERS and src != "plugins":
                violations.append(f"{name} ({src}) imports {target}: only the integrations import portspeed.patches")
            elif dst not in MAY_IMPORT[src]:
                violations.append(f"{name} ({src}) imports {target} ({dst}): {src} may import "
                                  f"{', '.join(sorted(MAY_IMPORT[src])) or 'nothing of portspeed'}")
    assert not violations, "imports against the layering:\n  " + "\n  ".join(violations)


def test_patches_do_not_import_adaptors_or_each_others_layers() -> None:
    """A patch module never imports an adaptor or an integration (the cycle the house removed)."""
    modules = _modules()
    known = set(modules)
    bad = [f"{n} imports {t}" for n, p in sorted(modules.items()) if n.startswith("portspeed.patches")
           for t in _imports(n, p, known) if _layer(t) in ("integrations", "top")]
    assert not bad, bad


def test_the_checker_sees_deferred_and_relative_imports(tmp_path: Path) -> None:
    """The checker counts an import inside a function and resolves a relative one (else it could not fail)."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from portspeed.cli import main\nfrom .sibling import x\n")
    got = _imports("portspeed.patches.megatron.mod", f, {"portspeed.patches.megatron.sibling"})
    assert got == {"portspeed.cli", "portspeed.patches.megatron.sibling"}


def test_each_exception_is_still_needed() -> None:
    """An allowed edge that no module takes any more is deleted from EXCEPTIONS, not kept as a loophole."""
    modules = _modules()
    known = set(modules)
    unused = [edge for edge in EXCEPTIONS if edge[1] not in _imports(edge[0], modules[edge[0]], known)]
    assert not unused, f"EXCEPTIONS no module uses any more: {unused}"


def _subpackage(module: str) -> str:
    """``portspeed.comm.router`` -> ``portspeed.comm``; ``portspeed.patches.megatron.x`` -> ``portspeed.patches``."""
    return ".".join(module.split(".")[:2])


def _subpackage_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        src = _subpackage(name)
        for target in _imports(name, path, known):
            dst = _subpackage(target)
            if dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_subpackages_import_without_cycles() -> None:
    """No two of portspeed's sub-packages import each other, directly or round a longer loop (deferred imports too)."""
    cycle = _cycle(_subpackage_graph())
    assert cycle is None, "sub-packages import each other: " + " -> ".join(cycle)


def test_the_package_root_imports_nothing_above_the_engine() -> None:
    """``portspeed/__init__.py`` is placed (its own layer) and checked like any module: the edge to the integrations
    that ``report()`` took is gone (they register what it runs first: ``portspeed.before_report``)."""
    modules = _modules()
    got = _imports("portspeed", modules["portspeed"], set(modules))
    assert _layer("portspeed") == ROOT_LAYER and got, got
    above = sorted(t for t in got if _layer(t) not in MAY_IMPORT[ROOT_LAYER] | {ROOT_LAYER})
    assert not above, f"portspeed/__init__.py imports above its layer: {above}"


#: sub-packages whose modules import one another without a loop, deferred imports included (the recorder's
#: modules once did, in comm/: trace <-> trace_triggers / trace_torch)
ACYCLIC_MODULES = ("portspeed.comm", "portspeed.translation", "portspeed.trace")


def test_modules_of_a_subpackage_import_without_cycles() -> None:
    """Inside each package of ``ACYCLIC_MODULES`` no module imports another that imports it back, round any loop."""
    modules = _modules()
    known = set(modules)
    for package in ACYCLIC_MODULES:
        inside = {n for n in modules if n.startswith(package + ".")}
        graph = {n: {t for t in _imports(n, modules[n], known) if t in inside and t != n} for n in inside}
        cycle = _cycle(graph)
        assert cycle is None, f"modules of {package} import each other: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The cycle check can fail: a two-package loop (accelerator <-> comm, as before the vocabulary moved) is found."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
