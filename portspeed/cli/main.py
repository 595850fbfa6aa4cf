"""The `portspeed` command: a thin dispatcher to one module per subcommand.

Each subcommand lives in its own module with ``main(argv: list[str]) -> int`` and is
imported only when used, so `portspeed --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "COMMANDS"]

#: subcommand -> ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("portspeed.cli.info:main", "versions, device adapters, backend capability gaps, which patch sets apply"),
    "patches": ("portspeed.cli.patches:main", "list every patch: applied / pending / skipped / failed"),
    "run": ("portspeed.cli.run:main",
            "torchrun-compatible launcher that imports a framework set-up (--adaptor) in every worker"),
    "megatron-tests": ("portspeed.cli.megatron_tests:main",
                       "Megatron-LM's own unit tests (tests/unit_tests of a checkout), launched as its CI does"),
    "why-hung": ("portspeed.trace.cli.why_hung:main",
                 "read the ranks' flight-recorder dumps and name why the job hung"),
    "compare": ("portspeed.parity.compare:main", "compare per-iteration losses of two or more runs"),
    "precheck": ("portspeed.probe.cli.precheck:main", "replay an op-level probe dump in float64: ops off their band"),
    "conformance": ("portspeed.conformance.__main__:main",
                    "prove a device adapter on its hardware: device, collectives, training vs CPU losses"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="portspeed",
        description="Run Megatron-LM / DeepSpeed on any accelerator, and compare losses across backends.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    target, _ = COMMANDS[name]
    modname, _, func = target.partition(":")
    return int(getattr(importlib.import_module(modname), func)(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
