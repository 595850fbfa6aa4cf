"""The ``portspeed`` command line: one module per subcommand, dispatched by ``main``.

Layer: command line, the top. It may import every other layer; nothing imports it.

- ``main``     the dispatcher (``portspeed COMMAND``).
- ``info``     `portspeed info`: versions, adapters, backend gaps, which patch sets apply.
- ``patches``  `portspeed patches`: every patch and its status; ``--check`` for upstream drift.
- ``run``      `portspeed run`: torchrun, with the adaptor imported first in every worker.
- ``worker``   what each `portspeed run` worker executes.
"""

from __future__ import annotations

from portspeed.cli.main import COMMANDS, main

__all__ = ["COMMANDS", "main"]
