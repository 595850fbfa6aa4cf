"""torch's own flight recorder, turned on where it covers the backend (NCCL), dumping next to portspeed's.

Why: on NCCL torch's recorder sees what portspeed's cannot: when a collective really started
and completed on the device (CUDA events), from its own watchdog thread, and it dumps by
itself on NCCL's timeout. portspeed's recorder (``portspeed.comm.trace``) still runs (it has
the caller's line for every call and the write-through file); this module sets torch's
settings before the default process group is made (``before_init``, called by
``portspeed.comm.groups`` with the real backend), so its dumps land in the same folder as
``torch_fr_trace_rank_<R>``, which ``portspeed why-hung`` reads; and a portspeed dump (SIGUSR1,
the hang watchdog, an error) writes torch's buffer there too.

Where torch's recorder does not cover the backend (Gloo on torch 2.13 records collectives
only, without times; vendor CCLs, the stand-in, testccl) nothing is set: portspeed's
recorder is the record. A setting the user gave is never overridden.

Verified on one H200 (benchmarks/check_trace_nccl.py, one rank): the watchdog's and the exit's dumps
write torch's NCCL buffer, why-hung and torch's fr_trace read it. CI checks the settings and the call
order on CPU, and reads that real NCCL dump. Not run: torch's own dump on an NCCL timeout (one GPU).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from portspeed.comm.trace import recorder
from portspeed.comm.trace_files import TORCH_DUMP_PREFIX

__all__ = ["TORCH_FR_ENV", "torch_recorder_env", "before_init", "dump_torch"]


def dump_torch(folder: str, rank: int) -> None:
    """Also write torch's own flight-recorder buffer (NCCL) where its own dumps go, under the name why-hung reads."""
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace

        data = _dump_nccl_trace()
    except Exception as exc:  # no NCCL in this build, or its recorder is off
        print(f"portspeed trace: torch's flight recorder not dumped ({exc})", file=sys.stderr, flush=True)
        return
    path = os.path.join(folder, f"{TORCH_DUMP_PREFIX}{rank}")
    with open(f"{path}.tmp{os.getpid()}", "wb") as f:
        f.write(data)
    os.replace(f"{path}.tmp{os.getpid()}", path)


#: torch's settings for its own recorder (NCCL), set before the first process group when PORTSPEED_TRACE is on
TORCH_FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def torch_recorder_env(backend: Any, entries: int, folder: str, env: Any = None) -> dict[str, str]:
    """The settings that turn torch's own flight recorder on for ``backend`` (only NCCL: torch's recorder there
    has start / completion times and p2p), dumping to ``folder`` as ``torch_fr_trace_rank_<R>``; set into ``env``
    (default ``os.environ``) where the user did not set them. Returns what it set."""
    env = os.environ if env is None else env
    if backend is None or "nccl" not in str(backend).lower():
        return {}
    want = {"TORCH_FR_BUFFER_SIZE": str(entries), "TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": os.path.join(folder, TORCH_DUMP_PREFIX),
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(folder, TORCH_DUMP_PREFIX)}
    done = {k: v for k, v in want.items() if not env.get(k)}
    env.update(done)
    return done


def before_init(backend: Any) -> None:
    """Called with the real backend just before the default group is made: on NCCL, turn torch's recorder on too."""
    rec = recorder()
    if rec is None:
        return
    if backend is None:  # left to torch (native CUDA): its default pairs gloo on CPU with nccl on CUDA
        import torch

        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else None
    if torch_recorder_env(backend, rec.entries.maxlen or 0, rec.folder_now()) or "nccl" in str(backend).lower():
        rec.torch_dump = dump_torch  # the recorder's dumps write torch's buffer too (it imports nothing of this module)
