"""What each `portspeed run` worker executes: import the adaptor, then run the script as __main__.

Started by torchrun (through `portspeed run`) as::

    python -m portspeed.launch_worker --adaptor MODULE [--module] -- SCRIPT [ARGS...]

The script sees what it would see under plain ``python SCRIPT ARGS``: ``__name__`` is
``"__main__"``, ``sys.argv`` is ``[SCRIPT, *ARGS]``, and ``sys.path[0]`` is the script's
folder (``-m``: the working directory). The only difference is that the adaptor module
(``portspeed.megatron_adaptor`` by default) was imported first, so its patches are in
place before the script's first ``import megatron``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys

__all__ = ["main", "ADAPTOR_ENV"]

#: set in the worker's environment to the adaptor module it imported ("none" when none)
ADAPTOR_ENV = "PORTSPEED_RUN_ADAPTOR"


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit(
            "portspeed.launch_worker: expected '--adaptor MODULE [--module] -- SCRIPT [ARGS]'; "
            "this module is started by `portspeed run`, use that instead"
        )
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m portspeed.launch_worker", add_help=False)
    parser.add_argument("--adaptor", required=True)
    parser.add_argument("--module", action="store_true")
    # torchrun adds --local-rank=N here when it runs in its legacy (use_env=False) mode;
    # it belongs to the script, so it is handed on.
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", default=None)
    opts = parser.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if not rest:
        raise SystemExit("portspeed.launch_worker: no SCRIPT after '--'")
    return opts, rest


def main(argv: list[str] | None = None) -> None:
    """Import the adaptor named on the command line, then run the script in this process."""
    opts, rest = _parse(list(sys.argv[1:] if argv is None else argv))
    target, script_args = rest[0], rest[1:]
    if opts.local_rank is not None:
        script_args = [f"--local-rank={opts.local_rank}", *script_args]
    os.environ[ADAPTOR_ENV] = opts.adaptor
    if opts.adaptor != "none":
        importlib.import_module(opts.adaptor)
    if opts.module:
        sys.argv = [target, *script_args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(target)
    sys.argv = [target, *script_args]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
