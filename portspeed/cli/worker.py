"""What each `portspeed run` worker executes: import the adaptor, then run the script as __main__.

Started by torchrun (through `portspeed run`) as::

    python -m portspeed.cli.worker --adaptor MODULE [--module] -- SCRIPT [ARGS...]

The script sees what it would see under plain ``python SCRIPT ARGS``: ``__name__`` is
``"__main__"``, ``sys.argv`` is ``[SCRIPT, *ARGS]``, ``__file__`` is the script, and
``sys.path[0]`` is the script's folder (``-m``: the working directory). The difference is
that the adaptor module (``portspeed.megatron_adaptor`` by default) was imported first, so
its patches are in place before the script's first ``import megatron``.

Processes the script starts with multiprocessing's *spawn* or *forkserver* method (torch's
asynchronous checkpoint writer, DataLoader workers under spawn) re-create ``__main__``
from ``__main__.__spec__``. The script's ``__main__`` therefore carries this module's
spec, as under ``python -m``: a spawned child re-enters here as ``__mp_main__``, imports
the adaptor (named in ``PORTSPEED_RUN_ADAPTOR``) and runs the script's top level as
``__mp_main__``, exactly as spawn does for a plain script, so what the parent pickled by
reference to ``__main__`` resolves. Forked children inherit everything anyway.

With recording on (``PORTSPEED_TRACE``, or a hang timeout) the adaptor is set up at launch, not at
the framework's first import: a script that never imports the framework (plain torch) is recorded
too, and `portspeed run --hang-timeout` watches it. Under a hang timeout the worker also keeps a file
saying why this rank records nothing until its recorder starts (``portspeed.trace.cli.hang_watch``).
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import importlib.util
import os
import sys
import time
import types
from typing import Any

from portspeed import config

__all__ = ["main", "ADAPTOR_ENV", "TARGET_ENV", "FAILED_AT_FILE", "PEER_GONE"]

#: the adaptor module imported in the worker ("none": none); spawned children read it
ADAPTOR_ENV = "PORTSPEED_RUN_ADAPTOR"
#: "path:<abs script>" or "module:<name>": what a spawned child re-runs as __mp_main__
TARGET_ENV = "PORTSPEED_RUN_TARGET"
#: beside torchrun's per-worker error file: when the script failed (``note_failure_time``)
FAILED_AT_FILE = "portspeed-failed-at"


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit(
            "portspeed.cli.worker: expected '--adaptor MODULE [--module] -- SCRIPT [ARGS]'; "
            "this module is started by `portspeed run`, use that instead"
        )
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m portspeed.cli.worker", add_help=False)
    parser.add_argument("--adaptor", required=True, help="framework set-up (adaptor) module imported first")
    parser.add_argument("--module", action="store_true")
    # torchrun adds --local-rank=N here when it runs in its legacy (use_env=False) mode;
    # it belongs to the script, so it is handed on.
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", default=None)
    opts = parser.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if not rest:
        raise SystemExit("portspeed.cli.worker: no SCRIPT after '--'")
    return opts, rest


def _import_adaptor(name: str | None) -> None:
    if name and name != "none":
        importlib.import_module(name)


def _record_from_launch(adaptor: str) -> None:
    """Recording, probing or perf timing on: run the adaptor's set-up now (it installs those patches)
    rather than at the framework's first import, which a plain torch script never makes."""
    from portspeed import config

    settings = config.settings()
    if (settings.trace > 0 or settings.probe_dir or settings.perf_dir) and adaptor != "none":
        from portspeed.integrations.activation import activate_waiting

        activate_waiting()


def _code_of(target: str) -> tuple[Any, dict[str, Any]]:
    """Compiled code of ``path:<file>`` or ``module:<name>``, and the globals it runs with."""
    kind, _, what = target.partition(":")
    if kind == "path":
        with open(what, "rb") as f:
            source = f.read()
        return compile(source, what, "exec"), {"__file__": what, "__package__": None, "__cached__": None}
    spec = importlib.util.find_spec(what)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
        raise SystemExit(f"portspeed.cli.worker: cannot find the code of module {what!r}")
    if spec.submodule_search_locations is not None:  # a package: run its __main__, as python -m does
        spec = importlib.util.find_spec(f"{what}.__main__")
        if spec is None or spec.loader is None:
            raise SystemExit(f"portspeed.cli.worker: package {what!r} has no __main__ module")
    code = spec.loader.get_code(spec.name)  # type: ignore[union-attr]
    return code, {"__file__": spec.origin, "__package__": spec.parent, "__cached__": None}


def _run_as_main(target: str) -> None:
    """Run the script's code in a fresh ``__main__`` whose spec is this module's (see the docstring)."""
    code, extra = _code_of(target)
    main_mod = types.ModuleType("__main__")
    main_mod.__dict__.update(extra)
    main_mod.__dict__.update(__builtins__=builtins, __loader__=None,
                             __spec__=importlib.util.find_spec("portspeed.cli.worker"))
    sys.modules["__main__"] = main_mod
    exec(code, main_mod.__dict__)


def main(argv: list[str] | None = None) -> None:
    """Import the adaptor named on the command line, then run the script in this process."""
    opts, rest = _parse(list(sys.argv[1:] if argv is None else argv))
    what, script_args = rest[0], rest[1:]
    if opts.local_rank is not None:
        script_args = [f"--local-rank={opts.local_rank}", *script_args]
    os.environ[ADAPTOR_ENV] = opts.adaptor
    from portspeed.trace.cli.hang_watch import note_unrecorded

    note_unrecorded(opts.adaptor)  # under a hang timeout: why this rank records nothing, until it does
    target = f"module:{what}" if opts.module else f"path:{os.path.abspath(what)}"
    os.environ[TARGET_ENV] = target  # for the children it spawns (multiprocessing): they re-run it as __mp_main__
    config.note_entry_script(None if opts.module else what)  # first: the adaptor's module check looks beside it
    _import_adaptor(opts.adaptor)
    if not opts.module:
        sys.path[0] = os.path.dirname(target[len("path:"):])
    sys.argv = [what, *script_args]
    _record_from_launch(opts.adaptor)
    try:
        _run_as_main(target)
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            note_failure_time(exc)
        raise


#: words of a collective library's error that says a peer went away (Gloo's transport, NCCL's and the TCP store's):
#: this rank's failure is the consequence of another's end, not a cause
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Socket closed", "Broken pipe",
             "remote process exited", "communicator was aborted")


def note_failure_time(exc: BaseException | None = None) -> None:
    """Write when this rank's script failed (ns since the epoch) beside torchrun's error file, for the launcher's
    closing line: of two ranks whose endings its poll sees together, the one whose script failed first is the
    root cause (a peer's error on the connection the first one broke comes later). ``exc`` whose message says a
    peer went away adds the word ``peer-gone``: a rank that died without Python (a C++ abort, a signal) has no
    time of its own, and its peer's error may be noted before the launcher saw it die."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    gone = exc is not None and any(w in str(exc) for w in PEER_GONE)
    try:
        with open(os.path.join(os.path.dirname(error_file), FAILED_AT_FILE), "w") as f:
            f.write(f"{time.time_ns()}{' peer-gone' if gone else ''}")
    except OSError:
        pass  # the closing line then orders this rank by when its ending was seen


def _spawned_child() -> None:
    """In a spawn/forkserver child: adaptor first, then the script's top level as __mp_main__."""
    target = os.environ.get(TARGET_ENV)
    if not target:
        return
    config.note_entry_script(target[len("path:"):] if target.startswith("path:") else None)
    _import_adaptor(os.environ.get(ADAPTOR_ENV))
    code, extra = _code_of(target)
    ns = globals()
    ns.update(extra)
    exec(code, ns)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    _spawned_child()
