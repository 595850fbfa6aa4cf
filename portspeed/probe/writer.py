"""The dump files of one iteration on one rank, in msprobe's layout (docs/probe-format.md).

``DIR/step<I>/rank<R>/``: ``dump.json`` (msprobe's header, portspeed's run meta under
``"portspeed"``, the entries under ``"data"``, each with portspeed's keys in its ``ps`` field), ``construct.json`` (each
key -> its parent module call's key, or null), ``stack.json`` (msprobe's ``{"<i>": [[keys], [frames]]}``: the call site
of each module's first call) and, with ``--probe-tensors``, ``tensors/<key>.<field>.<i>.pt``. Each file
is written to a temporary name and renamed, so a reader never sees half a file, compactly (no indentation:
json's C encoder, a third of the disk). Statistics that
are not finite are written as ``NaN`` / ``Infinity`` (Python's json, which msprobe reads too).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

__all__ = ["step_folder", "write_dump", "existing_dumps", "nest", "LEVELS"]

#: --probe-level -> msprobe's level name
LEVELS = {"module": "L0", "op": "mix"}


def nest(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as written: msprobe's fields as they are, portspeed's ``ps_*`` keys in one ``ps`` field without
    the prefix (msprobe's compare takes every other field of an entry for tensors and fails on a number)."""
    out: dict[str, Any] = {}
    ps: dict[str, Any] = {}
    for k, v in entry.items():
        if k.startswith("ps_"):
            ps[k[3:]] = v
        else:
            out[k] = v
    out["ps"] = ps
    return out


def step_folder(root: str, iteration: int, rank: int) -> str:
    """``root/step<iteration>/rank<rank>``."""
    return os.path.join(root, f"step{iteration}", f"rank{rank}")


def existing_dumps(root: str, rank: int | None = None) -> list[str]:
    """The dump.json files already under ``root`` (of one rank, or of any)."""
    who = "rank*" if rank is None else f"rank{rank}"
    return sorted(glob.glob(os.path.join(glob.escape(root), "step*", who, "dump.json")))


def _write_json(path: str, value: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    text = json.dumps(value, separators=(",", ":"))  # json.dumps, not json.dump: only it takes the C encoder
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_dump(root: str, iteration: int, rank: int, *, level: str, meta: dict[str, Any],
               entries: dict[str, dict[str, Any]], construct: dict[str, str | None],
               stacks: dict[tuple[str, ...], list[str]], tensor_files: bool) -> str:
    """Write the three files (the tensors are written by the caller into ``<folder>/tensors``); the folder."""
    folder = step_folder(root, iteration, rank)
    os.makedirs(folder, exist_ok=True)
    tensors = os.path.join(folder, "tensors")
    dump = {"task": "statistics", "level": LEVELS[level], "framework": "pytorch",
            "dump_data_dir": tensors if tensor_files else None, "portspeed": meta,
            "data": {key: nest(entry) for key, entry in entries.items()}}
    _write_json(os.path.join(folder, "dump.json"), dump)
    _write_json(os.path.join(folder, "construct.json"), {k: construct.get(k) for k in entries})
    _write_json(os.path.join(folder, "stack.json"),
                {str(i): [keys, list(frames)] for i, (frames, keys) in enumerate(stacks.items())})
    return folder
