"""The collective libraries' own inner groups in the flight recorder, labelled as staging groups.

Why: testccl (the test device's CCL) and the stand-in CCL carry each collective over an inner
Gloo group of their own. When a user's collective hangs, the rank is inside one of those
inner calls; a dump that shows it helps, but ``portspeed why-hung`` must never name an inner
group as the cause: its calls only follow the user's (a user's skipped all_reduce shows up
there as a send with no receive). So the inner groups are listed in the dump's ``pg_config``
with a ``staging group of <ccl>`` description and ``ps_staging``, and the stand-in's ring steps
(Python) are recorded apart from the user's calls (``Recorder.staged``, at most 256: they must
not push the user's calls out of the ring; dumped under ``ps_staged``, not torch's ``entries``,
which torch's reader would pair as the user's), under the user's call in flight: group
``<group>/staging``, the user's sequence number, p2p with the global peer. testccl's inner calls
are made in C++ and are not recorded; its inner groups are only listed.

Cost: none when recording is off (``recorder()`` is None and the CCLs skip every call here).
"""

from __future__ import annotations

import time
from typing import Any

from portspeed.trace.flight_recorder import Recorder, _device, _rank, _sizes, recorder

__all__ = ["label", "stage", "staged_done"]


def label(owner: str, rank: int, size: int, note: str, rec: Recorder | None = None) -> Recorder | None:
    """List a CCL's inner group (made now, on this rank) in the dumps as a staging group; the recorder or None."""
    rec = rec if rec is not None else recorder()
    if rec is None:
        return None
    n = len(rec.staging_groups)
    rec.staging_groups.append({"name": f"staging:{owner}:{n}", "desc": f"staging group of {owner} ({note})",
                               "ranks": "[]", "ps_staging": owner, "ps_group_rank": rank, "ps_group_size": size})
    return rec


def stage(rec: Recorder, owner: str, send: Any, dst: int, recv: Any, src: int) -> list[dict]:
    """Record one inner exchange (a send to ``dst`` and/or a receive from ``src``, group-local ranks) under the
    user's call in flight; ``staged_done`` marks them completed."""
    outer = rec.in_flight
    if outer is None:
        return []
    pg, ranks = outer["process_group"], outer["ps_ranks"]
    group = (f"{pg[0]}/staging", f"staging group of {owner} under group {pg[0]}" + (f" ({pg[1]})" if pg[1] else ""))
    backend = str(outer["profiling_name"]).split(":")[0]  # torch's reader knows only its own backend names
    me = ranks.index(_rank()) if _rank() in ranks else -1
    out = []
    for kind, t, peer in (("send", send, dst), ("recv", recv, src)):
        if t is None:
            continue
        rec.record_id += 1
        ins, idt = _sizes(t)
        e = {"record_id": rec.record_id, "pg_id": 0, "process_group": group,
             "collective_seq_id": outer["collective_seq_id"], "p2p_seq_id": 0, "op_id": rec.record_id,
             "profiling_name": f"{backend}:{kind} {me}{'->' if kind == 'send' else '<-'}{peer}",
             "time_created_ns": time.time_ns(), "input_sizes": ins,
             "input_dtypes": idt, "output_sizes": ins, "output_dtypes": idt, "state": "scheduled",
             "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": False,
             "timeout_ms": outer["timeout_ms"], "is_p2p": True, "frames": outer["frames"][:1], "ps_op": kind,
             "ps_peer": ranks[peer] if 0 <= peer < len(ranks) else peer, "ps_ranks": ranks,
             "ps_device": _device(t), "ps_async": True, "ps_staging": owner}
        rec.staged.append(e)
        out.append(e)
    return out


def staged_done(entries: list[dict]) -> None:
    """The inner exchange finished."""
    now = time.time_ns()
    for e in entries:
        e["state"], e["time_discovered_completed_ns"], e["retired"] = "completed", now, True
