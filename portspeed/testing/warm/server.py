"""The warm Python's server: torch imported once, then one fork per child Python the tests start.

Run as a file (``python server.py SOCKET``), never as ``portspeed.testing.warm.server``: importing the
``portspeed`` package would install its patches in the parent of every child. The server imports torch and
the torch modules Megatron-Core and torchrun load (``PRELOAD``), nothing of portspeed, Megatron, DeepSpeed or
Transformers, so each child still imports those in the order a user's process does.

A request (from ``client.py``: argv, environment, working folder, core-file limits, and its stdin, stdout and
stderr) is served warm only when a fresh interpreter would start the same way (``_why_cold``); otherwise the
client is told to exec the real interpreter. A warm child gets the request's folder, environment, streams,
``sys.argv``, ``sys.path``, warnings filters and faulthandler, its own process group and fresh random
seeds, runs ``-m``, ``-c`` or the script as ``__main__``, and ends through the interpreter's normal
finalization (atexit included). The server reports its exit status to the client, and kills its process
group when the client goes away (the client was killed, e.g. by a test's timeout).

Differences from a fresh interpreter that remain: the string hash seed is the server's (two servers alternate
so that a two-rank job's ranks differ), and the torch modules in ``PRELOAD`` are already imported.
"""

import sys

del sys.path[0]  # this file's folder (portspeed/testing/warm) must not shadow anything a child imports

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import warnings  # noqa: E402

_SERVER_FILE = __file__
_PARENT = os.getppid()  # the test session; when it is gone, so is this server
_START_ENV = dict(os.environ)  # what this server started with; its imports may add variables (``_ADDED``)
_ADDED: dict = {}
_DEFAULT_FILTERS = list(warnings.filters)  # before any import adds its own: what a fresh interpreter has
_BASE_PATH = list(sys.path)
_OWN_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

#: imported once here: what ``import megatron.core`` and torchrun pull from torch (4-5 s per process on the
#: 2-core CI machine); none of them is patched at import by portspeed
PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.run",
           "torch.distributed.elastic.agent.server.local_elastic_agent", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.utils.data", "torch.testing", "torch.nn.attention",
           "torch.distributed.algorithms.join", "numpy", "sympy", "torch._dynamo", "torch._inductor.compile_fx")
#: the first preloaded module that imports Triton where it is installed (torch >= 2.15 with dynamo). Triton's
#: nanobind objects are freed only by the collector at finalization; frozen with the rest (``gc.freeze``) they
#: stay alive, and nanobind prints its leak report into every child's stderr at exit, which a fresh interpreter
#: does not. So with Triton installed the freeze comes before this module: measured on torch 2.15, a child that
#: imports Megatron-Core exits in 1.1 s against 1.0 s with all frozen (unfreezing at exit instead: 1.8 s).
_FREEZE_BEFORE = "torch._dynamo"
#: environment variables read while the interpreter starts or the preloaded modules import (the interpreter's,
#: the C and OpenMP runtimes', torch's logging, JIT, dynamo and inductor configuration): a request whose value
#: differs from the server's is run cold (PYTHONPATH, PYTHONWARNINGS, PYTHONFAULTHANDLER, PYTHONUNBUFFERED and
#: PYTHONDONTWRITEBYTECODE are applied per child instead). Variables torch reads when a call asks (e.g.
#: PYTORCH_NVML_BASED_CUDA_CHECK, which importing DeepSpeed sets in the test session) are the child's own.
_STARTUP_PREFIXES = ("PYTHON", "PYTORCH_JIT", "TORCH_LOGS", "TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE",
                     "TORCH_CPP_LOG", "TORCH_SHOW_CPP", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "TRITON_",
                     "MALLOC_", "NUMPY_")
_PER_CHILD = {"PYTHONPATH", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
              "PYTHON_EXEC", "PYTHON"}  # PYTHON: no interpreter reads it (scripts name theirs with it)
_FLAGS = {"-u", "-B"}


def _recv(conn):
    """One request: a length-prefixed JSON header and three file descriptors (stdin, stdout, stderr)."""
    raw, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(raw) < 4 or len(fds) != 3:
        raise OSError("short request")
    size = struct.unpack("!I", raw)[0]
    body = b""
    while len(body) < size:
        part = conn.recv(size - len(body))
        if not part:
            raise OSError("request cut short")
        body += part
    return json.loads(body), fds


def _parse(argv):
    """(flags, mode, target, rest) for ``[flags] (-m mod | -c code | script) args``, or None when unsupported."""
    flags, i = set(), 0
    while i < len(argv) and argv[i] in _FLAGS:
        flags.add(argv[i])
        i += 1
    if i >= len(argv):
        return None
    if argv[i] in ("-m", "-c"):
        if i + 1 >= len(argv):
            return None
        return flags, argv[i], argv[i + 1], argv[i + 2:]
    if argv[i].startswith("-"):
        return None
    return flags, "script", argv[i], argv[i + 1:]


def _why_cold(req):
    """Why this request cannot be forked from here (a fresh interpreter would start otherwise), or ''."""
    if _parse(req["argv"]) is None:
        return f"interpreter options not served warm: {req['argv'][:3]}"
    env = req["env"]
    for name, folder in _customize(env):
        if name in sys.modules:
            return f"PYTHONPATH's {folder} holds a {name}, which a fresh interpreter runs instead of the server's"
    for name in set(env) | set(_START_ENV):
        if name in _PER_CHILD or not name.startswith(_STARTUP_PREFIXES):
            continue
        if env.get(name) != _START_ENV.get(name) and (name not in _ADDED or env.get(name) not in (None, _ADDED[name])):
            return f"{name} differs from the warm server's"
    return ""


def _customize(env):
    """[(name, folder)]: the ``sitecustomize`` / ``usercustomize`` a fresh interpreter would import at start from
    the request's own PYTHONPATH folders (the first folder holding each)."""
    found = []
    for name in ("sitecustomize", "usercustomize"):
        for folder in env.get("PYTHONPATH", "").split(os.pathsep):
            if folder and folder not in _OWN_PYTHONPATH and os.path.isfile(os.path.join(folder, f"{name}.py")):
                found.append((name, folder))
                break
    return found


def _run_customize(env):
    """Import them as ``site`` does at start (the server imported none: ``_why_cold``), errors printed, not raised."""
    for name, _ in _customize(env):
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001 - site reports these and carries on
            print(f"Error in {name}; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}", file=sys.stderr)


def _stdio(unbuffered):
    """New sys.stdin/stdout/stderr on descriptors 0, 1, 2, set up as a fresh interpreter does."""
    import io

    enc = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    streams = []
    for fd, mode, errors in ((0, "r", "strict"), (1, "w", "strict"), (2, "w", "backslashreplace")):
        raw = io.FileIO(fd, mode, closefd=False)
        tty = raw.isatty()
        if mode == "w" and (unbuffered or fd == 2):
            buf = raw if unbuffered else io.BufferedWriter(raw)
            stream = io.TextIOWrapper(buf, encoding=enc, errors=errors, line_buffering=tty or fd == 2,
                                      write_through=unbuffered)
        else:
            buf = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
            stream = io.TextIOWrapper(buf, encoding=enc, errors=errors, line_buffering=tty)
        streams.append(stream)
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def _become(req, fds, listener, sel):
    """In the forked child: take on the request's process state (everything but running it)."""
    sel.close()
    listener.close()
    os.setpgid(0, 0)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env = req["env"]
    os.environ.clear()
    os.environ.update({**_ADDED, **env})  # what the preloaded imports set, as they would have in this child
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    soft, hard = req["core"]
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    except (ValueError, OSError):
        pass
    if req.get("coredump_filter"):
        try:
            with open("/proc/self/coredump_filter", "w") as f:
                f.write(req["coredump_filter"])
        except OSError:
            pass
    flags, mode, target, rest = _parse(req["argv"])
    _stdio("-u" in flags or bool(env.get("PYTHONUNBUFFERED")))
    sys.dont_write_bytecode = "-B" in flags or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in _BASE_PATH if p not in _OWN_PYTHONPATH]
    if mode == "-c":
        first = ""
    elif mode == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.realpath(target))
    sys.path[:] = [*extra, *base]
    warnings.filters[:] = _DEFAULT_FILTERS
    warnings._filters_mutated()
    sys.warnoptions[:] = [w for w in env.get("PYTHONWARNINGS", "").split(",") if w]
    warnings._processoptions(sys.warnoptions)
    _run_customize(env)  # as site does, before the script's folder joins sys.path (after the preloaded torch, here)
    sys.path.insert(0, first)
    import faulthandler

    faulthandler.disable()
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter seeds numpy's global generator from the OS
    sys.argv[:] = [{"-c": "-c", "-m": target}.get(mode, target), *rest]
    return mode, target


def _run(mode, target):
    """Run the request as ``__main__``, the way ``python -m`` / ``-c`` / a script does."""
    import builtins
    import runpy
    import types

    main = types.ModuleType("__main__")  # not this file's module: the child's globals are its own
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    if mode == "-m":
        runpy._run_module_as_main(target, alter_argv=True)  # what `python -m` itself calls
        return
    if mode == "-c":
        code = compile(target, "<string>", "exec")
    else:
        from importlib.machinery import SourceFileLoader

        path = os.path.abspath(target)  # as a fresh interpreter gives it (Python >= 3.9)
        main.__file__ = path
        main.__cached__ = None
        main.__loader__ = SourceFileLoader("__main__", path)
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)


def serve(path):
    """Accept requests until SIGTERM; return (mode, target) in each forked child, never in the server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept", None))
    children = {}  # pid -> (client connection, pidfd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    threads = len(os.listdir("/proc/self/task"))
    print(f"warm python: ready ({threads} thread(s))", flush=True)
    while True:
        if os.getppid() != _PARENT:  # the test session is gone (killed): so is this server; its children run on
            sys.exit(0)
        for key, _ in sel.select(timeout=5.0):
            kind, data = key.data
            if kind == "accept":
                conn, _ = listener.accept()
                try:
                    req, fds = _recv(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                why = _why_cold(req) if threads == 1 else f"the server runs {threads} threads"
                print(f"warm python: {'cold: ' + why if why else 'warm:'} {' '.join(req['argv'])[:160]}", flush=True)
                if why:
                    conn.sendall(json.dumps({"cold": why}).encode() + b"\n")
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    for c, pfd in children.values():
                        c.close()
                        os.close(pfd)
                    return _become(req, fds, listener, sel)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                pfd = os.pidfd_open(pid)
                children[pid] = (conn, pfd)
                sel.register(pfd, selectors.EVENT_READ, ("exit", pid))
                sel.register(conn, selectors.EVENT_READ, ("client", pid))
            elif kind == "exit":
                conn, pfd = children.pop(data)
                _, status = os.waitpid(data, 0)
                sel.unregister(pfd)
                if conn in sel.get_map():
                    sel.unregister(conn)
                os.close(pfd)
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
            elif kind == "client":  # the client sent nothing more: it ended, so its child goes too
                if data in children and not key.fileobj.recv(1, socket.MSG_PEEK):
                    sel.unregister(key.fileobj)
                    try:
                        os.killpg(data, signal.SIGKILL)
                    except OSError:
                        pass


if __name__ == "__main__":
    import gc
    from importlib.util import find_spec

    _sock = sys.argv[1]
    _frozen = False
    for _name in PRELOAD:
        if _name == _FREEZE_BEFORE and find_spec("triton") is not None:
            gc.collect()
            gc.freeze()
            _frozen = True
        try:
            __import__(_name)
        except Exception as _exc:  # noqa: BLE001 - a module this torch lacks is simply not preloaded
            print(f"warm python: {_name} not preloaded ({type(_exc).__name__}: {_exc})", flush=True)
    _ADDED.update({k: v for k, v in os.environ.items() if _START_ENV.get(k) != v})
    gc.collect()
    if not _frozen:
        gc.freeze()  # the preloaded objects out of the collector's reach: a child's collections do not copy their pages
    _mode, _target = serve(_sock)
    del _sock, _name, _frozen
    try:
        _run(_mode, _target)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as _exc:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        _tb = _exc.__traceback__
        while _tb is not None and _tb.tb_frame.f_code.co_filename == _SERVER_FILE:
            _tb = _tb.tb_next  # the user's frames only, as a fresh interpreter shows them
        _exc = _exc.with_traceback(_tb)
        sys.last_type, sys.last_value, sys.last_traceback = type(_exc), _exc, _tb  # as the interpreter sets them
        if sys.version_info >= (3, 12):
            sys.last_exc = _exc
        sys.excepthook(type(_exc), _exc, _tb)
        sys.exit(1)
