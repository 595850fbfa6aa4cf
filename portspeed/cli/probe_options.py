"""`portspeed run`'s probe switches: ``--probe DIR`` and its companions, turned into PORTSPEED_PROBE_* for the workers.

Why in the launcher: a bad switch must be refused in one line, exit 2, before any worker starts
and before anything is created or overwritten, and a folder that already holds a dump is only
knowable for all ranks here (each rank can only check its own). Each switch is read by the parser its
variable is declared with (``portspeed.settings.TABLE``), the one every worker applies to the variable, the same
reading a torchrun launch gets.

Switches: ``--probe DIR``, ``--probe-iterations A:B`` (default 1:1), ``--probe-level module|op``,
``--probe-ranks R,...``, ``--probe-modules GLOB``, ``--probe-tensors GLOB``, ``--probe-nan``,
``--probe-inputs``. Every one but ``--probe`` needs ``--probe``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from portspeed import config
from portspeed.errors import ConfigError

__all__ = ["add_arguments", "environment", "export"]

#: the switches that need --probe, as argparse names them (declared with their settings: portspeed.settings.TABLE)
_COMPANIONS = tuple(s.switch[2:].replace("-", "_") for s in config.TABLE if (s.switch or "").startswith("--probe-"))


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
    if args.probe is None:
        given = [n for n in _COMPANIONS if getattr(args, n) not in (None, False)]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --probe DIR (the folder the probe writes)")
        return {}
    parsers = {s.switch: s for s in config.TABLE if s.switch}

    def parse(switch: str, value: str) -> Any:
        """The switch read by its setting's own parser (the one every worker uses on the variable)."""
        return parsers[switch].parse(switch, value)

    env = config.PROBE_ENV
    out = {env["dir"]: parse("--probe", args.probe)}
    if args.probe_iterations is not None:
        a, b = parse("--probe-iterations", args.probe_iterations)
        out[env["iterations"]] = f"{a}:{b}"
    if args.probe_level is not None:
        out[env["level"]] = str(parse("--probe-level", args.probe_level))
    if args.probe_ranks is not None:
        ranks: tuple[int, ...] = parse("--probe-ranks", args.probe_ranks)
        outside = [r for r in ranks if world is not None and r >= world]
        if outside:
            raise ConfigError(f"--probe-ranks {args.probe_ranks!r}: rank {outside[0]} is not in this job's ranks "
                              f"0..{world - 1}")
        out[env["ranks"]] = ",".join(map(str, ranks))
    for name in ("modules", "tensors"):
        value = getattr(args, f"probe_{name}")
        if value is not None:
            out[env[name]] = str(parse(f"--probe-{name}", value))
    if args.probe_nan:
        out[env["nan"]] = "1"
    if args.probe_inputs:
        out[env["inputs"]] = "1"
    config.Settings.from_env({**os.environ, **out})  # the workers' reading: refused here if they would refuse it
    from portspeed.probe.writer import existing_dumps

    found = existing_dumps(out[env["dir"]])
    if found:
        raise ConfigError(f"--probe {args.probe!r} already holds a probe dump ({found[0]}); remove it or choose "
                          "another folder")
    return out


def export(values: dict[str, str]) -> None:
    """Make the folder (after every other check: a refused line creates nothing) and hand the variables to the
    workers; ConfigError when it cannot be made or written (as root, os.access says yes to /proc)."""
    if not values:
        return
    folder = values[config.PROBE_ENV["dir"]]
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".portspeed-write-check-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"--probe {folder!r} is not a writable folder ({exc.strerror}); give a folder this user "
                          "can write") from None
    os.environ.update(values)
