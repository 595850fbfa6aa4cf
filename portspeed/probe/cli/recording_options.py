"""What `portspeed run`'s probe and perf switches share: the companions' check, the folder, iterations, level and
ranks read by their settings' parsers, the workers' reading, and making the folder (the launcher hands the variables
on).

Why shared: ``--probe DIR`` and ``--perf DIR`` are read the same way (``probe_options``, ``perf_options``): a
bad switch is refused in one line, exit 2, before any worker starts and before anything is created, and each
switch goes through the parser its variable is declared with (``portspeed.settings.TABLE``), the reading every
worker, and a torchrun launch, gets. What differs (the probe's globs and flags, what counts as a recording
already there) stays in each module.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from portspeed import config
from portspeed.errors import ConfigError

__all__ = ["companions", "common_environment", "workers_reading", "make_folder"]


def companions(kind: str) -> tuple[str, ...]:
    """The switches that need ``--KIND DIR``, as argparse names them (declared with their settings)."""
    return tuple(s.switch[2:].replace("-", "_") for s in config.TABLE if (s.switch or "").startswith(f"--{kind}-"))


def parse(switch: str, value: str) -> Any:
    """The switch read by its setting's own parser (the one every worker uses on the variable)."""
    return next(s for s in config.TABLE if s.switch == switch).parse(switch, value)


def common_environment(args: argparse.Namespace, kind: str, env: dict[str, str], world: int | None,
                       needs: str) -> dict[str, str]:
    """PORTSPEED_<KIND>_* for ``--KIND DIR``, ``--KIND-iterations``, ``--KIND-level`` and ``--KIND-ranks`` ({} without
    ``--KIND``; a companion without it is refused: ``needs`` says what DIR is for)."""
    if getattr(args, kind) is None:
        given = [n for n in companions(kind) if getattr(args, n) not in (None, False)]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --{kind} DIR ({needs})")
        return {}
    out = {env["dir"]: parse(f"--{kind}", getattr(args, kind))}
    iterations = getattr(args, f"{kind}_iterations")
    if iterations is not None:
        a, b = parse(f"--{kind}-iterations", iterations)
        out[env["iterations"]] = f"{a}:{b}"
    level = getattr(args, f"{kind}_level")
    if level is not None:
        out[env["level"]] = str(parse(f"--{kind}-level", level))
    given_ranks = getattr(args, f"{kind}_ranks")
    if given_ranks is not None:
        ranks: tuple[int, ...] = parse(f"--{kind}-ranks", given_ranks)
        outside = [r for r in ranks if world is not None and r >= world]
        if outside:
            raise ConfigError(f"--{kind}-ranks {given_ranks!r}: rank {outside[0]} is not in this job's ranks "
                              f"0..{world - 1}")
        out[env["ranks"]] = ",".join(map(str, ranks))
    return out


def workers_reading(out: dict[str, str]) -> None:
    """Read the values as every worker will: refused here if they would refuse them."""
    config.Settings.from_env({**os.environ, **out})


def make_folder(values: dict[str, str], kind: str, env: dict[str, str]) -> None:
    """Make the folder (after every other check: a refused line creates nothing); ConfigError when it cannot be
    made or written (as root, os.access says yes to /proc). `portspeed run` hands the variables on."""
    if not values:
        return
    folder = values[env["dir"]]
    try:
        os.makedirs(folder, exist_ok=True)
        check = os.path.join(folder, f".portspeed-write-check-{os.getpid()}")
        with open(check, "w"):
            pass
        os.remove(check)
    except OSError as exc:
        raise ConfigError(f"--{kind} {folder!r} is not a writable folder ({exc.strerror}); give a folder this user "
                          "can write") from None
