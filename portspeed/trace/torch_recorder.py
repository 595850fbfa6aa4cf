"""torch's own flight recorder, turned on where it covers the backend (NCCL), dumping next to portspeed's.

Why: on NCCL torch's recorder sees what portspeed's cannot: when a collective really started
and completed on the device (CUDA events), from its own watchdog thread, and it dumps by
itself on NCCL's timeout. portspeed's recorder (``portspeed.trace.flight_recorder``) still runs (it has
the caller's line for every call and the write-through file); this module sets torch's
settings before the default process group is made (``before_init``, called by
``portspeed.comm.groups`` with the real backend), so its dumps land in the same folder as
``torch_fr_trace_rank_<R>``, which ``portspeed why-hung`` reads; and a portspeed dump (SIGUSR1,
the hang watchdog, an error) writes torch's buffer there too.

Where torch's recorder does not cover the backend (Gloo on torch 2.13 records collectives
only, without times; vendor CCLs, the stand-in, testccl) nothing is set: portspeed's
recorder is the record. A setting the user gave is never overridden.

torch >= 2.15 records by itself: Gloo its collectives (not its point-to-point calls, and never
"completed"), and every C++ backend that does not record itself through the ``FlightRecorderHook``
torch attaches by default (testccl, a vendor's C++ CCL, nccl2; buffer ``TORCH_FR_BUFFER_SIZE``,
2000, 0 off); Python process groups (the stand-in) it skips. There, so that no call is recorded
twice, ``torch_records`` tells the recorder which of a group's calls are torch's: their entries
stay in torch's buffers (with its numbering and states; testccl pushes completion), portspeed
keeps only their write-through line, sequence number and in-flight mark, and every portspeed
dump writes torch's buffers beside it (``dump_torch_recorders``: ``torch_fr_trace_rank_<R>`` for
the hooked backend, ``torch_fr_gloo_rank_<R>`` for Gloo), which `portspeed why-hung` merges with
portspeed's own entries (the stand-in's calls, Gloo's point-to-point calls). ``before_init`` sizes
torch's buffers as ``PORTSPEED_TRACE`` and points its failure dumps (the hook's abort hook) at the
dump folder, where the user set neither.

Verified on one H200 (benchmarks/check_trace_nccl.py, one rank): the watchdog's and the exit's dumps
write torch's NCCL buffer, why-hung and torch's fr_trace read it. CI checks the settings and the call
order on CPU, and reads that real NCCL dump. Not run: torch's own dump on an NCCL timeout (one GPU).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from portspeed.trace.flight_recorder import recorder
from portspeed.trace.files import TORCH_DUMP_PREFIX

__all__ = ["TORCH_FR_ENV", "TORCH_GLOO_DUMP_PREFIX", "torch_recorder_env", "before_init", "dump_torch",
           "records_itself", "torch_records", "dump_torch_recorders"]

#: torch >= 2.15: Gloo's own recorder dumped beside portspeed's (``<prefix><rank>``; the hooked backend's buffer
#: goes to ``TORCH_DUMP_PREFIX``, the name torch's own failure dump gets)
TORCH_GLOO_DUMP_PREFIX = "torch_fr_gloo_rank_"
#: the backends whose recorders held some group's calls in this process (dumped even after the groups are gone)
_RECORDING: set[str] = set()


def records_itself() -> bool:
    """Whether this torch records Gloo and hooks other C++ backends itself (torch >= 2.15)."""
    from torch.distributed import distributed_c10d as c10d

    return hasattr(c10d, "FlightRecorderHook")


def _buffer_size() -> int:
    """torch's buffer, read as its FlightRecorder reads it: the first variable set, else 2000; 0 is off."""
    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(var, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                return 0
    return 2000


def _backend_names(pg: Any) -> list[str]:
    """The real backends serving ``pg`` (``gloo``, ``testccl``...), one per device type."""
    names = []
    for dev in getattr(pg, "_device_types", []) or []:
        try:
            names.append(str(pg._get_backend(dev).name()).lower())
        except Exception:  # a device without a backend registered: nothing torch records for it
            pass
    return names


def torch_records(pg: Any) -> tuple[bool, bool]:
    """(collectives, point-to-point): whether torch >= 2.15's own recorder holds ``pg``'s calls of each kind."""
    from torch.distributed import distributed_c10d as c10d

    if not records_itself() or type(pg) is not c10d.ProcessGroup or _buffer_size() <= 0:
        return False, False  # older torch, a Python process group (never recorded by torch), recording off
    names = _backend_names(pg)
    if pg in getattr(c10d._world, "pg_flight_recorder_hooks", {}):
        _RECORDING.update(names)
        return True, True  # the hook records every call the dispatcher hands the group's backend
    if names and all(n == "gloo" for n in names):
        _RECORDING.add("gloo")
        return True, False  # Gloo records its collectives itself, not its sends and receives
    return False, False


def dump_torch_recorders(folder: str, rank: int, rec: Any = None) -> None:
    """torch >= 2.15: write the buffers of torch's recorders this process used (Gloo's, the hooked backends').

    torch 2.15's Gloo recorder lists every group in ``pg_config`` under the name ``''`` (it is filled before the
    group is named) while its entries name the group, and torch's own analyser (``fr_trace``) then fails with a
    KeyError; the rows of the groups its entries name are added from ``rec``'s table (name, description, ranks)."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    hooked = sorted(_RECORDING - {"gloo"})
    files = [(n, TORCH_DUMP_PREFIX if i == 0 else f"torch_fr_{n}_rank_") for i, n in enumerate(hooked)]
    files += [("gloo", TORCH_GLOO_DUMP_PREFIX)] if "gloo" in _RECORDING else []
    for backend, prefix in files:
        try:
            data = _dump_fr_trace(backend=backend)
            if rec is not None:
                dump = pickle.loads(data)
                cfg = dump.setdefault("pg_config", {})
                for g in list(rec.groups.values()):
                    if g[0] not in cfg and any(e["process_group"][0] == g[0] for e in dump.get("entries", [])):
                        cfg[g[0]] = {"name": g[0], "desc": g[1], "ranks": str(list(g[2]))}
                data = pickle.dumps(dump)
        except Exception as exc:  # a recorder that cannot be read must not stop portspeed's own dump
            print(f"portspeed trace: torch's {backend} flight recorder not dumped ({exc})", file=sys.stderr, flush=True)
            continue
        path = os.path.join(folder, f"{prefix}{rank}")
        with open(f"{path}.tmp{os.getpid()}", "wb") as f:
            f.write(data)
        os.replace(f"{path}.tmp{os.getpid()}", path)


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
    if records_itself():  # torch >= 2.15: torch's entries where torch records, buffers sized as portspeed's
        if not os.environ.get("TORCH_FR_BUFFER_SIZE") and not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
            os.environ["TORCH_FR_BUFFER_SIZE"] = str(rec.entries.maxlen or 0)
        if not os.environ.get("TORCH_FR_DUMP_TEMP_FILE"):
            os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(rec.folder_now(), TORCH_DUMP_PREFIX)
        rec.torch_records = torch_records
        rec.torch_dump = lambda folder, rank: dump_torch_recorders(folder, rank, rec)
        return
    if torch_recorder_env(backend, rec.entries.maxlen or 0, rec.folder_now()) or "nccl" in str(backend).lower():
        rec.torch_dump = dump_torch  # the recorder's dumps write torch's buffer too (it imports nothing of this module)
