"""`portspeed run`: torchrun, except that every worker imports a portspeed adaptor first.

A stock training script (Megatron-LM's ``pretrain_gpt.py``, a DeepSpeed script) must run
unedited, so the adaptor cannot be imported by the script itself. ``portspeed run`` takes
torchrun's own command line (it *is* torchrun's parser and launcher, with one option
added) and starts each worker as ``python -m portspeed.cli.worker``, which imports the
adaptor and then runs the script as ``__main__`` with the script's own ``sys.argv``.

Options added to torchrun's:

``--adaptor NAME``  ``megatron`` (default: ``portspeed.megatron_adaptor``), ``deepspeed``
(``portspeed.deepspeed_adaptor``), ``none`` (no adaptor: plain torchrun through the same
worker), or a dotted module name of your own (it must be importable by the workers).

``--hang-timeout S``  when no rank completes a collective or point-to-point call for S
seconds, every rank is asked to dump its flight recorder (SIGUSR1), the job is ended, and
the closing lines are `portspeed why-hung`'s answer and the dump folder. It sets
``PORTSPEED_HANG_TIMEOUT`` for the workers (the same variable set by hand does what the option
does) and turns recording on (``PORTSPEED_TRACE``, 2000 entries unless set); the adaptor is then
set up at launch, so a script that never imports the framework is recorded too, and a rank that
records nothing is named with the reason and ends the job as a hang would
(``portspeed.trace.cli.hang_watch``). Whenever recording is on, the dumps go
to ``PORTSPEED_TRACE_DIR`` or a new folder under the temporary directory, named in one line,
and a run whose dumps show a cause ends with that answer (docs/reliability.md, "When it hangs").

``--probe DIR`` (with ``--probe-iterations A:B``, ``--probe-level module|op``, ``--probe-ranks R,...``,
``--probe-modules GLOB``, ``--probe-tensors GLOB``, ``--probe-nan``, ``--probe-inputs``)  records module
(or op) statistics of the chosen iterations into DIR with no edit to the script
(``portspeed.probe``, docs/probe-format.md), through the ``PORTSPEED_PROBE_*`` variables it sets for the
workers; a bad switch, an unwritable DIR or a DIR that already holds a dump is refused before any
worker starts (``portspeed.probe.cli.options``).

``--perf DIR`` (with ``--perf-iterations A:B``, ``--perf-ranks R,...``, ``--perf-level module|op``)  times
each module's forward and backward, host syncs, CPU fallbacks and collectives of the chosen iterations,
per rank, into DIR (``portspeed.perf``, docs/performance.md), through ``PORTSPEED_PERF*``; refused as the
probe's switches are (``portspeed.perf.cli.options``).

Limits: ``--no-python`` (the script is an executable, so no Python runs before it) and
``--run-path`` (torchrun runs the script inside its own process) are refused with a
message saying what to use instead. Everything else, elastic options included, is
torchrun's and behaves as documented for torchrun.

Example::

    PYTHONPATH=$MEGATRON_LM_ROOT portspeed run --nproc-per-node 2 \\
        $MEGATRON_LM_ROOT/pretrain_gpt.py --tensor-model-parallel-size 2 ...
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from portspeed import config
from portspeed.cli import failures
from portspeed.perf.cli import options as perf_options
from portspeed.probe.cli import options as probe_options
from portspeed.trace.cli import hang_watch
from portspeed.errors import PortspeedError
from portspeed.integrations import patch_sets

__all__ = ["ADAPTORS", "LaunchError", "main", "build_parser", "resolve_adaptor", "worker_command"]

#: short adaptor names -> module imported in every worker ("none": nothing)
ADAPTORS: dict[str, str | None] = {**patch_sets.ADAPTORS, "none": None}

WORKER_MODULE = "portspeed.cli.worker"


class LaunchError(PortspeedError, ValueError):
    """`portspeed run` was given a command line it cannot launch."""


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser, renamed, with ``--adaptor`` added (torchrun's options stay as they are)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "portspeed run"
    parser.description = (
        "torchrun-compatible launcher: every worker imports a framework set-up (--adaptor), then runs "
        "TRAINING_SCRIPT unedited. All torchrun options are accepted."
    )
    parser.add_argument(
        "--adaptor",
        default="megatron",
        metavar="NAME",
        help="framework set-up (adaptor) imported in every worker before the script: megatron (default), "
        "deepspeed, none, or a dotted module name (the device adapter is chosen by PORTSPEED_ACCELERATOR)",
    )
    parser.add_argument(
        "--hang-timeout",
        default=None,
        metavar="S",
        help="seconds without any rank completing a collective or point-to-point call before every rank dumps its "
        "flight recorder, the job is ended and `portspeed why-hung` names the cause",
    )
    probe_options.add_arguments(parser)
    perf_options.add_arguments(parser)
    return parser


def resolve_adaptor(name: str) -> str | None:
    """The module to import for ``--adaptor name`` (None for 'none'); raise LaunchError if unknown."""
    key = name.strip()
    if key.lower() in ADAPTORS:
        return ADAPTORS[key.lower()]
    parts = key.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise LaunchError(
            f"--adaptor {name!r} is neither a known adaptor ({', '.join(ADAPTORS)}) nor a dotted "
            "module name such as 'mypackage.my_adaptor'"
        )
    return key


def _check_adaptor_importable(module: str) -> None:
    """Fail in the launcher, once, rather than in every worker, when the adaptor cannot be found."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package is missing
        spec = None
    if spec is None:
        raise LaunchError(
            f"adaptor module {module!r} cannot be found by this Python ({sys.executable}); install "
            "what provides it, put it on PYTHONPATH, or choose another with --adaptor "
            f"({', '.join(ADAPTORS)})"
        )


def worker_command(args: argparse.Namespace, adaptor_module: str | None) -> None:
    """Rewrite parsed torchrun arguments so each worker is ``python -m portspeed.cli.worker ...``."""
    script, script_args = args.training_script, list(args.training_script_args)
    worker_args = ["--adaptor", adaptor_module or "none"]
    if args.module:
        worker_args.append("--module")
    worker_args += ["--", script, *script_args]
    args.module = True
    args.training_script = WORKER_MODULE
    args.training_script_args = worker_args


def _validate(args: argparse.Namespace) -> None:
    if args.no_python:
        raise LaunchError(
            "--no-python runs TRAINING_SCRIPT as an executable, so portspeed cannot import its "
            "adaptor before it; run a Python script (drop --no-python), or launch with torchrun and "
            "`import portspeed.megatron_adaptor` at the top of your own program"
        )
    if args.run_path:
        raise LaunchError(
            "--run-path runs the script inside torchrun's own process, which portspeed run does "
            "not support; drop --run-path (each worker is a fresh Python that imports the adaptor "
            "and then runs the script)"
        )
    script = args.training_script
    if args.module:
        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise LaunchError(
                f"-m {script!r}: no such module for {sys.executable}; check the name and PYTHONPATH"
            )
    elif not os.path.isfile(script):
        raise LaunchError(
            f"training script {script!r} not found (working directory {os.getcwd()}); give the path "
            "of a Python script, or -m MODULE"
        )


#: the script flags that fix tensor / pipeline / context parallel sizes (Megatron-LM's and the example trainer's)
_LAYOUT_FLAGS = {"--tensor-model-parallel-size": "tp", "--tp": "tp", "--pipeline-model-parallel-size": "pp",
                 "--pp": "pp", "--context-parallel-size": "cp"}


def _script_layout(script_args: list[str]) -> dict[str, int]:
    """TP / PP / CP sizes named on the script's command line (absent: 1); a non-integer is the script's to refuse."""
    found: dict[str, int] = {}
    for i, a in enumerate(script_args):
        flag, eq, value = a.partition("=")
        if flag in _LAYOUT_FLAGS:
            raw = value if eq else (script_args[i + 1] if i + 1 < len(script_args) else "")
            if raw.strip().isdigit():
                found[_LAYOUT_FLAGS[flag]] = int(raw)
    return found


def _preflight(args: argparse.Namespace, adaptor_module: str | None) -> dict[str, str]:
    """Before any worker starts: settings by name and value, the device and the layout (see accelerator.preflight);
    returns the settings resolved here that the workers get through their environment."""
    from portspeed.accelerator import preflight

    settings = preflight.check_settings()
    # a relative adapter file made absolute: every worker loads the same file, wherever it runs
    handed = {config.BY_FIELD["accelerator"].env: settings.accelerator} if settings.accelerator else {}
    if adaptor_module is None:
        return handed
    nproc = str(args.nproc_per_node).strip()
    lo, _, hi = str(args.nnodes).strip().partition(":")
    nnodes = lo if (not hi or hi == lo) else ""  # an elastic range (MIN:MAX) fixes no world size
    if nproc.isdigit():
        preflight.check_device(int(nproc))
        if nnodes.isdigit():
            layout = _script_layout(list(args.training_script_args))
            preflight.check_layout(int(nnodes) * int(nproc), layout.get("tp", 1), layout.get("pp", 1),
                                   layout.get("cp", 1))
    return handed


def _world_size(args: argparse.Namespace) -> int | None:
    """nnodes x nproc-per-node when both are fixed numbers (an elastic range fixes none)."""
    nproc = str(args.nproc_per_node).strip()
    lo, _, hi = str(args.nnodes).strip().partition(":")
    return int(nproc) * int(lo) if nproc.isdigit() and lo.isdigit() and hi in ("", lo) else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``portspeed run``; returns the exit status (0, 1 worker failure, 2 usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # a missing TRAINING_SCRIPT is reported by argparse
    except SystemExit as exc:  # --help, or a usage error already printed
        return int(exc.code or 0)
    try:
        adaptor_module = resolve_adaptor(args.adaptor)
        _validate(args)
        if adaptor_module is not None:
            _check_adaptor_importable(adaptor_module)
        handed = _preflight(args, adaptor_module)
        probe = probe_options.environment(args, _world_size(args))
        perf = perf_options.environment(args, _world_size(args))
    except PortspeedError as exc:  # LaunchError, and bad PORTSPEED_* settings, devices or layouts
        print(f"portspeed run: error: {exc}", file=sys.stderr)
        return 2
    try:
        hang = hang_watch.check(args.hang_timeout, {**os.environ, **handed, **probe, **perf})
        handed.update({**probe, **perf, **hang})
        settings = config.Settings.from_env({**os.environ, **handed})  # the workers' reading, read here once
        folder = hang_watch.prepare(settings)
        probe_options.make_folder(probe)  # the folders are made last: a refused command line creates nothing
        perf_options.make_folder(perf)
    except PortspeedError as exc:
        print(f"portspeed run: error: {exc}", file=sys.stderr)
        return 2
    if folder is not None:
        handed[hang_watch.TRACE_DIR_ENV] = folder
    hang_s = settings.hang_timeout
    os.environ.update(handed)  # the one write: the workers inherit this process's environment
    worker_command(args, adaptor_module)

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    with failures.watch_failures() as seen, hang_watch.watching(folder, hang_s) as hang:
        try:
            run(args)
        except ChildFailedError as exc:
            print(f"portspeed run: a worker failed:\n{exc.format_msg()}", file=sys.stderr)
            print(failures.summary_line(seen, ok=False), file=sys.stderr, flush=True)
            hang_watch.closing_lines(folder, hang, failed=True)
            return 1
    if seen:  # restarted and then finished: say who died
        print(failures.summary_line(seen, ok=True), file=sys.stderr, flush=True)
    hang_watch.closing_lines(folder, hang, failed=False)
    return 1 if hang.fired else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
