"""Reading flight-recorder dumps: portspeed's, torch's and the write-through files, as one entry format.

Why apart from ``why_hung``: reading is the part that knows file names, formats and how a rank that
died hard is still read (its write-through file); the diagnosis reads only entries. No torch needed.
"""

from __future__ import annotations

import ast
import os
import pickle
import re

__all__ = ["Unreadable", "load", "through_entry", "op_name", "call_site", "ranks_of"]

_TRAILING_RANK = re.compile(r"(\d+)$")
#: portspeed.comm.trace.WRITE_THROUGH_FIELDS (not imported: reading dumps needs no torch)
_THROUGH_FIELDS = ("record_id", "pg_name", "pg_desc", "collective_seq_id", "p2p_seq_id", "profiling_name",
                   "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "time_created_ns", "is_p2p",
                   "ps_peer", "ps_ranks", "ps_op", "frame_name", "frame_filename", "frame_line")


class Unreadable(Exception):
    """The folder or a dump in it cannot be read."""



def op_name(e: dict) -> str:
    name = str(e.get("profiling_name", "?"))
    return name.split(":", 1)[-1].split(" ")[0]


#: frames that are not the call site: torch's own distributed code (its *_object collectives, its logger
#: wrapper: torch's recorder keeps them, innermost first) and portspeed's wrappers
_PLUMBING = re.compile(r"[/\\](torch[/\\]distributed|portspeed[/\\]comm|wrapt)[/\\]|[/\\]patches[/\\]torch_distributed\.py$")


def call_site(e: dict) -> str:
    """The caller's ``file:line``: the first frame outside torch.distributed and portspeed's wrappers."""
    frames = e.get("frames") or []
    if not frames:
        return "?"
    f = next((x for x in frames if not _PLUMBING.search(str(x.get("filename", "")))), frames[0])
    return f"{os.path.basename(str(f.get('filename', '?')))}:{f.get('line', '?')}"


def ranks_of(cfg: dict, name: str) -> list[int]:
    try:
        return list(ast.literal_eval(str(cfg.get(name, {}).get("ranks", "[]"))))
    except (ValueError, SyntaxError):
        return []


def load(folder: str) -> dict[int, dict]:
    """rank -> {"entries", "pg_config", "reason", "source"}; raises Unreadable."""
    if not os.path.isdir(folder):
        raise Unreadable(f"{folder!r} is not a folder; give the folder the ranks dumped to (PORTSPEED_TRACE_DIR, "
                         "or the one `portspeed run` named)")
    dumps: dict[int, dict] = {}
    found: dict[str, dict[int, dict]] = {}  # "portspeed" / "torch" -> rank -> dump
    through: dict[int, dict] = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or ".tmp" in name or name.endswith(".beat"):
            continue
        if name.startswith("portspeed_last_calls_") and name.endswith(".txt"):
            rank = int(name[len("portspeed_last_calls_"):-len(".txt")])
            by_id: dict = {}
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    e = through_entry(line)
                    if e is not None:  # None: a line cut by the rank's death
                        by_id[e["record_id"]] = e
            through[rank] = {"entries": list(by_id.values()), "pg_config": {}, "reason": "write-through (no dump)",
                             "source": name}
            continue
        m = _TRAILING_RANK.search(name)
        if not m:
            continue
        try:
            with open(path, "rb") as f:
                data = pickle.load(f)
            entries, cfg = data.get("entries", []), data["pg_config"]  # torch leaves "entries" out when empty
            if data.get("ps_staged"):  # a CCL's inner calls (portspeed.comm.trace_staging): evidence only
                entries = sorted([*entries, *data["ps_staged"]], key=lambda e: e.get("record_id") or 0)
        except Exception as exc:
            raise Unreadable(f"{path}: not a flight-recorder dump ({type(exc).__name__}: {exc})") from None
        kind = "portspeed" if "ps_rank" in data else "torch"
        rank = int(data.get("ps_rank", m.group(1)))
        found.setdefault(kind, {})[rank] = {"entries": list(entries), "pg_config": dict(cfg), "source": name,
                                            "reason": data.get("ps_reason", "torch dump")}
    # one recorder's numbering for every rank where possible: portspeed's (it has the call sites) unless torch's
    # covers more ranks; a rank the chosen one lacks is read from the other, then from its write-through file
    mine, theirs = found.get("portspeed", {}), found.get("torch", {})
    first, second = (mine, theirs) if len(mine) >= len(theirs) else (theirs, mine)
    for rank in sorted(set(mine) | set(theirs)):
        d = first.get(rank) or second[rank]
        if rank in first and rank in second:
            d["reason"] += f" (also {second[rank]['source']}, not used)"
        dumps[rank] = d
    for rank, d in through.items():
        dumps.setdefault(rank, d)
    if not dumps:
        raise Unreadable(f"{folder!r} holds no flight-recorder dump (portspeed_trace_rank_<R>, torch's <prefix><R>, "
                         "or portspeed_last_calls_<R>.txt); was PORTSPEED_TRACE on?")
    return dumps


def through_entry(line: str) -> dict | None:
    """A write-through line (``portspeed.comm.trace.WRITE_THROUGH_FIELDS``) as a dump entry."""
    try:
        values = ast.literal_eval(line.strip())
        e = dict(zip(_THROUGH_FIELDS, values, strict=True))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    e["process_group"] = (e.pop("pg_name"), e.pop("pg_desc"))
    e["frames"] = [{"name": e.pop("frame_name"), "filename": e.pop("frame_filename"), "line": e.pop("frame_line")}]
    e["state"] = "issued (write-through)"
    return e
