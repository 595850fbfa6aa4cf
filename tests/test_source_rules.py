"""The rules every source file keeps, read from the files themselves (no import): sizes, and names that exist.

Sizes, over every Python file of the repository (the package, ``patches/``, ``adapters/``, the tests, the
examples and the benchmarks; ``build/`` and virtual environments left out):

- no module over 400 lines;
- no function over 80 lines, from its ``def`` to its last line (a function nested in it counts in it);
- no line over 120 characters;
- no tuple of eight names unpacked on one line (``a, b, c, d, e, f, g, h = row``: name the fields instead).

Names: a dotted ``portspeed.*`` name in the package's comments and docstrings, the examples, the benchmarks and
the documentation names a module, or an attribute one defines (a lazily exported one included), or a string the
code uses as a name (a logger's, a patch's); a comment naming a function that does not exist fails here.
Each rule fails once, listing every file and line that breaks it.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_LINE = 120
MAX_UNPACKED = 7

#: source directory -> the package it installs as
PACKAGES = {"portspeed": "portspeed", "patches": "portspeed.patches", "adapters": "portspeed.adapters"}
#: where dotted portspeed names are checked (the tests name made-up modules on purpose)
NAMED_IN = ("portspeed", "patches", "adapters", "examples", "benchmarks", "docs", "README.md", "CONTRIBUTING.md")


def _skipped(path: Path) -> bool:
    parts = path.relative_to(REPO).parts
    return parts[0] == "build" or any(p.startswith(".") or p == "__pycache__" for p in parts)


@lru_cache(maxsize=None)
def python_files() -> tuple[Path, ...]:
    return tuple(sorted(p for p in REPO.rglob("*.py") if not _skipped(p)))


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _where(path: Path, line: int | None = None) -> str:
    rel = path.relative_to(REPO)
    return f"{rel}:{line}" if line is not None else str(rel)


def test_no_module_is_over_400_lines() -> None:
    """Modules of one concept, 400 lines at most (docs/architecture.md)."""
    long = [f"{_where(p)} ({n} lines)" for p in python_files()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, "modules over 400 lines:\n  " + "\n  ".join(long)


def test_no_function_is_over_80_lines() -> None:
    """A function reads on one screen: 80 lines at most, nested functions included."""
    long = []
    for p in python_files():
        for node in ast.walk(_tree(p)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{_where(p, node.lineno)} {node.name} ({n} lines)")
    assert not long, "functions over 80 lines:\n  " + "\n  ".join(long)


def test_no_line_is_over_120_characters() -> None:
    long = [f"{_where(p, i)} ({len(line)} characters)" for p in python_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, "lines over 120 characters:\n  " + "\n  ".join(long)


def _names(target: ast.AST) -> int:
    if isinstance(target, (ast.Tuple, ast.List)):
        return sum(_names(e) for e in target.elts)
    return 1


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        return [node.target]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [i.optional_vars for i in node.items if i.optional_vars is not None]
    return []


def test_no_eight_names_are_unpacked_on_one_line() -> None:
    """``ip, ik, op_, ok, gp, pp, pk, fr = OPS[name]`` hides what each field is: a named tuple says it."""
    wide = []
    for p in python_files():
        for node in ast.walk(_tree(p)):
            for t in _targets(node):
                if isinstance(t, (ast.Tuple, ast.List)) and t.lineno == t.end_lineno and _names(t) > MAX_UNPACKED:
                    wide.append(f"{_where(p, t.lineno)} ({_names(t)} names)")
    assert not wide, "eight or more names unpacked on one line:\n  " + "\n  ".join(wide)


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """The walkers above find a long function and a wide unpacking in a sample (so a rule cannot pass vacuously)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"def f():\n{body}\n    a, b, (c, d), e, f, g, h = range(8)\n")
    fn = tree.body[0]
    assert fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    assert [_names(t) for node in ast.walk(tree) for t in _targets(node) if isinstance(t, ast.Tuple)] == [8]


# ---------------------------------------------------------------------------------------------- names
def _module_file(dotted: str) -> Path | None:
    """The source file of module ``dotted`` (``portspeed.patches.x`` lives in ``patches/x.py``), or None."""
    parts = dotted.split(".")
    for folder, package in PACKAGES.items():
        pkg = package.split(".")
        if parts[:len(pkg)] == pkg and not (package == "portspeed" and parts[1:2] in (["patches"], ["adapters"])):
            base = REPO / folder / Path(*parts[len(pkg):]) if parts[len(pkg):] else REPO / folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


@lru_cache(maxsize=None)
def _defined(path: Path) -> frozenset[str]:
    """Every name module ``path`` binds at its top level, and, with a module ``__getattr__``, the string keys of its
    dict literals (the lazily exported names)."""
    names: set[str] = set()
    tree = _tree(path)
    lazy = False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
                lazy |= any(isinstance(n, ast.Name) and n.id == "__getattr__" for n in ast.walk(t))
    if lazy or "__getattr__" in names:
        names.update(k.value for d in ast.walk(tree) if isinstance(d, ast.Dict)
                     for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return frozenset(names)


@lru_cache(maxsize=None)
def _string_names() -> frozenset[str]:
    """Dotted ``portspeed.*`` strings the code itself uses (logger names, patch names, f-string heads)."""
    out: set[str] = set()
    for p in python_files():
        for node in ast.walk(_tree(p)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("portspeed."):
                out.add(node.value.rstrip("."))
    return frozenset(out)


def _exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:i]))
        if path is None:
            continue
        rest = parts[i:]  # the longest module prefix is found first: rest[0] is no submodule
        return not rest or rest[0] in _defined(path) or rest[0].startswith("__")
    return False


def _named_files() -> list[Path]:
    out = []
    for entry in NAMED_IN:
        path = REPO / entry
        out += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md"))
    return [p for p in out if not _skipped(p)]


def test_every_portspeed_name_in_comments_and_docs_exists() -> None:
    """``portspeed.activation.waiting()`` in a comment, when the function is ``portspeed.integrations.activation``'s,
    sends a reader nowhere: every dotted portspeed name must resolve in the sources."""
    strings = _string_names()
    missing = []
    for p in _named_files():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for m in re.finditer(r"\bportspeed(?:\.[A-Za-z_]\w*)+", line):
                name = m.group(0)
                if not _exists(name) and not any(s == name or s.startswith(name + ".") for s in strings):
                    missing.append(f"{_where(p, i)} {name}")
    assert not missing, "names that exist nowhere:\n  " + "\n  ".join(missing)


def test_the_name_check_tells_a_real_name_from_a_made_up_one() -> None:
    assert _exists("portspeed.integrations.activation.waiting") and _exists("portspeed.comm.real_backend")
    assert _exists("portspeed.patches.torch_distributed.PATCHES") and _exists("portspeed.vendor")
    assert not _exists("portspeed.activation.waiting") and not _exists("portspeed.comm.no_such_function")
