"""`portspeed run`'s probe switches: ``--probe DIR`` and its companions, turned into PORTSPEED_PROBE_* for the workers.

Why in the launcher: a bad switch must be refused in one line, exit 2, before any worker starts
and before anything is created or overwritten, and a folder that already holds a dump is only
knowable for all ranks here (each rank can only check its own). The variables are parsed by
``portspeed.config`` in every worker, the same reading a torchrun launch gets.

Switches: ``--probe DIR``, ``--probe-iterations A:B`` (default 1:1), ``--probe-level module|op``,
``--probe-ranks R,...``, ``--probe-modules GLOB``, ``--probe-tensors GLOB``, ``--probe-nan``,
``--probe-inputs``. Every one but ``--probe`` needs ``--probe``.
"""

from __future__ import annotations

import argparse
import os

from portspeed import config
from portspeed.errors import ConfigError

__all__ = ["add_arguments", "environment", "export"]

_COMPANIONS = ("probe_iterations", "probe_level", "probe_ranks", "probe_modules", "probe_tensors", "probe_nan",
               "probe_inputs")


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
    env = config.PROBE_ENV
    out = {env["dir"]: config.check_probe_dir("--probe", args.probe)}
    if args.probe_iterations is not None:
        a, b = config.parse_probe_iterations("--probe-iterations", args.probe_iterations)
        out[env["iterations"]] = f"{a}:{b}"
    if args.probe_level is not None:
        level = args.probe_level.strip().lower()
        if level not in config.PROBE_LEVELS:
            raise ConfigError(f"--probe-level {args.probe_level!r} is not a probe level; use module (every module's "
                              "outputs, gradients, parameters) or op (also every torch function and collective)")
        out[env["level"]] = level
    if args.probe_ranks is not None:
        parts = [p.strip() for p in args.probe_ranks.split(",") if p.strip()]
        if not parts or not all(p.isascii() and p.isdigit() for p in parts):
            raise ConfigError(f"--probe-ranks {args.probe_ranks!r} is not a list of ranks; give global ranks "
                              "separated by commas, e.g. 0,3")
        outside = [int(p) for p in parts if world is not None and int(p) >= world]
        if outside:
            raise ConfigError(f"--probe-ranks {args.probe_ranks!r}: rank {outside[0]} is not in this job's ranks "
                              f"0..{world - 1}")
        out[env["ranks"]] = ",".join(parts)
    for name in ("modules", "tensors"):
        value = getattr(args, f"probe_{name}")
        if value is not None:
            if not value.strip():
                raise ConfigError(f"--probe-{name} is empty; give a glob such as "
                                  f"{'decoder.layers.1*' if name == 'modules' else 'Module.decoder.layers.1.*'}")
            out[env[name]] = value.strip()
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
