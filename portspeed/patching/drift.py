"""Upstream drift: which patches' targets moved or changed in a given Megatron source, before users meet it.

A patch is written against the source of its target. When upstream renames the target, or
changes its body, the patch may silently stop fitting. ``check`` reads a Megatron source
*without importing it* (a Megatron-LM checkout, a megatron-core wheel read from the
archive, a bare git directory at a tag, or the installed package) and, for every patch,
compares a fingerprint of the target's source with the one recorded for that release:

* ``ok``: the target is there and its fingerprint equals the one recorded for this release,
  or (release not recorded) for the newest recorded release before it;
* ``changed``: the target's source differs from that fingerprint (review the patch, then
  record the release: ``portspeed patches --check SOURCE --record``);
* ``missing``: the target's module or attribute is gone;
* ``inactive``: the patch's declared range excludes the release (a decision, not drift);
* ``absent``: the source has no such package at all (a wheel carries megatron.core but
  not Megatron-LM's megatron.training);
* ``unrecorded``: no fingerprint was ever recorded for the patch.

What is hashed: the AST of the target's definition (its ``def`` or ``class`` statement, or
the assignment that binds it), docstrings removed, written out field by field without line
numbers and without empty fields (so the text is the same on Python 3.10 to 3.13, whose
``ast.dump`` differ): comments, formatting, docstrings and moves within the file do not
count; any change to code does.
The first 16 hex digits of its SHA-256 are kept, per (patch, release), in
``portspeed/patches/megatron/fingerprints.py``.

``scan_watched`` fingerprints the sources a narrowed range watches (``narrowing.NarrowRange.watch``;
a top-level script of the checkout, ``pretrain_gpt:get_batch``, counts as a module), None where
the source shows they are not there; ``--record`` keeps them (``WATCHED``), so a range's edge can
be checked against the release where its upstream fact appears, without a checkout.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterable

from portspeed.versions import package_info_version

__all__ = ["Finding", "SourceError", "SourceTree", "check", "fingerprint", "open_source", "scan_watched", "DRIFT"]

#: top-level files of a Megatron-LM checkout the drift reader reads besides megatron/ (watched scripts)
SCRIPTS = ("pretrain_gpt.py",)

#: statuses that count as drift (exit status 1)
DRIFT = ("changed", "missing", "unrecorded")


class SourceError(Exception):
    """The source to check could not be opened or read; the message says what to give instead."""


class SourceTree:
    """Files of one Megatron source, read by path relative to the folder that holds ``megatron/``."""

    label = ""

    def read(self, relpath: str) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    def has_dir(self, relpath: str) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def release(self) -> Any:
        """The megatron-core release this source declares (megatron/core/package_info.py)."""
        text = self.read("megatron/core/package_info.py")
        version = package_info_version(text) if text is not None else None
        if version is None:
            raise SourceError(f"{self.label}: no megatron/core/package_info.py with MAJOR/MINOR/PATCH; "
                              "give a Megatron-LM checkout, a megatron-core wheel, GITDIR@TAG or a version")
        return version


class DirTree(SourceTree):
    def __init__(self, root: Path) -> None:
        self.root, self.label = root, str(root)

    def read(self, relpath: str) -> str | None:
        try:
            return (self.root / relpath).read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            return None

    def has_dir(self, relpath: str) -> bool:
        return (self.root / relpath).is_dir()


class WheelTree(SourceTree):
    def __init__(self, path: Path) -> None:
        self.label = str(path)
        try:
            with zipfile.ZipFile(path) as zf:
                self._files = {n: zf.read(n) for n in zf.namelist() if n.endswith(".py")}
        except (OSError, zipfile.BadZipFile) as exc:
            raise SourceError(f"{path}: not a readable wheel ({exc})") from None

    def read(self, relpath: str) -> str | None:
        data = self._files.get(relpath)
        return data.decode("utf-8") if data is not None else None

    def has_dir(self, relpath: str) -> bool:
        prefix = relpath.rstrip("/") + "/"
        return any(n.startswith(prefix) for n in self._files)


class GitTree(SourceTree):
    """A revision of a (bare) git directory, read with ``git show REV:PATH``."""

    def __init__(self, gitdir: Path, rev: str) -> None:
        self.gitdir, self.rev, self.label = gitdir, rev, f"{gitdir}@{rev}"
        res = self._git("ls-tree", "-r", "--name-only", rev, "--", "megatron", *SCRIPTS)
        if res.returncode != 0:
            raise SourceError(f"{self.label}: git cannot list revision {rev!r}: {res.stderr.strip()}")
        self._paths = set(res.stdout.split("\n"))

    def _git(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", f"--git-dir={self.gitdir}", *args], capture_output=True, text=True)

    def read(self, relpath: str) -> str | None:
        if relpath not in self._paths:
            return None
        res = self._git("show", f"{self.rev}:{relpath}")
        return res.stdout if res.returncode == 0 else None

    def has_dir(self, relpath: str) -> bool:
        prefix = relpath.rstrip("/") + "/"
        return any(p.startswith(prefix) for p in self._paths)


def _download_wheel(version: str, cache: Path) -> Path:
    """megatron-core==version as a cp312 wheel from the package index (pip download, nothing installed)."""
    found = sorted(cache.glob(f"megatron_core-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
           "--python-version", "3.12", "--dest", str(cache), f"megatron-core=={version}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache.glob(f"megatron_core-{version}-*.whl"))
    if res.returncode != 0 or not found:
        raise SourceError(f"could not download megatron-core=={version} ({' '.join(cmd)}): "
                          f"{(res.stderr or res.stdout).strip()[-500:]}")
    return found[0]


def open_source(spec: str, cache: Path | None = None) -> SourceTree:
    """A checkout or site-packages folder, a .whl, ``GITDIR@REV``, ``installed``, or a release number to download."""
    path = Path(spec)
    if spec == "installed":
        from portspeed.versions import _package_dir

        core = _package_dir("megatron.core")
        if core is None:
            raise SourceError("no importable megatron.core here; give a checkout, a wheel or a version instead")
        return DirTree(Path(core).parent.parent)
    if path.is_dir():
        if (path / "megatron" / "core").is_dir():
            return DirTree(path)
        raise SourceError(f"{spec}: no megatron/core inside; give the folder that holds megatron/ "
                          "(a Megatron-LM checkout or site-packages)")
    if path.is_file() and path.suffix == ".whl":
        return WheelTree(path)
    gitdir, at, rev = spec.rpartition("@")
    if at and Path(gitdir).is_dir() and rev:
        return GitTree(Path(gitdir), rev)
    from packaging.version import InvalidVersion, Version

    try:
        Version(spec)
    except InvalidVersion:
        raise SourceError(f"{spec!r} is neither a folder, a .whl, GITDIR@REV, 'installed' nor a release "
                          "number such as 0.19.2") from None
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "portspeed" / "wheels"
    return WheelTree(_download_wheel(spec, cache))


# ----------------------------------------------------------------------------- fingerprints
def _strip_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            n.body = body[1:] or [ast.Pass()]
    return node


def _names(target: ast.expr) -> list[str]:
    """Names an assignment target binds: ``x``, or each name of ``(a, b) = ...``."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _names(elt)]
    return []


def _binds(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(name in _names(t) for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    return False


def _find(body: list[ast.stmt], path: tuple[str, ...]) -> ast.stmt | None:
    """The last statement of ``body`` binding path[0] (the one in effect), walked into classes."""
    node = None
    for stmt in body:
        if _binds(stmt, path[0]):
            node = stmt
        elif isinstance(stmt, (ast.If, ast.Try)):  # version or import guards bind at module level too
            for block in (stmt.body, getattr(stmt, "orelse", []), *[h.body for h in getattr(stmt, "handlers", [])]):
                found = _find(block, path[:1])
                if found is not None:
                    node = found
    if node is None or len(path) == 1:
        return node
    return _find(node.body, path[1:]) if isinstance(node, ast.ClassDef) else None


def _canonical(node: Any) -> str:
    """A dump of the AST that is the same on every Python: fields that are empty or None are left out.

    ``ast.dump`` itself differs between versions (3.12 adds ``type_params=[]`` to every
    def and class; 3.13 stops printing empty fields), so it cannot be the hashed text.
    """
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            parts.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({', '.join(parts)})"
    if isinstance(node, list):
        return "[" + ", ".join(_canonical(v) for v in node) + "]"
    return repr(node)


def fingerprint(source: str, attr_path: tuple[str, ...]) -> str | None:
    """16 hex digits of SHA-256 over the target definition's AST (no docstrings, no positions); None if absent."""
    node = _find(ast.parse(source).body, attr_path)
    if node is None:
        return None
    dump = _canonical(_strip_docstrings(node))
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the check
@dataclasses.dataclass
class Finding:
    """The check's answer for one patch against one source."""

    name: str
    target: str
    status: str
    detail: str
    fingerprint: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _module_file(tree: SourceTree, module: str) -> tuple[str | None, str]:
    base = module.replace(".", "/")
    for rel in (base + ".py", base + "/__init__.py"):
        text = tree.read(rel)
        if text is not None:
            return text, rel
    return None, base + ".py"


def _baseline(recorded: dict[str, str], release: Any) -> tuple[str, str] | None:
    """(release, fingerprint) the patch was last checked against at or before ``release``."""
    from packaging.version import Version

    older = sorted((Version(r), r) for r in recorded if Version(r) <= release)
    if older:
        return older[-1][1], recorded[older[-1][1]]
    return None


def check_one(patch: Any, tree: SourceTree, release: Any) -> Finding:
    """One patch against ``tree`` (at ``release``): see the module docstring for the statuses."""
    name, target = patch.name, patch.target
    if patch.versions and release not in patch.specifier:
        return Finding(name, target, "inactive", f"{release} is outside {patch.versions!r}")
    text, rel = _module_file(tree, patch.module)
    top = "/".join(patch.module.split(".")[:2])
    if text is None:
        if not tree.has_dir(top):
            return Finding(name, target, "absent", f"this source has no {top}/ (not part of it)")
        return Finding(name, target, "missing", f"module file {rel} is gone")
    try:
        digest = fingerprint(text, patch.attr_path)
    except SyntaxError as exc:
        return Finding(name, target, "missing", f"{rel} does not parse here: {exc}")
    if digest is None:
        return Finding(name, target, "missing", f"{'.'.join(patch.attr_path)} is not defined in {rel}")
    recorded = dict(getattr(patch, "fingerprints", ()) or ())
    if not recorded:
        return Finding(name, target, "unrecorded", "no fingerprint recorded for this patch", digest)
    base = _baseline(recorded, release)
    if base is None:
        return Finding(name, target, "unrecorded", f"no fingerprint recorded at or before {release} "
                       f"(recorded: {', '.join(sorted(recorded))})", digest)
    at, expected = base
    if digest == expected:
        return Finding(name, target, "ok", f"same as recorded for {at}" if at != str(release) else "as recorded",
                       digest)
    return Finding(name, target, "changed", f"{rel}: source changed since {at} (fingerprint {expected} -> {digest})",
                   digest)


def check(patches: Iterable[Any], tree: SourceTree) -> tuple[Any, list[Finding]]:
    """(release, findings) for every patch whose target is in Megatron (``megatron.*``)."""
    release = tree.release()
    return release, [check_one(p, tree, release) for p in patches if p.module.split(".")[0] == "megatron"]


# ----------------------------------------------------------------------------- watched sources
def watched_fingerprint(tree: SourceTree, watch: str) -> tuple[bool, str | None]:
    """(known, fingerprint) of ``module:attr`` in ``tree``; fingerprint None when the source shows it is not there.

    Why: a range narrowed for an upstream fact (``portspeed.patching.narrowing.UPSTREAM``) is
    checked against the releases where its watched source appears, disappears or changes. A
    source that cannot tell (a wheel has no ``megatron/training``, ``megatron/legacy`` or
    top-level script) gives ``(False, None)``: nothing is recorded for it.
    """
    module, _, attr = watch.partition(":")
    text, _rel = _module_file(tree, module)
    if text is None:
        is_checkout = tree.has_dir("megatron/training")
        in_core = module.startswith("megatron.core")
        return (is_checkout or in_core), None
    try:
        return True, fingerprint(text, tuple(attr.split(".")))
    except SyntaxError:
        return False, None


def scan_watched(tree: SourceTree, watches: Iterable[str]) -> dict[str, str | None]:
    """watch -> fingerprint (None: not there) for every watched source this tree can tell about."""
    out: dict[str, str | None] = {}
    for watch in watches:
        known, digest = watched_fingerprint(tree, watch)
        if known:
            out[watch] = digest
    return out
