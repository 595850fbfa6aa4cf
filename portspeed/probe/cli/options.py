"""`portspeed run`'s probe switches: ``--probe DIR`` and its companions, turned into PORTSPEED_PROBE_* for the workers.

Why in the launcher: a bad switch must be refused in one line, exit 2, before any worker starts
and before anything is created or overwritten, and a folder that already holds a dump is only
knowable for all ranks here (each rank can only check its own). Each switch is read by the parser its
variable is declared with (``portspeed.settings.TABLE``), the one every worker applies to the variable, the same
reading a torchrun launch gets. What it shares with ``--perf`` is in ``recording_options``.

Switches: ``--probe DIR``, ``--probe-iterations A:B`` (default 1:1), ``--probe-level module|op``,
``--probe-ranks R,...``, ``--probe-modules GLOB``, ``--probe-tensors GLOB``, ``--probe-nan``,
``--probe-inputs``. Every one but ``--probe`` needs ``--probe``.
"""

from __future__ import annotations

import argparse

from portspeed import config
from portspeed.probe.cli import recording_options
from portspeed.errors import ConfigError

__all__ = ["add_arguments", "environment", "make_folder"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The probe switches, added to torchrun's parser."""
    g = parser.add_argument_group("probe (docs/probe-format.md)")
    g.add_argument("--probe", default=None, metavar="DIR",
                   help="record module statistics of the iterations chosen into DIR (msprobe's layout); the folder "
                        "must hold no dump yet")
    g.add_argument("--probe-iterations", default=None, metavar="A:B", help="training iterations recorded (default 1:1)")
    g.add_argument("--probe-level", default=None, metavar="module|op",
                   help="module (default): modules' outputs, gradients, parameters; op: also every torch function and "
                        "collective inside them")
    g.add_argument("--probe-ranks", default=None, metavar="R,...", help="global ranks that record (default: all)")
    g.add_argument("--probe-modules", default=None, metavar="GLOB", help="canonical module paths recorded")
    g.add_argument("--probe-tensors", default=None, metavar="GLOB", help="entry keys whose full tensors are saved too")
    g.add_argument("--probe-nan", action="store_true",
                   help="on every iteration, name the first module whose output turned non-finite, write that "
                        "iteration's dump and stop the job")
    g.add_argument("--probe-inputs", action="store_true", help="also record modules' inputs")


def environment(args: argparse.Namespace, world: int | None = None) -> dict[str, str]:
    """The PORTSPEED_PROBE_* values for the workers ({} without --probe); ConfigError names the bad switch."""
    env = config.PROBE_ENV
    out = recording_options.common_environment(args, "probe", env, world, "the folder the probe writes")
    if not out:
        return out
    for name in ("modules", "tensors"):
        value = getattr(args, f"probe_{name}")
        if value is not None:
            out[env[name]] = str(recording_options.parse(f"--probe-{name}", value))
    if args.probe_nan:
        out[env["nan"]] = "1"
    if args.probe_inputs:
        out[env["inputs"]] = "1"
    recording_options.workers_reading(out)
    from portspeed.probe.writer import existing_dumps

    found = existing_dumps(out[env["dir"]])
    if found:
        raise ConfigError(f"--probe {args.probe!r} already holds a probe dump ({found[0]}); remove it or choose "
                          "another folder")
    return out


def make_folder(values: dict[str, str]) -> None:
    """Make the folder (after every other check: a refused line creates nothing); ConfigError when it cannot be
    made or written."""
    recording_options.make_folder(values, "probe", config.PROBE_ENV)
