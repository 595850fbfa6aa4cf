"""`portspeed run --hang-timeout S`: end a job no rank makes progress in, and say why; never watch nothing.

Why: Gloo's default timeout is 30 minutes, and a rank stuck in Python outside any collective
has none at all; the user wants the job ended, and the rank and collective named, in S
seconds. Each worker's recorder (``portspeed.trace.flight_recorder``) keeps a heartbeat file in the dump
folder whose mtime is the time of its last completed call (or, until its first call, now: start-up
is progress) and whose text is its pid. This launcher-side thread reads those files once a second;
when none moved for S seconds it sends every recording worker SIGUSR1 (each dumps its buffer from a
thread, even while its main thread blocks inside a collective), waits for the dumps (at most 10 s),
then SIGTERM (torchrun's agent reports the failure and stops the rest). `portspeed run` then prints
`why-hung`'s answer and the folder.

A rank whose recorder never starts sends no heartbeat, and a watchdog that waited for one would
watch nothing for ever. So each worker (``note_unrecorded``, rank side) keeps a second file until its
recorder starts, saying why it records nothing yet: still starting (torch not imported: progress),
no adaptor imported, an adaptor whose set-up waits for its framework's first import, or recording
off in that rank. A rank in one of the last three for S seconds is named, with that reason, and the
job is ended as for a hang. The file names are ``portspeed.trace.files``; the settings are read
by ``portspeed.config`` alone (the launcher and the ranks share its one reading).
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
from typing import Iterator, Mapping

from portspeed import config
from portspeed.errors import ConfigError, PortspeedError
from portspeed.trace.files import (BEAT_SUFFIX, DUMP_PREFIX, HANG_ENV, TRACE_DIR_ENV, TRACE_ENV, UNRECORDED_SUFFIX,
                                   progress_rank, unrecorded_file)

__all__ = ["Hang", "Unrecorded", "check", "prepare", "watching", "closing_lines", "note_unrecorded", "why_unrecorded"]

#: what --hang-timeout asks for, for the messages
_HINT = ("give how long no rank may complete a collective before the job is dumped and ended (e.g. --hang-timeout "
         "300)")


class HangTimeoutError(PortspeedError, ValueError):
    """--hang-timeout was given a value that is not a positive number of seconds, or recording is off."""


@dataclasses.dataclass
class Hang:
    """What the watchdog saw: ``fired`` once it ended the job; ``unrecorded``: rank -> why it never recorded."""

    fired: bool = False
    quiet_s: float = 0.0
    ranks: int = 0
    unrecorded: dict[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Unrecorded:
    """A rank's ``.unrecorded`` file: its pid, whether it is still starting, why it records nothing, since when."""

    pid: int
    starting: bool
    why: str
    since: float


# ---------------------------------------------------------------------- launcher: settings
def check(value: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """What ``--hang-timeout`` hands the workers (``{}`` without it), read against ``env``, the environment they
    will have; refuse anything but a positive number, and a PORTSPEED_TRACE that turns recording off."""
    out = {} if value is None else {HANG_ENV: repr(config.parse_seconds("--hang-timeout", value, _HINT))}
    merged = {**env, **out}
    try:
        s = config.Settings.from_env(merged)
    except ConfigError as exc:
        raise HangTimeoutError(str(exc)) from None
    if s.hang_timeout is not None and s.trace == 0:
        asked = "--hang-timeout" if value is not None else f"{HANG_ENV}={merged[HANG_ENV]!r}"
        raise HangTimeoutError(f"{asked} needs the flight recorder, but {TRACE_ENV}={merged[TRACE_ENV]!r} reads 0 "
                               f"entries (off); unset {TRACE_ENV} ({config.HANG_TRACE_ENTRIES} entries are used) or "
                               "give it a number of entries")
    return out


def prepare(s: config.Settings) -> str | None:
    """The dump folder whenever ``s`` (the launcher's reading of its workers' settings) records: made now and
    named in one line; the caller hands it to the workers. None when recording is off."""
    if s.trace == 0:
        return None
    folder = s.trace_dir
    if folder:
        try:  # settings checked it by permissions; root passes those everywhere, so write to it for real
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as exc:
            raise ConfigError(f"{TRACE_DIR_ENV}={folder!r} is not a writable folder ({exc.strerror or exc}); "
                              "give a folder this user can write, or unset it for a new one under the temporary "
                              "directory") from None
    else:
        folder = tempfile.mkdtemp(prefix="portspeed-trace-")
    print(f"portspeed run: flight-recorder dumps go to {folder}", file=sys.stderr, flush=True)
    return folder


# ---------------------------------------------------------------------- launcher: the watchdog
def _beats(folder: str) -> dict[int, tuple[int, float]]:
    """pid -> (rank, mtime) of every heartbeat file."""
    out: dict[int, tuple[int, float]] = {}
    for name in os.listdir(folder):
        rank = progress_rank(name, BEAT_SUFFIX)
        if rank is None:
            continue
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                pid = int(f.read().strip() or 0)
            out[pid] = (rank, os.stat(path).st_mtime)
        except (OSError, ValueError):
            continue
    return out


def _unrecorded(folder: str, recording: set[int]) -> dict[int, Unrecorded]:
    """rank -> its ``.unrecorded`` file, for the ranks not in ``recording`` (those with a heartbeat)."""
    out: dict[int, Unrecorded] = {}
    for name in os.listdir(folder):
        rank = progress_rank(name, UNRECORDED_SUFFIX)
        if rank is None or rank in recording:
            continue
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                pid, state, why = (f.read().split("\n", 2) + ["", ""])[:3]
            out[rank] = Unrecorded(int(pid), state == "starting", why.strip(), os.stat(path).st_mtime)
        except (OSError, ValueError):
            continue
    return out


def _by_reason(unrecorded: dict[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rank, why in sorted(unrecorded.items()):
        out.setdefault(why, []).append(rank)
    return out


def _ranks(ranks: list[int]) -> str:
    """``rank 1`` / ``ranks 0, 1``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


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
        silent = _unrecorded(folder, {r for r, _ in beats.values()})
        now = time.time()
        never = {r: u for r, u in silent.items() if not u.starting and now - u.since >= hang_s}
        quiet = now - max([started, *(m for _, m in beats.values())])
        if not never and not (beats and quiet >= hang_s):
            continue
        # ending the job: every rank that records nothing is named, also one idle for less than hang_s (its note
        # is rewritten once a second, so it can trail the quiet of the ranks it left waiting)
        never = {r: u for r, u in silent.items() if not u.starting}
        hang.fired, hang.quiet_s, hang.ranks = True, quiet, len(beats) + len(silent)
        hang.unrecorded = {r: u.why for r, u in sorted(never.items())}
        for why, ranks in _by_reason(hang.unrecorded).items():
            quiet = min(now - never[r].since for r in ranks)
            print(f"portspeed run: {_ranks(ranks)} recorded nothing for {quiet:.0f} s "
                  f"(--hang-timeout {hang_s:g}): {why}", file=sys.stderr, flush=True)
        if beats and quiet >= hang_s:
            print(f"portspeed run: no rank completed a collective for {quiet:.0f} s (--hang-timeout {hang_s:g}); "
                  f"asking {len(beats)} ranks to dump, then ending the job", file=sys.stderr, flush=True)
        elif beats:
            print(f"portspeed run: a rank that records nothing cannot be watched: asking the {len(beats)} recording "
                  "ranks to dump, then ending the job", file=sys.stderr, flush=True)
        else:
            print("portspeed run: no rank records, so none can be watched: ending the job", file=sys.stderr,
                  flush=True)
        asked = time.time()
        _signal(sorted(beats), signal.SIGUSR1)  # a rank without a recorder has no SIGUSR1 handler: not asked
        deadline = asked + 10
        while beats and time.time() < deadline and not stop.is_set():
            dumped = 0
            for rank, _ in beats.values():
                try:
                    dumped += os.stat(os.path.join(folder, f"{DUMP_PREFIX}{rank}")).st_mtime >= asked - 1
                except OSError:
                    pass
            if dumped == len(beats):
                break
            time.sleep(0.2)
        _signal(sorted({*beats, *(u.pid for u in silent.values())}), signal.SIGTERM)
        return


@contextlib.contextmanager
def watching(folder: str | None, hang_s: float | None) -> Iterator[Hang]:
    """Run the watchdog thread while the block (torchrun's agent) runs; a no-op without a hang timeout."""
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
    """`why-hung`'s answer (first), the ranks that never recorded and why, and the dump folder, when recording was
    on and there is something to say."""
    if folder is None:
        return
    from portspeed.trace.cli import why_hung

    code, lines = why_hung.answer(folder)
    if code == 2 and not (failed or hang.fired):
        return  # a clean run that dumped nothing: nothing to say
    if code == 2 and hang.unrecorded:
        lines = []  # nothing recorded to read: the lines below say why
    if code == 0 or failed or hang.fired:
        if lines:
            print(f"portspeed run: why-hung: {lines[0]}", file=sys.stderr)
        for line in lines[1:]:
            print(f"portspeed run: {line}", file=sys.stderr)
        for why, ranks in _by_reason(hang.unrecorded).items():
            print(f"portspeed run: {_ranks(ranks)} never recorded a call: {why}", file=sys.stderr)
        print(f"portspeed run: flight-recorder dumps in {folder} (read them again with `portspeed why-hung "
              f"{folder}`)", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- rank side
#: patches that carry recording (``patches/torch_distributed.py``: the routed collectives, the recorded ones)
_RECORDING_PATCHES = ("torch.distributed.all_reduce.route", "torch.distributed.broadcast.trace")


def why_unrecorded(adaptor: str) -> tuple[bool, str]:
    """(still starting, why) this process has no recorder; ``adaptor`` is what `portspeed run --adaptor` imported."""
    mods = sys.modules
    if "torch.distributed.distributed_c10d" not in mods:
        return True, "starting: torch.distributed is not imported yet"
    s = config.settings()  # this rank's reading (an adaptor's import reads the environment again)
    if s.trace == 0:
        return False, (f"recording is off in this rank: {TRACE_ENV} reads 0 entries here (the launcher's was on: the "
                       "script or its environment changed it)")
    disabled = [n for n in _RECORDING_PATCHES if s.is_disabled(n)]
    if disabled:
        return False, (f"recording is off in this rank: PORTSPEED_DISABLE={','.join(s.disable)} blocks the recording "
                       f"patches ({', '.join(disabled)}); unblock them")
    activation = mods.get("portspeed.integrations.activation")
    waiting = activation.waiting() if activation is not None else []
    if waiting:
        return False, (f"{', '.join(waiting)} is imported, but its set-up (which starts recording) waits for its "
                       "framework's first import, which never came; import the framework, name the script's modules "
                       "in PORTSPEED_FRAMEWORK_MODULES, or let `portspeed run --adaptor` import the adaptor (it sets "
                       "up at launch)")
    adaptors = [m for m in (adaptor, "portspeed.megatron_adaptor", "portspeed.deepspeed_adaptor")
                if m and m != "none" and m in mods]
    if not adaptors:
        return False, ("no adaptor was imported (--adaptor none, and the script imports none): recording starts "
                       "with an adaptor's set-up; drop --adaptor none or import portspeed.megatron_adaptor")
    return False, (f"{adaptors[0]} was set up but installed no recording patch (`portspeed patches` says why); "
                   "the ranks' collectives are not recorded")


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _keep_note(path: str, adaptor: str) -> None:
    last = ""
    while True:
        trace = sys.modules.get("portspeed.trace.flight_recorder")
        if trace is not None and getattr(trace, "_recorder", None) is not None:
            with contextlib.suppress(OSError):
                os.remove(path)  # the recorder's heartbeat takes over
            return
        try:
            starting, why = why_unrecorded(adaptor)
        except Exception as exc:  # a setting this rank cannot read: its own import reports it
            starting, why = False, f"its settings do not read ({exc})"
        text = f"{os.getpid()}\n{'starting' if starting else 'idle'}\n{why}\n"
        if text != last or starting:  # the mtime: since when this is so (kept fresh while starting: progress)
            with contextlib.suppress(OSError):
                _write(path, text)
            last = text
        time.sleep(1.0)


def note_unrecorded(adaptor: str) -> None:
    """In a `portspeed run` worker under a hang timeout: until this rank's recorder starts, keep its
    ``.unrecorded`` file saying why it records nothing (a daemon thread; a no-op without a hang timeout)."""
    s = config.settings()
    if s.hang_timeout is None or not s.trace_dir:
        return
    path = unrecorded_file(s.trace_dir, int(os.environ.get("RANK", "0") or 0))
    with contextlib.suppress(OSError):
        _write(path, f"{os.getpid()}\nstarting\nstarting: the worker runs\n")
    threading.Thread(target=_keep_note, args=(path, adaptor), name="portspeed-unrecorded", daemon=True).start()
