"""`portspeed run --hang-timeout S`: end a job no rank makes progress in, and say why.

Why: Gloo's default timeout is 30 minutes, and a rank stuck in Python outside any collective
has none at all; the user wants the job ended, and the rank and collective named, in S
seconds. Each worker's recorder (``portspeed.comm.trace``) keeps a heartbeat file in the dump
folder whose mtime is the time of its last completed call (or, until its first call, now: start-up
is progress) and whose text is its pid. This
launcher-side thread reads those files once a second; when none moved for S seconds it sends
every worker SIGUSR1 (each dumps its buffer from a thread, even while its main thread blocks
inside a collective), waits for the dumps (at most 10 s), then SIGTERM (torchrun's agent
reports the failure and stops the rest). `portspeed run` then prints `why-hung`'s answer and
the folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Iterator

from portspeed.errors import ConfigError, PortspeedError

__all__ = ["Hang", "check", "prepare", "watching", "closing_lines", "DEFAULT_ENTRIES"]

#: ring-buffer entries when --hang-timeout turns recording on
DEFAULT_ENTRIES = "2000"
_PROGRESS = "portspeed_progress_"  # portspeed.comm.trace.PROGRESS_PREFIX (not imported: no torch in the launcher's parse)
_DUMP = "portspeed_trace_rank_"


class HangTimeoutError(PortspeedError, ValueError):
    """--hang-timeout was given a value that is not a positive number of seconds."""


@dataclasses.dataclass
class Hang:
    """What the watchdog saw: ``fired`` once it ended the job."""

    fired: bool = False
    quiet_s: float = 0.0
    ranks: int = 0


def check(value: str | None) -> float | None:
    """The --hang-timeout in seconds (None: not given); refuse anything but a positive number."""
    if value is None:
        return None
    try:
        s = float(value)
    except ValueError:
        s = -1.0
    if not (0 < s < 1e7):
        raise HangTimeoutError(f"--hang-timeout {value!r} is not a positive number of seconds; give how long no rank "
                               "may complete a collective before the job is dumped and ended (e.g. --hang-timeout 300)")
    if os.environ.get("PORTSPEED_TRACE", "").strip() == "0":
        raise HangTimeoutError("--hang-timeout needs the flight recorder, but PORTSPEED_TRACE=0 turns it off; unset "
                               "PORTSPEED_TRACE (2000 entries are used) or give it a number of entries")
    return s


def prepare(hang_s: float | None) -> str | None:
    """Set the workers' environment: recording on for --hang-timeout, a dump folder whenever recording is on."""
    from portspeed.comm.trace import HANG_ENV

    if hang_s is not None:
        os.environ.setdefault("PORTSPEED_TRACE", DEFAULT_ENTRIES)
        os.environ[HANG_ENV] = str(hang_s)
    raw = os.environ.get("PORTSPEED_TRACE", "").strip()
    if not raw or raw == "0":
        return None
    folder = os.environ.get("PORTSPEED_TRACE_DIR", "").strip()
    if folder:
        folder = os.path.abspath(folder)
        try:  # settings checked it by permissions; root passes those everywhere, so write to it for real
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as exc:
            raise ConfigError(f"PORTSPEED_TRACE_DIR={folder!r} is not a writable folder ({exc.strerror or exc}); "
                              "give a folder this user can write, or unset it for a new one under the temporary "
                              "directory") from None
    else:
        folder = tempfile.mkdtemp(prefix="portspeed-trace-")
        os.environ["PORTSPEED_TRACE_DIR"] = folder
    print(f"portspeed run: flight-recorder dumps go to {folder}", file=sys.stderr, flush=True)
    return folder


def _beats(folder: str) -> dict[int, tuple[int, float]]:
    """pid -> (rank, mtime) of every heartbeat file."""
    out: dict[int, tuple[int, float]] = {}
    for name in os.listdir(folder):
        if name.startswith(_PROGRESS) and name.endswith(".beat"):
            path = os.path.join(folder, name)
            try:
                with open(path) as f:
                    pid = int(f.read().strip() or 0)
                out[pid] = (int(name[len(_PROGRESS):-len(".beat")]), os.stat(path).st_mtime)
            except (OSError, ValueError):
                continue
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _watch(folder: str, hang_s: float, hang: Hang, stop: threading.Event) -> None:
    started = time.time()
    while not stop.wait(1.0):
        beats = _beats(folder)
        if not beats:
            continue
        last = max([started, *(m for _, m in beats.values())])
        quiet = time.time() - last
        if quiet < hang_s:
            continue
        hang.fired, hang.quiet_s, hang.ranks = True, quiet, len(beats)
        print(f"portspeed run: no rank completed a collective for {quiet:.0f} s (--hang-timeout {hang_s:g}); "
              f"asking {len(beats)} ranks to dump, then ending the job", file=sys.stderr, flush=True)
        asked = time.time()
        pids = sorted(beats)
        _signal(pids, signal.SIGUSR1)
        deadline = asked + 10
        while time.time() < deadline and not stop.is_set():
            dumped = 0
            for rank, _ in beats.values():
                try:
                    dumped += os.stat(os.path.join(folder, f"{_DUMP}{rank}")).st_mtime >= asked - 1
                except OSError:
                    pass
            if dumped == len(beats):
                break
            time.sleep(0.2)
        _signal(pids, signal.SIGTERM)
        return


@contextlib.contextmanager
def watching(folder: str | None, hang_s: float | None) -> Iterator[Hang]:
    """Run the watchdog thread while the block (torchrun's agent) runs; a no-op without --hang-timeout."""
    hang = Hang()
    if folder is None or hang_s is None:
        yield hang
        return
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(folder, hang_s, hang, stop), name="portspeed-hang-watch",
                              daemon=True)
    thread.start()
    try:
        yield hang
    finally:
        stop.set()
        thread.join(timeout=15)


def closing_lines(folder: str | None, hang: Hang, failed: bool) -> None:
    """`why-hung`'s answer (first) and the dump folder, when recording was on and there is something to say."""
    if folder is None:
        return
    from portspeed.cli import why_hung

    code, lines = why_hung.answer(folder)
    if code == 2 and not (failed or hang.fired):
        return  # a clean run that dumped nothing: nothing to say
    if code == 0 or failed or hang.fired:
        print(f"portspeed run: why-hung: {lines[0]}", file=sys.stderr)
        for line in lines[1:]:
            print(f"portspeed run: {line}", file=sys.stderr)
        print(f"portspeed run: flight-recorder dumps in {folder} (read them again with `portspeed why-hung "
              f"{folder}`)", file=sys.stderr, flush=True)
