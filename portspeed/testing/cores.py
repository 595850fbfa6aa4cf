"""Native backtraces of a child that aborted: core files on, read by gdb, attached to the failure.

Why: a rank that dies of SIGABRT in C++ (``std::terminate``) leaves Python's faulthandler with one
line, "Fatal Python error: Aborted", and the Python stack of the thread that was current, which is
rarely the thread that aborted. The cause is in the native stacks of every thread. The test launchers
(``run_ranks`` here, ``tests/helpers/launch.py``) start their children with ``enable_cores`` and, when
something aborted, call ``collect``: each core file the children left in their working folder is read
by ``gdb -batch -ex 'thread apply all bt'`` and removed.

Limits: the kernel writes the core where ``/proc/sys/kernel/core_pattern`` says; with the default
``core`` (the project's machines) that is the aborting process's working folder. A pattern that pipes
to a crash collector (``|...``) leaves no file here, and ``collect`` says so. Cores hold anonymous memory
only (``coredump_filter`` 0x1; gdb reads the libraries from disk): tens of MB for a torch process.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["aborted", "collect", "enable_cores", "native_backtrace"]

_PATTERN = Path("/proc/sys/kernel/core_pattern")


def enable_cores() -> None:
    """In a child before exec (``preexec_fn``): core files on, anonymous memory only; inherited by its children."""
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        return
    try:
        Path("/proc/self/coredump_filter").write_text("0x1")
    except OSError:
        pass


def native_backtrace(core: Path, executable: str = sys.executable) -> str:
    """Every thread's native backtrace in ``core`` (gdb), or one line saying why there is none."""
    if shutil.which("gdb") is None:
        return f"no native backtrace from {core}: gdb is not installed (apt-get install gdb)\n"
    try:
        res = subprocess.run(["gdb", "-batch", "-nx", "-iex", "set auto-load off", "-ex", "set pagination off",
                              "-ex", "thread apply all bt",
                              executable, str(core)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return f"no native backtrace from {core}: gdb took over 300 s\n"
    keep = [ln for ln in res.stdout.splitlines() if not ln.startswith(("[New LWP", "warning:"))]
    return "\n".join(keep) + "\n"


def collect(folder: Path, since: float, executable: str = sys.executable) -> str:
    """The backtraces of the core files written in ``folder`` after ``since`` (a ``time.time()``); removes them.

    Empty when there is none and the kernel would have written them there; otherwise a line saying where
    the kernel sends cores instead.
    """
    cores = [p for p in sorted(Path(folder).glob("core*")) if p.is_file() and _is_core(p) and
             p.stat().st_mtime >= since - 1]
    if not cores:
        pattern = _PATTERN.read_text().strip() if _PATTERN.exists() else "?"
        if pattern.startswith("|") or "/" in pattern:
            return f"no core file in {folder}: kernel.core_pattern is {pattern!r}\n"
        return ""
    out = []
    for core in cores:
        out.append(f"--- native backtrace of every thread, from {core.name} ---\n")
        out.append(native_backtrace(core, executable))
        try:
            core.unlink()
        except OSError:
            pass
    return "".join(out)


def _is_core(path: Path) -> bool:
    """An ELF core file (not a source file or folder named core*)."""
    try:
        with open(path, "rb") as f:
            head = f.read(18)
    except OSError:
        return False
    return head[:4] == b"\x7fELF" and len(head) == 18 and int.from_bytes(head[16:18], "little") == 4


def aborted(returncode: int | None, text: str) -> bool:
    """Whether a child (or a rank a launcher reported) died of SIGABRT."""
    return returncode == -6 or "SIGABRT" in text or "Fatal Python error: Aborted" in text or "exitcode: -6" in text
