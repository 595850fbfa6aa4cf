"""What a flight-recorder entry holds, spelled as torch's dumps spell it, and the hot path's first-seen caches.

Why a module of its own: ``portspeed.trace.flight_recorder`` (the recorder) builds one entry per call on
the hot path; this is its vocabulary: the write-through line's fields and its definition
(``write_through_line``), the op table (``OPS``: where each ``torch.distributed`` function keeps its
tensors, group and peer), c10 dtype names, and the caches that let an entry for a call seen before
be built by lookups (``callers`` walks the caller frames through them; issue 25 measured the cold
rebuild at ~42 µs a call inside a training step: docs/benchmarks.md, "Recording"). The file
names are ``portspeed.trace.files``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["OPS", "Op", "WRITE_THROUGH_FIELDS", "VERSION", "callers", "write_through_line"]

#: the fields of a write-through line, in order (frame_*: the caller's frame)
WRITE_THROUGH_FIELDS = ("record_id", "pg_name", "pg_desc", "collective_seq_id", "p2p_seq_id", "profiling_name",
                        "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "time_created_ns", "is_p2p",
                        "ps_peer", "ps_ranks", "ps_op", "frame_name", "frame_filename", "frame_line")
#: the dump format's version (torch 2.13's flight recorder writes "2.10")
VERSION = "2.10"


class Op(NamedTuple):
    """Where a ``torch.distributed`` function keeps its tensors, group and peer (-1: none), and torch's name for it."""

    input_pos: int
    input_kw: str
    output_pos: int
    output_kw: str
    group_pos: int
    peer_pos: int
    peer_kw: str
    fr_name: str  # the flight recorder's op name


#: name -> where its arguments are (rows as Op's fields, in order)
OPS: dict[str, Op] = {k: Op(*v) for k, v in {
    "all_reduce": (0, "tensor", 0, "tensor", 2, -1, "", "all_reduce"),
    "reduce": (0, "tensor", 0, "tensor", 3, -1, "", "reduce"),
    "reduce_scatter_tensor": (1, "input", 0, "output", 3, -1, "", "_reduce_scatter_base"),
    "reduce_scatter_single": (1, "input", 0, "output", 3, -1, "", "_reduce_scatter_base"),
    "reduce_scatter": (1, "input_list", 0, "output", 3, -1, "", "reduce_scatter"),
    "all_to_all": (1, "input_tensor_list", 0, "output_tensor_list", 2, -1, "", "all_to_all"),
    "all_gather_into_tensor": (1, "input_tensor", 0, "output_tensor", 2, -1, "", "_all_gather_base"),
    "all_gather_single": (1, "input_tensor", 0, "output_tensor", 2, -1, "", "_all_gather_base"),
    "broadcast": (0, "tensor", 0, "tensor", 2, -1, "", "broadcast"),
    "barrier": (-1, "", -1, "", 0, -1, "", "barrier"),
    "all_gather": (1, "tensor", 0, "tensor_list", 2, -1, "", "all_gather"),
    "gather": (0, "tensor", 1, "gather_list", 3, -1, "", "gather"),
    "scatter": (1, "scatter_list", 0, "tensor", 3, -1, "", "scatter"),
    "all_to_all_single": (1, "input", 0, "output", 4, -1, "", "all_to_all_single"),
    "send": (0, "tensor", 0, "tensor", 2, 1, "dst", "send"),  # p2p: torch records the tensor as both
    "isend": (0, "tensor", 0, "tensor", 2, 1, "dst", "send"),
    "recv": (0, "tensor", 0, "tensor", 2, 1, "src", "recv"),
    "irecv": (0, "tensor", 0, "tensor", 2, 1, "src", "recv"),
}.items()}

#: c10 scalar type names, as torch's dumps spell dtypes
_DTYPES = {"float32": "Float", "float16": "Half", "bfloat16": "BFloat16", "float64": "Double", "int64": "Long",
           "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool"}
_FRAMES = 4  # caller frames kept per entry


#: first-seen caches for the hot path (issue 25): a dtype's c10 name and a device's string, by the object itself
_DT_NAMES: dict = {}
_DEV_NAMES: dict = {}
#: the caller frames already seen: (id(code), f_lasti) -> (code, frame dict, repr of (name, filename, line)); the
#: code is kept to tell a reused id apart. Entries share the frame dicts (read-only). Cleared past _SITES_MAX.
_SITES: dict = {}
_SITES_MAX = 4096
#: one tensor in and out (the usual call): (shape, dtype, device) -> ([sizes], [dtype name], device name, the
#: write-through repr of (input sizes, input dtypes, output sizes, output dtypes)); entries share the lists
_META: dict = {}


def _dtype_name(dt: Any) -> str:
    name = _DT_NAMES.get(dt)
    if name is None:
        s = str(dt)
        name = _DT_NAMES[dt] = _DTYPES.get(s[6:], s)
    return name


def _sizes(x: Any) -> tuple[list, list]:
    if x is None:
        return [], []
    if isinstance(x, (list, tuple)):
        return [list(t.shape) for t in x], [_DT_NAMES.get(t.dtype) or _dtype_name(t.dtype) for t in x]
    return [list(x.shape)], [_DT_NAMES.get(x.dtype) or _dtype_name(x.dtype)]


def _device(x: Any) -> str:
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    d = getattr(x, "device", None) if x is not None else None
    if d is None:
        return "" if x is None or not hasattr(x, "device") else "None"
    try:
        name = _DEV_NAMES.get(d)
        if name is None:
            name = _DEV_NAMES[d] = str(d)
        return name
    except TypeError:  # not hashable: not a torch.device
        return str(d)


def _meta(x: Any) -> tuple:
    """A tensor's (shape, dtype, device) seen for the first time (see ``_META``)."""
    if len(_META) >= _SITES_MAX:
        _META.clear()
    ins, idt = _sizes(x)
    m = _META[(x.shape, x.dtype, x.device)] = (ins, idt, _device(x), f"{ins!r}, {idt!r}, {ins!r}, {idt!r}")
    return m


def _site(code: Any, f: Any) -> tuple:
    """A caller frame seen for the first time: its dict (as entries carry it) and its write-through repr."""
    if len(_SITES) >= _SITES_MAX:
        _SITES.clear()
    frame = {"name": code.co_name, "filename": code.co_filename, "line": f.f_lineno}
    site = _SITES[(id(code), f.f_lasti)] = (code, frame, ", ".join(map(repr, frame.values())))
    return site



def callers(f: Any, torch_dir: str) -> tuple[list, str, tuple | None]:
    """The caller frames from ``f`` up, past ``torch_dir`` (``torch.distributed``'s folder: all_gather_object & co
    call the recorded functions); the function there that made the call ("" if none); the first frame's site row."""
    frames, via = [], ""
    while f is not None and f.f_code.co_filename.startswith(torch_dir):
        if f.f_code.co_name not in ("wrapper", "_fn"):  # torch's logging / compile decorators
            via = f.f_code.co_name
        f = f.f_back
    site = None
    while f is not None and len(frames) < _FRAMES:
        code = f.f_code
        s = _SITES.get((id(code), f.f_lasti))
        if s is None or s[0] is not code:
            s = _site(code, f)
        if site is None:
            site = s
        frames.append(s[1])
        f = f.f_back
    return frames, via, site

def write_through_line(e: dict) -> str:
    """An entry's write-through line, by definition: the repr of its ``WRITE_THROUGH_FIELDS`` tuple (repr is C-fast,
    json is not). ``Recorder.issue`` builds the same line from its caches; tests hold it to this one."""
    f = e["frames"][0] if e["frames"] else {"name": "?", "filename": "?", "line": 0}
    pg = e["process_group"]
    return repr((e["record_id"], pg[0], pg[1], e["collective_seq_id"], e["p2p_seq_id"], e["profiling_name"],
                 e["input_sizes"], e["input_dtypes"], e["output_sizes"], e["output_dtypes"], e["time_created_ns"],
                 e["is_p2p"], e["ps_peer"], e["ps_ranks"], e["ps_op"], f["name"], f["filename"], f["line"]))
