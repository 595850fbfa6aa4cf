"""`portspeed run`'s perf switches: ``--perf DIR`` and its companions, turned into PORTSPEED_PERF_* for the workers.

Why in the launcher: as for the probe (``portspeed.probe.cli.options``), a bad switch is refused in one
line, exit 2, before any worker starts and before anything is created, and a folder that already holds a
recording is only knowable for all ranks here. Each switch is read by the parser its variable is declared
with (``portspeed.settings.TABLE``), so the launcher reads it as every worker, and a torchrun launch, does;
what this shares with ``--probe`` is in ``recording_options``.

Switches: ``--perf DIR``, ``--perf-iterations A:B`` (default 2:4), ``--perf-ranks R,...``,
``--perf-level module|op``. Every one but ``--perf`` needs ``--perf``.
"""

from __future__ import annotations

import argparse
import glob
import os

from portspeed import config
from portspeed.probe.cli import recording_options
from portspeed.errors import ConfigError

__all__ = ["add_arguments", "environment", "make_folder", "existing_recordings"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The perf switches, added to torchrun's parser."""
    g = parser.add_argument_group("perf (docs/performance.md)")
    g.add_argument("--perf", default=None, metavar="DIR",
                   help="time each module's forward and backward, host syncs, CPU fallbacks and collectives of the "
                        "iterations chosen, per rank, into DIR; the folder must hold no recording yet")
    g.add_argument("--perf-iterations", default=None, metavar="A:B", help="training iterations timed (default 2:4)")
    g.add_argument("--perf-ranks", default=None, metavar="R,...", help="global ranks that record (default: all)")
    g.add_argument("--perf-level", default=None, metavar="module|op",
                   help="module (default): modules' forward and backward; op: also each operator inside them")


def existing_recordings(folder: str) -> list[str]:
    """The per-rank recordings ``folder`` already holds (``rank<R>.jsonl``), sorted."""
    return sorted(glob.glob(os.path.join(folder, "rank*.jsonl")))


def environment(args: argparse.Namespace, world: int | None = None) -> dict[str, str]:
    """The PORTSPEED_PERF* values for the workers ({} without --perf); ConfigError names the bad switch."""
    env = config.PERF_ENV
    out = recording_options.common_environment(args, "perf", env, world, "the folder the timings go to")
    if not out:
        return out
    recording_options.workers_reading(out)
    found = existing_recordings(out[env["dir"]])
    if found:
        raise ConfigError(f"--perf {args.perf!r} already holds a perf recording ({found[0]}); remove it or choose "
                          "another folder")
    return out


def make_folder(values: dict[str, str]) -> None:
    """Make the folder (after every other check: a refused line creates nothing); ConfigError when it cannot be
    made or written."""
    recording_options.make_folder(values, "perf", config.PERF_ENV)
