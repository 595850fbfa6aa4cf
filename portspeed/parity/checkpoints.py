"""Checkpoint directories: which one a ``--load DIR`` means, refused clearly when missing, truncated or foreign.

Why: ``megatron.core.dist_checkpointing.load`` on a bad directory fails inside a collective,
on every rank, with a traceback about a key or a pickle; a resume that silently starts from
scratch is worse. The example trainers (``examples/pretrain_gpt.py``, ``generate_gpt.py``)
call ``resolve(DIR)`` on every rank before any process group exists, so a bad directory
costs one line and exit code 2 (``CheckpointError`` is a ``PortspeedError``).

Layout, as Megatron-LM's: ``DIR/latest_checkpointed_iteration.txt`` (the tracker) names
the last *complete* checkpoint ``DIR/iter_0000005``; each one is a ``torch_dist`` directory
(Megatron's ``metadata.json`` plus torch.distributed.checkpoint's ``.metadata`` and
``*.distcp`` shards). ``DIR`` may also be one such directory itself (a final ``--save``).
``write_tracker`` replaces the tracker atomically, and only after every rank finished its
shards, so a rank killed in the middle of writing checkpoint N leaves the tracker on N-1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from portspeed.errors import PortspeedError

__all__ = ["TRACKER", "CheckpointError", "iteration_dir", "resolve", "check_complete", "read_tracker", "write_tracker"]

#: Megatron-LM's tracker file name
TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(PortspeedError, ValueError):
    """A checkpoint directory that is missing, incomplete (truncated) or in a format this tool does not read."""


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """``root/iter_0000005`` for iteration 5 (Megatron-LM's naming)."""
    return Path(root) / f"iter_{int(iteration):07d}"


def read_tracker(root: str | os.PathLike) -> int | None:
    """The iteration the tracker in ``root`` names (None when there is no tracker); CheckpointError if unreadable."""
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number; it is damaged: delete it "
                              "to start over, or write the number of the last complete iter_* directory into it")
    return int(text)


def write_tracker(root: str | os.PathLike, iteration: int) -> None:
    """Point the tracker at ``iteration`` atomically (a temporary file renamed over the old one)."""
    path = Path(root) / TRACKER
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(f"{int(iteration)}\n")
    os.replace(tmp, path)


def _foreign(path: Path) -> str | None:
    """What format ``path`` is in, when it is a known format other than torch_dist."""
    if (path / "latest").is_file() or any(p.name.startswith("global_step") for p in path.iterdir()):
        return "a DeepSpeed checkpoint (latest / global_step*)"
    if any(p.name.startswith("mp_rank_") for p in path.iterdir()):
        return "a Megatron-LM checkpoint in the legacy 'torch' format (mp_rank_*/model_optim_rng.pt)"
    return None


def check_complete(path: str | os.PathLike) -> None:
    """Raise CheckpointError unless ``path`` is a whole torch_dist checkpoint (each shard its metadata names, whole)."""
    path = Path(path)
    meta = path / "metadata.json"
    if not meta.is_file():
        if any(p.suffix == ".distcp" for p in path.iterdir()):
            raise CheckpointError(f"{path} is incomplete: shards but no metadata.json (the save did not finish); "
                                  f"resume from the directory the tracker {TRACKER} names instead")
        foreign = _foreign(path)
        if foreign:
            raise CheckpointError(f"{path} is {foreign}; this tool reads Megatron's 'torch_dist' format "
                                  "(metadata.json, .metadata, *.distcp): convert it, or save it again with this tool")
        raise CheckpointError(f"{path} is not a checkpoint: it has neither {TRACKER} nor metadata.json "
                              "(give the --save directory of an earlier run)")
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except (ValueError, AttributeError):
        raise CheckpointError(f"{meta} is not valid JSON: the checkpoint is damaged") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{path} is a {backend!r} dist checkpoint; this tool reads 'torch_dist' only")
    dcp_meta = path / ".metadata"
    if not dcp_meta.is_file():
        raise CheckpointError(f"{path} is incomplete: no .metadata (the save did not finish); resume from the "
                              f"directory the tracker {TRACKER} names instead")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as exc:  # a truncated pickle: EOFError, UnpicklingError, ...
        raise CheckpointError(
            f"{dcp_meta} cannot be read ({type(exc).__name__}): the checkpoint is truncated") from None
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        shard = path / rel
        have = shard.stat().st_size if shard.is_file() else -1
        if have < size:
            what = "missing" if have < 0 else f"truncated ({have} of {size} bytes)"
            raise CheckpointError(f"{path} is incomplete: shard {rel} is {what}; resume from the directory the "
                                  f"tracker {TRACKER} names, or save again")


def resolve(path: str | os.PathLike) -> tuple[Path, int | None]:
    """The complete checkpoint ``--load path`` means and the iteration the tracker gives (None: a bare checkpoint)."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist (check the --load path)")
    if not root.is_dir():
        raise CheckpointError(f"{str(path)!r} is a file, not a checkpoint directory")
    iteration = read_tracker(root)
    if iteration is None:
        check_complete(root)
        return root, None
    chosen = iteration_dir(root, iteration)
    if not chosen.is_dir():
        raise CheckpointError(f"{root / TRACKER} names iteration {iteration}, but {chosen.name} is missing")
    check_complete(chosen)
    return chosen, iteration
