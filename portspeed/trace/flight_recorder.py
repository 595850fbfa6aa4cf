"""A flight recorder for every backend: each rank's last collectives and point-to-point calls, dumped on a hang.

Why: a hung job otherwise waits for the collective timeout and dies with a backend error that
names neither the rank that diverged nor the collective it skipped. torch's own flight
recorder covers NCCL; on Gloo (torch 2.13) it records collectives only, with no times and
the state stuck at "scheduled", and vendor CCLs, the stand-in and testccl get nothing. So
portspeed records, in torch's dump format (``torch.distributed.flight_recorder`` reads it),
every call that passes through ``torch.distributed``'s collectives and point-to-point
functions, in a bounded ring buffer per rank (``PORTSPEED_TRACE=N`` entries; 0: off).

Contract
- Observation only: the recorded call gets the caller's own arguments and its result or
  error is handed back untouched; nothing here changes what a collective computes or when
  it completes. A call made inside a recorded one (a rewrite, ``batch_isend_irecv``'s own
  ``isend``) is not recorded twice.
- The wrappers that feed it, one plain-function frame each, are ``portspeed.trace.wrappers``; an
  entry's vocabulary (file names, the op table, dtype names, the hot path's caches) is
  ``portspeed.trace.fields``.
- Off (the default): the patches are not installed at all (``patches/torch_distributed.py``),
  so the routed hot path is the router's, unchanged. On: one plain-function frame in front
  of the routed function (docs/benchmarks.md, "Recording").
- Entries carry torch's fields (``record_id``, ``process_group`` (name, desc),
  ``collective_seq_id``, ``p2p_seq_id``, ``profiling_name`` ``"<backend>:<op>"``, input /
  output sizes and dtypes, ``frames`` (the caller first), ``time_created_ns``,
  ``time_discovered_completed_ns``, ``state`` scheduled / completed), plus ``ps_*`` fields of
  portspeed's own (the torch function called, the global peer of a point-to-point call, the
  device, whether it was asynchronous, the error that ended it).
- Dumps (``dump``): on SIGUSR1 (read by a thread from the signal's wakeup pipe, so a main
  thread blocked inside a collective still dumps), on SIGTERM (the launcher stopping the
  rank: it dumps, then dies of SIGTERM as before), on an exception that ends the rank, when
  a recorded call raises, when one call stays in flight longer than ``PORTSPEED_TIMEOUT``,
  and at exit with ``PORTSPEED_TRACE_ON_EXIT=1`` (``portspeed.trace.triggers``, which the recorder
  starts and which imports nothing of it). Each writes ``<dir>/portspeed_trace_rank_<R>`` (a pickle, as
  torch's dumps) atomically; the folder's file names are ``portspeed.trace.files``.
- The caller's frames start past ``torch.distributed``'s own (its ``*_object`` collectives call the
  recorded functions: the entry is theirs, ``ps_via`` names the ``*_object`` function). The CCLs'
  inner staging groups are listed and, for the stand-in, their steps recorded apart
  (``portspeed.trace.staging``); on NCCL torch's own recorder runs too
  (``portspeed.trace.torch_recorder``, which hands the recorder its dump function: this module imports
  neither). On torch >= 2.15, which records Gloo's collectives and hooked C++ backends' calls itself,
  those calls get no entry here (``torch_records``; their write-through line, sequence number and
  in-flight mark stay): no call is recorded twice, and a dump writes torch's buffers beside this one.
  Groups are held weakly (id -> weakref).
- Write-through: each issued entry is also appended, one line (the repr of a tuple of its
  main fields, ``WRITE_THROUGH_FIELDS``), to ``<dir>/portspeed_last_calls_<R>.txt`` (one
  ``os.write``, no flush needed: the kernel keeps it when the process dies), so a rank killed
  hard still shows its last call.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable

from portspeed.trace.fields import (OPS, VERSION, WRITE_THROUGH_FIELDS, _META, _device, _meta,  # noqa: F401
                                    _sizes, callers, write_through_line)
from portspeed.trace.files import (DUMP_PREFIX, HANG_ENV, PROGRESS_PREFIX, TORCH_DUMP_PREFIX,  # noqa: F401
                                   WRITE_THROUGH_PREFIX)

__all__ = ["OPS", "Recorder", "recorder", "enabled", "dump", "trace_dir", "DUMP_PREFIX", "PROGRESS_PREFIX",
           "WRITE_THROUGH_PREFIX", "HANG_ENV", "TORCH_DUMP_PREFIX", "WRITE_THROUGH_FIELDS", "write_through_line"]

log = logging.getLogger("portspeed.trace")

#: torch.distributed's own folder (set by the first Recorder): frames there are skipped to reach the caller
#: (torch's all_gather_object & co call the recorded functions; so does its logger wrapper)
_TORCH_DIST = "\0"
_C10D: Any = None  # torch.distributed.distributed_c10d (set by the first Recorder)


class Recorder:
    """One rank's ring buffer, its per-group sequence numbers, and the files it writes."""

    def __init__(self, size: int, folder: str | None = None, timeout_s: float = 300.0) -> None:
        global _TORCH_DIST, _C10D
        import torch.distributed
        from torch.distributed import distributed_c10d

        _TORCH_DIST = os.path.dirname(torch.distributed.__file__) + os.sep
        _C10D = distributed_c10d
        self.entries: collections.deque = collections.deque(maxlen=size)
        self.busy = False  # inside a recorded call: nested calls are not recorded
        self.record_id = 0
        #: id(group) -> [name, desc, ranks, coll seq, p2p seq, backend, weakref to the group, write-through repr of
        #: (name, desc), repr of ranks, {op: (profiling name, its repr)}, this rank in the group] (no strong
        #: reference: a group kept alive here past destroy_process_group is destroyed at interpreter exit, where
        #: Gloo aborted rank 1 of the control run in 2 of 5 tries; 0 of 4 since)
        self.groups: dict[Any, list] = {}
        self._world: list | None = None  # the groups row of group=None (the default group), checked on each use
        self.folder = folder
        self.timeout_s = timeout_s
        self.last_done_ns = time.time_ns()
        #: one dump at a time: the exception that ends the rank (main thread) and the launcher's SIGTERM (the
        #: watcher thread) can ask at once; re-entrant for a signal handler running inside a dump
        self._dump_lock = threading.RLock()
        self.in_flight: dict | None = None  # the synchronous call under way
        self._wt_fd: int | None = None
        self._dumped_for: str | None = None
        #: the CCLs' inner staging calls (the stand-in's ring steps), apart: they must not push the user's calls out
        self.staged: collections.deque = collections.deque(maxlen=min(size, 256))
        self.staging_groups: list[dict] = []  # pg_config rows of the CCLs' inner groups
        #: torch's own recorder is on (NCCL): a dump also writes torch's, with this
        #: (set by portspeed.trace.torch_recorder)
        self.torch_dump: Callable[[str, int], None] | None = None
        #: torch >= 2.15: group -> (torch records its collectives, its point-to-point calls) (set by trace_torch).
        #: Such calls keep their write-through line, sequence number and in-flight mark here, but their entry is
        #: torch's (in its dump, which ``torch_dump`` writes beside this one): no call is recorded twice
        self.torch_records: Callable[[Any], tuple[bool, bool]] | None = None

    @property
    def torch_fr(self) -> bool:
        """Whether torch's own flight recorder runs beside this one (NCCL)."""
        return self.torch_dump is not None

    @staticmethod
    def rank() -> int:
        """This process's global rank (RANK before the default group exists)."""
        return _rank()

    # ------------------------------------------------------------------ groups
    def _group(self, group: Any) -> list:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        pg = group if group is not None else c10d.GroupMember.WORLD
        g = self.groups.get(id(pg))
        if g is None or g[6]() is not pg:  # keyed by id, held weakly: a destroyed group must die with torch's
            try:
                name = c10d._get_process_group_name(pg)
                ranks = dist.get_process_group_ranks(pg)
                desc = getattr(pg, "group_desc", "") or ("default_pg" if group is None else "")
                backend = str(dist.get_backend(pg))
            except Exception:  # not initialised, or a group torch does not know: recorded as such
                name, ranks, desc, backend = "?", [], "", "gloo"
            try:
                alive = weakref.ref(pg)
            except TypeError:
                alive = lambda pg=pg: pg  # noqa: E731  (None before init)
            g = [name, desc, ranks, 0, 0, backend.split(":")[-1], alive, f"{name!r}, {desc!r}", repr(ranks), {}, -1,
                 False, False]
            g[10] = self._local(g, None)
            if self.torch_records is not None and name != "?":
                g[11], g[12] = self.torch_records(pg)  # [11] collectives, [12] point-to-point: torch's entries
            self.groups[id(pg)] = g
        return g

    def _row(self, group: Any) -> list:
        """The group's row (see ``groups``), looked up without an import: the hot path's."""
        if group is None:
            g = self._world
            if g is None or g[6]() is not _C10D.GroupMember.WORLD:
                g = self._world = self._group(None)
        else:
            g = self.groups.get(id(group))
            if g is None or g[6]() is not group:
                g = self._group(group)
        return g

    # ------------------------------------------------------------------ entries
    def issue(self, name: str, args: tuple, kwargs: dict) -> dict:
        """Record a call about to be made (state "scheduled"); mark this recorder busy.

        Runs inside the step, where its code and data are cold: it runs ~3x its microbenchmark time
        (docs/benchmarks.md, "Recording"), so what can be is looked up, not rebuilt: the group's row
        without an import, dtype and device names by object, the caller frames and their repr by site."""
        self.busy = True
        op = OPS[name]
        n, ip, op_, pp = len(args), op.input_pos, op.output_pos, op.peer_pos
        g = self._row(args[op.group_pos] if n > op.group_pos else kwargs.get("group"))
        x = (args[ip] if n > ip else kwargs.get(op.input_kw)) if ip >= 0 else None
        y = (args[op_] if n > op_ else kwargs.get(op.output_kw)) if op_ >= 0 else None
        if y is x and x is not None and not isinstance(x, (list, tuple)):  # one tensor, in place (all_reduce...)
            m = _META.get((x.shape, x.dtype, x.device)) or _meta(x)
            ins, idt, device, sizes_repr = m
            outs, odt = ins, idt
        else:
            ins, idt = _sizes(x)
            outs, odt = (ins, idt) if y is x else _sizes(y)
            device = _device(x if x is not None else y)
            sizes_repr = f"{ins!r}, {idt!r}, {outs!r}, {odt!r}"
        self.record_id += 1
        fr = op.fr_name
        if pp >= 0:
            g[4] += 1
            peer = args[pp] if n > pp else kwargs.get(op.peer_kw)
            if peer is None:  # group_dst / group_src: a rank of the group
                local = kwargs.get("group_" + op.peer_kw, -1)
                peer = g[2][local] if 0 <= local < len(g[2]) else -1
            me, there = g[10], self._local(g, peer)
            prof = f"{g[5]}:{fr} {me}->{there}" if fr == "send" else f"{g[5]}:{fr} {me}<-{there}"
            prof_repr = repr(prof)
        else:
            g[3] += 1
            peer = -1
            p = g[9].get(name)
            if p is None:
                p = g[9][name] = (f"{g[5]}:{fr}", repr(f"{g[5]}:{fr}"))
            prof, prof_repr = p
        frames, via, site = callers(sys._getframe(2), _TORCH_DIST)
        e = {"record_id": self.record_id, "pg_id": 0, "process_group": (g[0], g[1]), "collective_seq_id": g[3],
             "p2p_seq_id": g[4], "op_id": self.record_id, "profiling_name": prof, "time_created_ns": time.time_ns(),
             "input_sizes": ins, "input_dtypes": idt, "output_sizes": outs, "output_dtypes": odt,
             "state": "scheduled", "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
             "retired": False, "timeout_ms": int(self.timeout_s * 1000), "is_p2p": pp >= 0, "frames": frames,
             "ps_op": name, "ps_peer": peer, "ps_device": device, "ps_async": False, "ps_ranks": g[2]}
        if via:
            e["ps_via"] = via  # the torch function that made this call (all_gather_object, broadcast_object_list...)
        if g[12 if pp >= 0 else 11]:
            e["ps_torch"] = True  # torch's recorder holds this call (torch >= 2.15): not entered here
        else:
            self.entries.append(e)
        self.in_flight = e
        if self._wt_fd is not None:
            # write_through_line(e), built from the cached reprs: the group's, the sizes', the call site's
            line = "(%d, %s, %d, %d, %s, %s, %d, %r, %r, %s, %r, %s)\n" % (
                e["record_id"], g[7], g[3], g[4], prof_repr, sizes_repr, e["time_created_ns"], pp >= 0, peer, g[8],
                name, site[2] if site is not None else "'?', '?', 0")
            try:
                os.write(self._wt_fd, line.encode())
            except OSError:
                self._wt_fd = None
        return e

    def _local(self, g: list, rank: int | None) -> int:
        if rank is None:
            rank = _rank()
        try:
            return g[2].index(rank)
        except ValueError:
            return rank

    def done(self, e: dict, out: Any) -> None:
        """The call returned: synchronous -> completed; a Work -> completed when its future is."""
        self.busy = False
        self.in_flight = None
        if out is None or isinstance(out, (bool, int)):
            e["state"] = "completed"
            e["time_discovered_completed_ns"] = self.last_done_ns = time.time_ns()
            e["retired"] = True
            return
        e["ps_async"] = True
        works = out if isinstance(out, list) else [out]
        for w in works:
            try:
                w.get_future().add_done_callback(lambda _f, e=e: self._completed(e))
            except Exception:  # a Work without a future: its completion is not seen
                pass

    def _completed(self, e: dict) -> None:
        e["state"] = "completed"
        e["time_discovered_completed_ns"] = self.last_done_ns = time.time_ns()
        e["retired"] = True

    def fail(self, e: dict, error: BaseException) -> None:
        """The call raised (a backend timeout, a peer gone): keep the error and dump now."""
        self.busy = False
        self.in_flight = None
        e["ps_error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        if e.get("ps_torch"):  # torch's entry, unless the backend refused the call before torch recorded it (Gloo's
            self.entries.append(e)  # size checks): kept here, and `why-hung` keeps torch's where both have the call
        self.dump(f"{e['ps_op']} raised {type(error).__name__}")

    # ------------------------------------------------------------------ files
    def folder_now(self) -> str:
        """The dump folder, created on first use and named once in the log."""
        if self.folder is None:
            tag = os.environ.get("MASTER_PORT") or str(os.getpid())
            self.folder = os.path.join(tempfile.gettempdir(), f"portspeed-trace-{os.getuid()}-{tag}")
        if not os.path.isdir(self.folder):
            os.makedirs(self.folder, exist_ok=True)
            log.warning("portspeed trace: dumps go to %s", self.folder)
        return self.folder

    def start_write_through(self) -> None:
        path = os.path.join(self.folder_now(), f"{WRITE_THROUGH_PREFIX}{_rank()}.txt")
        self._wt_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def dump(self, reason: str) -> str | None:
        """Write this rank's buffer as torch's flight recorder would (a pickle); return the path."""
        with self._dump_lock:
            return self._dump(reason)

    def _dump(self, reason: str) -> str | None:
        try:
            rank = _rank()
            entries = [dict(e) for e in list(self.entries)]
            pg_config = {g[0]: {"name": g[0], "desc": g[1], "ranks": str(list(g[2]))}
                         for g in list(self.groups.values())}
            pg_config.update({g["name"]: dict(g) for g in self.staging_groups})
            for e in list(self.staged):  # the inner group under each user group, as its entries name it
                pg_config.setdefault(e["process_group"][0], {"name": e["process_group"][0],
                                                             "desc": e["process_group"][1], "ranks": str(e["ps_ranks"]),
                                                             "ps_staging": e["ps_staging"]})
            data = {"version": VERSION, "pg_config": pg_config, "pg_status": {}, "comm_lib_version": "",
                    "entries": entries, "ps_rank": rank, "ps_reason": reason, "ps_time_ns": time.time_ns(),
                    "ps_pid": os.getpid(), "ps_host": socket.gethostname(),
                    "ps_last_done_ns": self.last_done_ns,
                    # the CCLs' inner calls, apart from torch's "entries" (its reader would pair them as the user's)
                    "ps_staged": [dict(e) for e in list(self.staged)]}
            if self.torch_records is not None:  # torch >= 2.15: the calls torch records are in its dumps, not here
                data["ps_torch_records"] = {g[0]: [k for k, on in (("collectives", g[11]), ("p2p", g[12])) if on]
                                            for g in list(self.groups.values()) if g[11] or g[12]}
            folder = self.folder_now()
            path = os.path.join(folder, f"{DUMP_PREFIX}{rank}")
            tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}"
            with open(tmp, "wb") as f:
                pickle.dump(data, f)
            # torch's first when the hang watchdog asked (portspeed's file appearing tells it the rank is done); after
            # on an error, where the launcher's SIGTERM may end the rank during torch's dump (its first one gathers
            # tracebacks: seconds on a loaded machine): portspeed's file and the write-through file then remain
            late = reason != "SIGUSR1"
            if self.torch_dump is not None and not late:
                self.torch_dump(folder, rank)
            os.replace(tmp, path)
            if self.torch_dump is not None and late:
                self.torch_dump(folder, rank)
            self._dumped_for = reason
            theirs = " (the calls torch records: in torch's dumps beside it)" if self.torch_records is not None else ""
            print(f"portspeed trace: rank {rank} dumped {len(entries)} entries ({reason}) to {path}{theirs}",
                  file=sys.stderr, flush=True)
            return path
        except Exception as exc:  # a dump must never end the rank itself
            print(f"portspeed trace: dump failed: {exc}", file=sys.stderr, flush=True)
            return None


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return int(os.environ.get("RANK", "0") or 0)



_recorder: Recorder | None = None


def enabled() -> bool:
    """Whether PORTSPEED_TRACE asks for recording (read from portspeed's settings)."""
    from portspeed import config

    return config.settings().trace > 0


def recorder() -> Recorder | None:
    """This process's recorder, started on first use when tracing is on (None when off)."""
    global _recorder
    if _recorder is None and enabled():
        from portspeed import config

        s = config.settings()
        _recorder = Recorder(s.trace, s.trace_dir, s.timeout)
        from portspeed.trace.triggers import install

        install(_recorder, s.trace_on_exit)
    return _recorder


def dump(reason: str = "asked") -> str | None:
    """Dump this rank's buffer now (None when tracing is off)."""
    rec = _recorder
    return rec.dump(reason) if rec is not None else None


def trace_dir() -> str | None:
    rec = _recorder
    return rec.folder_now() if rec is not None else None
