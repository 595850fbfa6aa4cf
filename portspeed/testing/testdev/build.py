"""Building and loading the test device's C++ extension (``torch.utils.cpp_extension``).

Why a build step: the test device is C++ against the installed torch's headers, so it is
compiled on the machine that runs it (PyPI dependencies only: torch and ninja, and the
system C++ compiler). The build is cached per Python and torch version; a source change
rebuilds it. ``make test`` / ``make demo`` build it once up front
(``python -m portspeed.testing.testdev build``); importing ``runtime`` builds it if the
cache is empty, so a fresh machine never needs a manual step.

Where: ``PORTSPEED_TESTDEV_BUILD_DIR`` if set, else ``<sys.prefix>/var/portspeed-testdev/<tag>``
(inside the virtual environment, so ``make clean`` removes it), else
``~/.cache/portspeed/testdev/<tag>`` when the prefix is not writable. ``built()`` /
``missing_build()`` answer whether a current build is there without creating or compiling
anything (`portspeed info` asks them).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

__all__ = ["BUILD_HINT", "EXTENSION_NAME", "SOURCES", "TestdevBuildError", "build_dir", "built", "load_extension",
           "missing_build"]


class TestdevBuildError(ImportError):
    """The test device's extension could not be built or loaded.

    An ImportError, as a vendor package that fails to import raises: portspeed's adapter
    selection then reports it once, naming the adapter and what to install.
    """

EXTENSION_NAME = "portspeed_testdev_ext"
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES: tuple[str, ...] = ("device.cpp", "memory.cpp", "kernels.cpp", "ccl.cpp", "fused.cpp", "module.cpp")
_CFLAGS: tuple[str, ...] = ("-O1", "-std=c++20")

_loaded: ModuleType | None = None


def _tag() -> str:
    import torch

    return f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.replace('+', '_')}"


def _candidates() -> list[Path]:
    env = os.environ.get("PORTSPEED_TESTDEV_BUILD_DIR")
    if env:
        return [Path(env)]
    return [Path(sys.prefix) / "var" / "portspeed-testdev", Path.home() / ".cache" / "portspeed" / "testdev"]


def build_dir() -> Path:
    """The cache folder of this Python and torch (created if missing)."""
    candidates = _candidates()
    last_error: OSError | None = None
    for base in candidates:
        path = base / _tag()
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError as exc:
            last_error = exc
    raise TestdevBuildError(
        f"no writable build folder for the portspeed test device (tried {', '.join(map(str, candidates))}); "
        "set PORTSPEED_TESTDEV_BUILD_DIR to a writable folder"
    ) from last_error


def _fingerprint() -> str:
    """What the built library depends on: the sources, the flags, this Python and this torch."""
    import torch

    h = hashlib.sha256()
    for name in SOURCES + ("testdev.h",):
        h.update(name.encode() + b"\0" + (_CSRC / name).read_bytes())
    h.update(" ".join([*_CFLAGS, sys.version, torch.__version__, torch.__file__]).encode())
    return h.hexdigest()


#: what to run when the build is missing or stale
BUILD_HINT = "`make testdev` (python -m portspeed.testing.testdev build)"


def built() -> Path | None:
    """The built library that matches today's sources, flags, Python and torch; None if there is none.

    A lookup only: it creates no folder and starts no compiler, so `portspeed info` can ask.
    """
    want = _fingerprint()
    for base in _candidates():
        folder = base / _tag()
        library, stamp = folder / f"{EXTENSION_NAME}.so", folder / "fingerprint"
        try:
            if library.is_file() and stamp.is_file() and stamp.read_text() == want:
                return library
        except OSError:
            continue
    return None


def missing_build() -> str | None:
    """Why the runtime would compile before it loads ("not built: ...", naming what to run), or None when built."""
    if built() is not None:
        return None
    stale = any((base / _tag() / f"{EXTENSION_NAME}.so").is_file() for base in _candidates())
    return f"not built: {BUILD_HINT}" + (" (the build there predates the sources)" if stale else "")


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive lock the kernel drops when its holder dies (a killed build never blocks the next)."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _import(path: Path) -> ModuleType:
    if EXTENSION_NAME in sys.modules:
        return sys.modules[EXTENSION_NAME]
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[EXTENSION_NAME] = module
    return module


def load_extension(verbose: bool = False) -> ModuleType:
    """Import the extension, compiling it first when the cache does not match the sources; once per process.

    A built library whose fingerprint matches is imported directly (no compiler, no lock), so
    many ranks start at once cheaply. Building is serialised by a lock the kernel releases
    if its holder is killed; torch's own lock file, which a killed build leaves behind and
    which would make every later build wait forever, is removed under that lock.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    folder = build_dir()
    library, stamp = folder / f"{EXTENSION_NAME}.so", folder / "fingerprint"
    want = _fingerprint()

    def fresh() -> bool:
        return library.exists() and stamp.exists() and stamp.read_text() == want

    if not fresh():
        with _exclusive(folder / "portspeed-build.lock"):
            if not fresh():
                (folder / "lock").unlink(missing_ok=True)
                _build(folder, verbose)
                stamp.write_text(want)
    _loaded = _import(library)
    return _loaded


def _build(folder: Path, verbose: bool) -> None:
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(_CSRC / s) for s in SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_include_paths=[str(_CSRC)],
            build_directory=str(folder),
            with_cuda=False,
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        raise TestdevBuildError(
            f"building the portspeed test device failed: {exc}\n"
            "It needs the system C++ compiler (g++) and ninja (pip install ninja); "
            "run `python -m portspeed.testing.testdev build --verbose` to see the compiler output."
        ) from exc


def main(argv: list[str] | None = None) -> int:
    """``python -m portspeed.testing.testdev build [--verbose]``: build now and say how long it took."""
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in args
    start = time.perf_counter()
    load_extension(verbose=verbose)
    took = time.perf_counter() - start
    print(f"portspeed test device (a test device, not hardware): built or loaded in {took:.1f} s ({build_dir()})")
    return 0
