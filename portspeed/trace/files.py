"""The flight recorder's files and settings by name: what the ranks write into the dump folder, what the launcher reads.

Why a module of its own: the ranks (the recorder, ``portspeed.trace.flight_recorder``, and `portspeed run`'s
worker) write these files and the launcher's watchdog (``portspeed.trace.cli.hang_watch``) reads them in a
process that must not load torch; both take the names from here, so the two sides cannot drift.
The variables are parsed by ``portspeed.config`` only (one reading for the launcher and every rank);
they are named here for the processes that set them.

The folder (``PORTSPEED_TRACE_DIR``) holds, per rank ``R``:

- ``portspeed_trace_rank_R``: the dump, a pickle in torch's flight-recorder format;
- ``torch_fr_trace_rank_R``: torch's own dump (NCCL), next to it;
- ``portspeed_last_calls_R.txt``: the write-through file, one line per issued call;
- ``portspeed_progress_R.beat``: the heartbeat (``--hang-timeout``): its mtime is the rank's last
  completed call, its text the rank's pid;
- ``portspeed_progress_R.unrecorded``: kept by the worker until the rank's recorder starts: its
  pid, whether the rank is still starting, and why it records nothing yet.
"""

from __future__ import annotations

import os

from portspeed.config import HANG_TIMEOUT_ENV, TRACE_DIR_ENV, TRACE_ENV, TRACE_ON_EXIT_ENV

__all__ = ["DUMP_PREFIX", "TORCH_DUMP_PREFIX", "WRITE_THROUGH_PREFIX", "PROGRESS_PREFIX", "BEAT_SUFFIX",
           "UNRECORDED_SUFFIX", "HANG_ENV", "TRACE_ENV", "TRACE_DIR_ENV", "TRACE_ON_EXIT_ENV", "beat_file",
           "unrecorded_file", "progress_rank"]

#: dump files: ``<prefix><rank>`` (torch's loader infers the prefix from the trailing rank)
DUMP_PREFIX = "portspeed_trace_rank_"
#: torch's own dumps (NCCL, ``TORCH_FR_DUMP_TEMP_FILE``): ``<prefix><rank>``, next to portspeed's
TORCH_DUMP_PREFIX = "torch_fr_trace_rank_"
#: write-through files ``<prefix><rank>.txt`` (named so torch's loader, which reads ``*<digits>``, skips them)
WRITE_THROUGH_PREFIX = "portspeed_last_calls_"
#: the files `portspeed run --hang-timeout` watches: ``<prefix><rank><suffix>``
PROGRESS_PREFIX = "portspeed_progress_"
BEAT_SUFFIX = ".beat"
UNRECORDED_SUFFIX = ".unrecorded"
#: set by `portspeed run --hang-timeout` for the workers: they keep the files above
HANG_ENV = HANG_TIMEOUT_ENV


def beat_file(folder: str, rank: int) -> str:
    """The heartbeat file of ``rank`` (the recorder writes it)."""
    return os.path.join(folder, f"{PROGRESS_PREFIX}{rank}{BEAT_SUFFIX}")


def unrecorded_file(folder: str, rank: int) -> str:
    """The file that says why ``rank`` records nothing yet (the worker writes it)."""
    return os.path.join(folder, f"{PROGRESS_PREFIX}{rank}{UNRECORDED_SUFFIX}")


def progress_rank(name: str, suffix: str) -> int | None:
    """The rank of a progress file name with ``suffix`` (None: not one)."""
    if not (name.startswith(PROGRESS_PREFIX) and name.endswith(suffix)):
        return None
    middle = name[len(PROGRESS_PREFIX):-len(suffix)]
    return int(middle) if middle.isascii() and middle.isdigit() else None
