"""What a flight-recorder entry holds, spelled as torch's dumps spell it, and the hot path's first-seen caches.

Why a module of its own: ``portspeed.comm.trace`` (the recorder) builds one entry per call on
the hot path; this is its vocabulary: the write-through line's fields, the op table (where
each ``torch.distributed`` function keeps its tensors, group and peer), c10 dtype names, and the
caches that let an entry for a call seen before be built by lookups (issue 25 measured the
cold rebuild at ~42 µs a call inside a training step: docs/benchmarks.md, "Recording"). The file
names are ``portspeed.comm.trace_files``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OPS", "WRITE_THROUGH_FIELDS", "VERSION"]

#: the fields of a write-through line, in order (frame_*: the caller's frame)
WRITE_THROUGH_FIELDS = ("record_id", "pg_name", "pg_desc", "collective_seq_id", "p2p_seq_id", "profiling_name",
                        "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "time_created_ns", "is_p2p",
                        "ps_peer", "ps_ranks", "ps_op", "frame_name", "frame_filename", "frame_line")
#: the dump format's version (torch 2.13's flight recorder writes "2.10")
VERSION = "2.10"

# name -> (input position, input keyword, output position, output keyword, group position,
#          peer position, peer keyword, flight-recorder op name); -1: none
OPS: dict[str, tuple[int, str, int, str, int, int, str, str]] = {
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
}

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
