"""Reading flight-recorder dumps: portspeed's, torch's and the write-through files, as one entry format.

Why apart from ``why_hung``: reading is the part that knows file names, formats and how a rank that
died hard is still read (its write-through file); the diagnosis reads only entries. No torch needed.

On torch >= 2.15 a portspeed dump names the groups whose calls torch recorded (``ps_torch_records``):
that rank's entries are portspeed's and torch's together (Gloo's dump, the hooked backend's), each call
once, or portspeed's and its write-through file's when the rank ended before torch's dump was written.
"""

from __future__ import annotations

import ast
import os
import pickle
import re

__all__ = ["Unreadable", "load", "through_entry", "op_name", "call_site", "ranks_of"]

_TRAILING_RANK = re.compile(r"(\d+)$")
#: portspeed.trace.flight_recorder.WRITE_THROUGH_FIELDS (not imported: reading dumps needs no torch)
_THROUGH_FIELDS = ("record_id", "pg_name", "pg_desc", "collective_seq_id", "p2p_seq_id", "profiling_name",
                   "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "time_created_ns", "is_p2p",
                   "ps_peer", "ps_ranks", "ps_op", "frame_name", "frame_filename", "frame_line")


class Unreadable(Exception):
    """The folder or a dump in it cannot be read."""



def op_name(e: dict) -> str:
    name = str(e.get("profiling_name", "?"))
    return name.split(":", 1)[-1].split(" ")[0]


#: frames that are not the call site: torch's own distributed code (its *_object collectives, its logger
#: wrapper: torch's recorder keeps them, innermost first) and portspeed's wrappers (the router's in comm/, the
#: recorder's in trace/)
_PLUMBING = re.compile(r"[/\\](torch[/\\]distributed|portspeed[/\\](comm|trace)|wrapt|torch[/\\]_library)[/\\]"
                       r"|[/\\]patches[/\\]torch_distributed\.py$|[/\\]torch[/\\]_ops\.py$")


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
            if data.get("ps_staged"):  # a CCL's inner calls (portspeed.trace.staging): evidence only
                entries = sorted([*entries, *data["ps_staged"]], key=lambda e: e.get("record_id") or 0)
        except Exception as exc:
            raise Unreadable(f"{path}: not a flight-recorder dump ({type(exc).__name__}: {exc})") from None
        kind = "portspeed" if "ps_rank" in data else "torch"
        rank = int(data.get("ps_rank", m.group(1)))
        d = {"entries": list(entries), "pg_config": dict(cfg), "source": name,
             "reason": data.get("ps_reason", "torch dump")}
        if kind == "portspeed" and "ps_torch_records" in data:  # torch >= 2.15: torch's dumps hold some of its calls
            d["torch_records"] = data["ps_torch_records"]
        if kind == "torch" and rank in found.get("torch", {}):  # one rank, several of torch's recorders (Gloo's...)
            _join(found["torch"][rank], d)
            continue
        found.setdefault(kind, {})[rank] = d
    # one recorder's numbering for every rank where possible: portspeed's (it has the call sites) unless torch's
    # covers more ranks; a rank the chosen one lacks is read from the other, then from its write-through file
    mine, theirs = found.get("portspeed", {}), found.get("torch", {})
    for rank, d in mine.items():  # torch >= 2.15: the calls torch recorded are read from its dumps, beside these
        if "torch_records" in d:
            _merge_torch(d, theirs.pop(rank, None) or through.get(rank))
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


def _join(into: dict, more: dict) -> None:
    """Add another of torch's dumps of the same rank (another backend's recorder) to ``into``."""
    into["entries"] += more["entries"]
    into["pg_config"] = {**more["pg_config"], **into["pg_config"]}
    into["source"] += f" + {more['source']}"


def _merge_torch(mine: dict, torch_dump: dict | None) -> None:
    """portspeed's dump of a rank on torch >= 2.15 with that rank's torch dumps: one list of entries, no call twice.

    portspeed left out what torch recorded, except a call that raised (``ps_torch``): kept unless torch's dump has
    it too (Gloo refuses some calls before recording them), its error then copied onto torch's entry. torch's
    entries get the group's ranks from portspeed's table; an unnamed group (a CCL's inner Gloo group, made outside
    torch.distributed's API) is marked staging: evidence, never the cause; Gloo's names are torch's other
    recorders' (``_gloo_names``)."""
    if torch_dump is None:
        mine["reason"] += " (torch's dump of the calls it recorded missing, and no write-through file)"
        return
    if torch_dump["source"].endswith(".txt"):  # the rank ended before torch's dump: its write-through file has them
        torch_dump = dict(torch_dump, entries=[e for e in torch_dump["entries"]
                                               if _wt_torch(e, mine.get("torch_records", {}))])
    cfg = mine["pg_config"]

    def key(e: dict) -> tuple:
        group = tuple((e.get("process_group") or ("?", ""))[:2])
        return group, bool(e.get("is_p2p")), e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id")

    raised = {key(e): e for e in mine["entries"] if e.get("ps_torch")}
    entries = []
    for e in torch_dump["entries"]:
        e = _gloo_names(dict(e))
        if not e["process_group"][0]:
            e["ps_staging"] = "torch"
        e.setdefault("ps_ranks", ranks_of(cfg, e["process_group"][0]) or ranks_of(torch_dump["pg_config"],
                                                                                   e["process_group"][0]))
        ours = raised.pop(key(e), None)
        if ours is not None and "ps_error" in ours:
            e["ps_error"] = ours["ps_error"]
        entries.append(e)
    kept = [e for e in mine["entries"] if not e.get("ps_torch") or key(e) in raised]
    mine["entries"] = sorted(kept + entries, key=lambda e: e.get("time_created_ns") or 0)
    mine["pg_config"] = {**torch_dump["pg_config"], **cfg}
    mine["reason"] += f" (with {torch_dump['source']})"


def _wt_torch(e: dict, records: dict) -> bool:
    """Whether a write-through entry is one of the calls torch recorded (``ps_torch_records``: group -> kinds)."""
    kinds = records.get(str((e.get("process_group") or ("?",))[0]), [])
    return ("p2p" if e.get("is_p2p") else "collectives") in kinds


#: torch.distributed / funcol functions that reach Gloo's ``_allgather_base`` / ``_reduce_scatter_base``
_BASE_CALLS = {"all_gather": ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather_tensor"),
               "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base")}


def _gloo_names(e: dict) -> dict:
    """torch 2.15's Gloo recorder files ``_allgather_base`` as ``all_gather`` (its output as the list of chunks) and
    ``_reduce_scatter_base`` as ``reduce_scatter``, where NCCL's recorder, torch's hook and portspeed name them
    ``_all_gather_base`` / ``_reduce_scatter_base`` with the flat tensor; the torch function in the entry's frames
    tells them apart, so every recorder's entries read alike."""
    backend, _, op = str(e.get("profiling_name", "")).partition(":")
    if backend != "gloo" or op not in _BASE_CALLS:
        return e
    called = [f.get("name") for f in e.get("frames") or [] if re.search(r"[/\\]torch[/\\]distributed[/\\]",
                                                                          str(f.get("filename", "")))]
    if not any(c in _BASE_CALLS[op] for c in called):
        return e
    e["profiling_name"] = f"gloo:_{op}_base"
    side = "output_sizes" if op == "all_gather" else "input_sizes"
    sizes = e.get(side) or []
    if len(sizes) == 1 and len(sizes[0]) >= 2:  # [world, *chunk] -> [world * chunk[0], *chunk[1:]]
        e[side] = [[sizes[0][0] * sizes[0][1], *sizes[0][2:]]]
    return e


def through_entry(line: str) -> dict | None:
    """A write-through line (``portspeed.trace.flight_recorder.WRITE_THROUGH_FIELDS``) as a dump entry."""
    try:
        values = ast.literal_eval(line.strip())
        e = dict(zip(_THROUGH_FIELDS, values, strict=True))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    e["process_group"] = (e.pop("pg_name"), e.pop("pg_desc"))
    e["frames"] = [{"name": e.pop("frame_name"), "filename": e.pop("frame_filename"), "line": e.pop("frame_line")}]
    e["state"] = "issued (write-through)"
    return e
