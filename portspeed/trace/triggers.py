"""When a rank dumps its flight recorder: signals, the exception that ends it, exit, a call in flight too long.

Why a module of its own: the recorder (``portspeed.trace.flight_recorder``) is what runs on every call;
this is what runs once per process (``install``, when the first recording patch is made) and
in one daemon thread (``_watch``). The thread reads the signal-wakeup pipe, so SIGUSR1 dumps
even while the main thread blocks inside a collective (a Python signal handler would wait for
the collective to return); on SIGTERM it dumps, then the process dies of SIGTERM as it would
have (the launcher still reads "killed by SIGTERM"). It also keeps the heartbeat file that
`portspeed run --hang-timeout` watches (``portspeed.trace.cli.hang_watch``; touched every second until
the rank's first call, so a slow start-up is not a hang), and dumps once when one call stays in
flight longer than ``PORTSPEED_TIMEOUT``.

Limit: a program that installs its own signal-wakeup fd (asyncio in the main thread) takes
the pipe away; SIGTERM is then handled in the main thread only, SIGUSR1 not at all.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from portspeed import config
from portspeed.trace.files import beat_file

__all__ = ["install"]

log = logging.getLogger("portspeed.trace")


def install(rec: Any, on_exit: bool) -> None:
    """SIGUSR1, the exception that ends the rank, exit, the in-flight watchdog; write-through.

    ``rec`` is the process's ``portspeed.trace.flight_recorder.Recorder``, which calls this when it starts (so this
    module imports nothing of the recorder's: the import runs one way)."""
    try:
        rec.start_write_through()
    except OSError as exc:
        log.warning("portspeed trace: no write-through file (%s)", exc)
    previous_hook = sys.excepthook

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if not issubclass(kind, (KeyboardInterrupt, SystemExit)):
            rec.dump(f"{kind.__name__} ended the rank")
        previous_hook(kind, value, tb)

    sys.excepthook = hook
    if on_exit:
        atexit.register(lambda: rec._dumped_for is None and rec.dump("exit"))
    wake = None
    watcher: list[threading.Thread] = []  # the watcher thread, once started (on_term asks whether it runs)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
        try:  # the C handler writes the signal number to this pipe even while the main thread blocks in C++
            r, w = os.pipe()
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            signal.signal(signal.SIGUSR1, lambda *_: None)
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # the launcher stopping a rank: dump, then die

                def on_term(*_: Any) -> None:
                    # the watcher thread reads SIGTERM from the wakeup pipe, dumps, then ends the process. Ending it
                    # here too raced that dump: the main thread, back from a collective the dying peer broke, found
                    # the dump started and killed the rank before the file was written. Only without a watcher:
                    if watcher and watcher[0].is_alive():
                        return
                    _term(rec)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    os.kill(os.getpid(), signal.SIGTERM)

                signal.signal(signal.SIGTERM, on_term)
            wake = r
        except (ValueError, OSError) as exc:
            log.warning("portspeed trace: SIGUSR1 not handled (%s)", exc)
    watcher.append(threading.Thread(target=_watch, args=(rec, wake), name="portspeed-trace", daemon=True))
    watcher[0].start()


def _watch(rec: Any, wake: int | None) -> None:
    """Dump on SIGUSR1 and when a call stays in flight past the timeout; keep the heartbeat for the launcher."""
    import select

    beat = None
    if config.settings().hang_timeout is not None:
        beat = beat_file(rec.folder_now(), rec.rank())
        with open(beat, "w") as f:
            f.write(str(os.getpid()))
        atexit.register(_remove, beat)  # a rank that ends is not waited for
    seen_done, asked, started_ns = 0, -1e9, 0
    while True:
        ready = select.select([wake], [], [], 1.0)[0] if wake is not None else time.sleep(1.0)
        if ready:
            got = os.read(wake, 64)
            if signal.SIGUSR1 in got:
                rec.dump("SIGUSR1")
                asked = time.monotonic()
            if signal.SIGTERM in got and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                _term(rec, asked)
                _die_of_sigterm()
        if beat is not None:
            # before its first call a rank is starting up (imports, model build): that counts as progress
            if rec.record_id == 0:
                started_ns = time.time_ns()
            done = max(rec.last_done_ns, started_ns)
            if done != seen_done:
                seen_done = done
                try:
                    os.utime(beat, ns=(done, done))
                except OSError:
                    pass
        e = rec.in_flight
        if e is not None and time.time_ns() - e["time_created_ns"] > rec.timeout_s * 1e9 \
                and rec._dumped_for != "timeout":
            rec.dump("timeout")


def _term(rec: Any, asked: float = -1e9) -> None:
    """Dump once for SIGTERM, unless a SIGUSR1 dump (the hang watchdog's) was just written."""
    if not getattr(rec, "_term_seen", False):
        rec._term_seen = True  # type: ignore[attr-defined]
        if time.monotonic() - asked > 30 and rec._dumped_for != "SIGUSR1":
            rec.dump("SIGTERM")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _die_of_sigterm() -> None:
    """End this process by SIGTERM's default action, from any thread (the launcher reads "killed by SIGTERM")."""
    try:
        import ctypes

        ctypes.CDLL(None).signal(int(signal.SIGTERM), 0)  # SIG_DFL at the C level: signal.signal is main-thread only
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    finally:
        os._exit(128 + int(signal.SIGTERM))
