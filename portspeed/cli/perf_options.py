"""`portspeed run`'s perf switches: ``--perf DIR`` and its companions, turned into PORTSPEED_PERF_* for the workers.

Why in the launcher: as for the probe (``portspeed.cli.probe_options``), a bad switch is refused in one
line, exit 2, before any worker starts and before anything is created, and a folder that already holds a
recording is only knowable for all ranks here. Each switch is read by the parser its variable is declared
with (``portspeed.settings.TABLE``), so the launcher reads it as every worker, and a torchrun launch, does.

Switches: ``--perf DIR``, ``--perf-iterations A:B`` (default 2:4), ``--perf-ranks R,...``,
``--perf-level module|op``. Every one but ``--perf`` needs ``--perf``.
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any

from portspeed import config
from portspeed.errors import ConfigError

__all__ = ["add_arguments", "environment", "export", "existing_recordings"]

#: the switches that need --perf, as argparse names them
_COMPANIONS = tuple(s.switch[2:].replace("-", "_") for s in config.TABLE if (s.switch or "").startswith("--perf-"))


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
    if args.perf is None:
        given = [n for n in _COMPANIONS if getattr(args, n) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --perf DIR (the folder the timings go to)")
        return {}
    by_switch = {s.switch: s for s in config.TABLE if s.switch}

    def parse(switch: str, value: str) -> Any:
        return by_switch[switch].parse(switch, value)

    env = config.PERF_ENV
    out = {env["dir"]: parse("--perf", args.perf)}
    if args.perf_iterations is not None:
        a, b = parse("--perf-iterations", args.perf_iterations)
        out[env["iterations"]] = f"{a}:{b}"
    if args.perf_ranks is not None:
        ranks: tuple[int, ...] = parse("--perf-ranks", args.perf_ranks)
        outside = [r for r in ranks if world is not None and r >= world]
        if outside:
            raise ConfigError(f"--perf-ranks {args.perf_ranks!r}: rank {outside[0]} is not in this job's ranks "
                              f"0..{world - 1}")
        out[env["ranks"]] = ",".join(map(str, ranks))
    if args.perf_level is not None:
        out[env["level"]] = str(parse("--perf-level", args.perf_level))
    config.Settings.from_env({**os.environ, **out})  # the workers' reading: refused here if they would refuse it
    found = existing_recordings(out[env["dir"]])
    if found:
        raise ConfigError(f"--perf {args.perf!r} already holds a perf recording ({found[0]}); remove it or choose "
                          "another folder")
    return out


def export(values: dict[str, str]) -> None:
    """Make the folder (after every other check: a refused line creates nothing) and hand the variables on."""
    if not values:
        return
    folder = values[config.PERF_ENV["dir"]]
    try:
        os.makedirs(folder, exist_ok=True)
        check = os.path.join(folder, f".portspeed-write-check-{os.getpid()}")
        with open(check, "w"):
            pass
        os.remove(check)
    except OSError as exc:
        raise ConfigError(f"--perf {folder!r} is not a writable folder ({exc.strerror}); give a folder this user "
                          "can write") from None
    os.environ.update(values)
