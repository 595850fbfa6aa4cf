"""The warm Python's client: stands where ``python`` would, and has a warm server fork the real child.

Run as ``python -I -S client.py REAL_PYTHON SOCKET [SOCKET...] -- ARGS...`` (the launcher script
``warm.start`` writes does so). It sends the server its arguments, environment, working folder, core-file
limits and its stdin, stdout and stderr; forwards the signals it gets to the child; and ends as the child
ended (the same exit code, or the same signal). When no server answers, or the server says the request
must start cold, it execs ``REAL_PYTHON ARGS...`` itself: a test never depends on the server being there.
Standard library only, and no ``site``: it starts in a few milliseconds.
"""

import json
import os
import resource
import signal
import socket
import struct
import sys

_FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _cold(real, args):
    os.execv(real, [real, *args])


def _lines(conn):
    buf = b""
    while True:
        part = conn.recv(4096)
        if not part:
            return
        buf += part
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)


def main():
    sep = sys.argv.index("--")
    real, sockets, args = sys.argv[1], sys.argv[2:sep], sys.argv[sep + 1:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sockets[os.getpid() % len(sockets)])  # alternate: a two-rank job's ranks get two hash seeds
    except OSError:
        _cold(real, args)
    try:
        with open("/proc/self/coredump_filter") as f:
            core_filter = f.read().strip()
    except OSError:
        core_filter = ""
    umask = os.umask(0)
    os.umask(umask)
    body = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
                       "core": list(resource.getrlimit(resource.RLIMIT_CORE)),
                       "coredump_filter": core_filter}).encode()
    try:
        socket.send_fds(conn, [struct.pack("!I", len(body))], [0, 1, 2])
        conn.sendall(body)
        replies = _lines(conn)
        first = next(replies)
    except (OSError, StopIteration, ValueError):
        _cold(real, args)
    if "cold" in first:
        _cold(real, args)
    child = first["pid"]

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except OSError:
            pass

    for sig in _FORWARD:
        signal.signal(sig, forward)
    try:
        status = next(replies)["status"]
    except (StopIteration, OSError, ValueError):
        status = None  # the server went away: as if the child was killed
    if status is None or os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status) if status is not None else signal.SIGKILL
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child left its core; this one must not replace it
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
