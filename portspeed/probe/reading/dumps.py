"""Reading a probe dump (docs/probe-format.md): ``step<I>/rank<R>/dump.json`` folders into entries.

Why its own module: the comparison (`reading.compare`) and the pytest plugin read dumps on any
machine, so the reader needs the standard library alone (no torch, no msprobe, no device).

Contract: `read_dump(DIR)` returns a `ProbeDump`: every rank's run meta and its entries, each
entry's tensors flattened to `TensorStats` under a field name (``output.0``, ``input_args.1``,
``weight``; a backward entry's msprobe ``input`` -- the gradients of the module's outputs -- is
named ``output.<i>``, the phase saying it is a gradient). A missing folder, a folder that holds no
dump, a dump of another format and an empty dump are refused with `ProbeInputError`, one line
naming the folder and what to do. `merge` combines the statistics of a split tensor's parts exactly
(the format's rule for ``split``: max of maxes, min of mins, count-weighted means, root of summed
squares, NaN/Inf counts summed).

Limits: a dump written by msprobe itself (no ``portspeed`` meta, ``proc<pid>`` or ``rank<R>``
folders, ``step<N>`` counting its ``step()`` calls from 0) is read as a one-rank run of unknown
layout whose step N is iteration N + 1; its entries carry no micro-batch or layer, so they are
matched by key and kept in the file's order.

Example::

    dump = read_dump("probe-tp2")
    dump.meta["layout"]["tp"], len(dump.entries)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from portspeed.errors import PortspeedError

__all__ = ["ProbeInputError", "TensorStats", "Entry", "RankDump", "ProbeDump", "read_dump", "FORMAT", "VERSION",
           "PHASES", "STATISTICS", "Merged", "merge", "whole"]

#: the run meta's ``format`` and the ``version`` this reader understands
FORMAT, VERSION = "portspeed-probe", 1
#: the entry phases, in the order an iteration runs them
PHASES = ("forward", "backward", "parameters_grad", "parameters_updated")
#: the statistics an entry holds per tensor (msprobe's names)
STATISTICS = ("Max", "Min", "Mean", "Norm")

_STEP = re.compile(r"^step(\d+)$")
_RANK = re.compile(r"^(?:rank|proc)(\d+)$")
_MODULE_KEY = re.compile(r"^Module\.(?:(?P<path>.+)\.)?(?P<cls>[^.]+)\.(?P<phase>forward|backward|recompute|"
                         r"parameters_grad|parameters_updated)\.(?P<n>\d+)$")
_OP_KEY = re.compile(r"^(?P<api>Functional|Tensor|Torch|Distributed|Aten|NPU|VF)\.(?P<name>.+)\.(?P<c>\d+)\."
                     r"(?P<phase>forward|backward)$")


class ProbeInputError(PortspeedError, ValueError):
    """A probe dump is missing, empty, of another format, or cannot be compared with another."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorStats:
    """One tensor of an entry: msprobe's statistics (float64 in portspeed's dumps) and portspeed's counts."""

    dtype: str
    shape: tuple[int, ...]
    max: float | None
    min: float | None
    mean: float | None
    norm: float | None
    #: non-finite counts (None: not recorded, as in msprobe's own dumps)
    nan: int | None = None
    inf: int | None = None
    #: ``ps_layout``: full | split | partial | unknown, the groups it is spread over, the split dim per group
    layout: str = "unknown"
    groups: tuple[str, ...] = ()
    dims: tuple[tuple[str, int], ...] = ()
    #: a flat slice of a parameter (``ps_shard``: the distributed optimizer's part): only its element count is a shape
    flat: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def stat(self, name: str) -> float | None:
        """A statistic by msprobe's name (Max, Min, Mean, Norm)."""
        return {"Max": self.max, "Min": self.min, "Mean": self.mean, "Norm": self.norm}[name]


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One dump.json entry of one rank, with portspeed's ``ps_*`` keys (defaults where msprobe has none)."""

    key: str
    rank: int
    iteration: int
    micro_batch: int
    phase: str
    module: str
    cls: str
    layer: int | None
    seq: int
    chunk: int = 0
    op: str | None = None
    op_index: int | None = None
    call: int | None = None
    expert: int | None = None
    recompute: bool = False
    #: (field, statistics) in the entry's order: ``input_args.<i>``, ``input_kwargs.<name>``, ``output.<i>``, ``weight``
    tensors: tuple[tuple[str, TensorStats], ...] = ()


@dataclasses.dataclass(slots=True)
class RankDump:
    """One ``step<I>/rank<R>`` folder: the run meta, the entries, construct.json's parents."""

    path: Path
    iteration: int
    rank: int
    meta: dict[str, Any]
    entries: list[Entry]
    parents: dict[str, str | None]


@dataclasses.dataclass(slots=True)
class ProbeDump:
    """A dump folder: every (iteration, rank) read; ``meta`` is the first rank's run meta."""

    path: Path
    ranks: dict[tuple[int, int], RankDump]
    #: False for a dump written by msprobe itself (no ``portspeed`` meta)
    portspeed: bool = True
    #: the run meta's model block joined over the ranks (a field one rank cannot know is None there)
    model: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def meta(self) -> dict[str, Any]:
        return self.ranks[min(self.ranks)].meta

    @property
    def iterations(self) -> list[int]:
        return sorted({i for i, _ in self.ranks})

    @property
    def entries(self) -> Iterator[Entry]:
        for k in sorted(self.ranks):
            yield from self.ranks[k].entries


@dataclasses.dataclass(frozen=True, slots=True)
class Merged:
    """A tensor's statistics on the reference's layout: one rank's, or several ranks' parts combined."""

    dtype: str
    #: None where parts were joined without a known dim (the element count still counts)
    shape: tuple[int, ...] | None
    numel: int
    max: float | None
    min: float | None
    mean: float | None
    norm: float | None
    nan: int | None
    inf: int | None

    def stat(self, name: str) -> float | None:
        return {"Max": self.max, "Min": self.min, "Mean": self.mean, "Norm": self.norm}[name]


# ----------------------------------------------------------------------------- combining statistics

def merge(parts: Iterable[TensorStats | Merged], shape: tuple[int, ...] | None = None) -> Merged:
    """Statistics of the tensor made of ``parts`` (disjoint pieces of one tensor), combined exactly."""
    parts = list(parts)
    full = [p for p in parts if p.numel]
    n = sum(p.numel for p in parts)
    nan = None if any(p.nan is None for p in parts) else sum(p.nan for p in parts)
    inf = None if any(p.inf is None for p in parts) else sum(p.inf for p in parts)
    if not full:
        return Merged(parts[0].dtype, shape, n, None, None, None, None, nan, inf)
    maxes, mins = [p.max for p in full], [p.min for p in full]
    means, norms = [p.mean for p in full], [p.norm for p in full]
    mx = math.nan if any(_nan(x) for x in maxes) else max(maxes)
    mn = math.nan if any(_nan(x) for x in mins) else min(mins)
    mean = math.nan if any(_nan(x) for x in means) else _weighted_mean(means, [p.numel for p in full])
    norm = math.nan if any(_nan(x) for x in norms) else math.hypot(*norms)
    return Merged(full[0].dtype, shape, n, mx, mn, mean, norm, nan, inf)


def _weighted_mean(means: list[float | None], counts: list[int]) -> float:
    terms = [m * c for m, c in zip(means, counts)]
    if any(math.isinf(t) for t in terms):  # fsum refuses +inf + -inf; the mean of such a tensor is nan
        return sum(terms) / sum(counts)
    return math.fsum(terms) / sum(counts)


def _nan(x: float | None) -> bool:
    return x is None or math.isnan(x)


def whole(t: TensorStats) -> Merged:
    """One rank's tensor as it is (a flat shard's shape is only its element count)."""
    return Merged(t.dtype, None if t.flat else t.shape, t.numel, t.max, t.min, t.mean, t.norm, t.nan, t.inf)


# ----------------------------------------------------------------------------- reading

def read_dump(path: str | Path) -> ProbeDump:
    """Read every ``step<I>/rank<R>/dump.json`` under ``path``; refuse what is not a usable probe dump."""
    root = Path(path)
    if not root.exists():
        raise ProbeInputError(f"{root}: no such folder; give the DIR a run wrote with `portspeed run --probe DIR`")
    if not root.is_dir():
        raise ProbeInputError(f"{root}: not a folder; a probe dump is the DIR given to `portspeed run --probe DIR`")
    files = sorted((int(_STEP.match(s.name)[1]), int(_RANK.match(r.name)[1]), r / "dump.json")
                   for s in root.iterdir() if s.is_dir() and _STEP.match(s.name)
                   for r in s.iterdir() if r.is_dir() and _RANK.match(r.name) and (r / "dump.json").is_file())
    if not files:
        raise ProbeInputError(f"{root}: not a probe dump (no step<I>/rank<R>/dump.json under it); record one with "
                              "`portspeed run --probe DIR ...`")
    ranks: dict[tuple[int, int], RankDump] = {}
    kinds = set()
    for step, rank, f in files:
        rd = _read_rank(f, step, rank)
        kinds.add(bool(rd.meta))
        ranks[(rd.iteration, rd.rank)] = rd
    if len(kinds) > 1:
        raise ProbeInputError(f"{root}: mixes portspeed's dumps and msprobe's (some dump.json files have no "
                              "'portspeed' meta); give one run's folder")
    if not any(rd.entries for rd in ranks.values()):
        raise ProbeInputError(f"{root}: an empty dump ({len(files)} dump.json file(s), no entry); check "
                              "--probe-iterations / --probe-ranks / --probe-modules of the run that wrote it")
    dump = ProbeDump(root, ranks, portspeed=kinds == {True})
    if dump.portspeed:
        _check_consistent(dump)
    return dump


def _read_rank(f: Path, step: int, rank: int) -> RankDump:
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise ProbeInputError(f"{f}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise ProbeInputError(f"{f}: not JSON ({e}); the run that wrote it may have died while writing") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise ProbeInputError(f"{f}: not a probe dump.json (no 'data' object); record with `portspeed run --probe DIR`")
    meta = doc.get("portspeed")
    if meta is None:  # msprobe's own dump: its step N is iteration N + 1, one rank of unknown layout
        meta, iteration = {}, step + 1
    else:
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ProbeInputError(f"{f}: its 'portspeed' meta is not format {FORMAT!r}; not a portspeed probe dump")
        if meta.get("version") != VERSION:
            raise ProbeInputError(f"{f}: probe format version {meta.get('version')!r}, this portspeed reads "
                                  f"version {VERSION}; read it with the portspeed release that wrote it")
        iteration = step
    parents = _read_parents(f.parent / "construct.json")
    entries = []
    for seq, (key, raw) in enumerate(doc["data"].items()):
        if not isinstance(raw, dict):
            raise ProbeInputError(f"{f}: entry {key!r} is not an object")
        entries.append(_entry(key, raw, rank, iteration, seq, parents, f))
    return RankDump(f.parent, iteration, rank, meta, entries, parents)


def _read_parents(f: Path) -> dict[str, str | None]:
    if not f.is_file():
        return {}
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProbeInputError(f"{f}: cannot read construct.json ({e})") from None
    return doc if isinstance(doc, dict) else {}


def _entry(key: str, raw: dict[str, Any], rank: int, iteration: int, seq: int,
           parents: dict[str, str | None], f: Path) -> Entry:
    if isinstance(raw.get("ps"), dict):  # portspeed's keys nested in one field (msprobe's compare iterates the rest)
        raw = {**{k: v for k, v in raw.items() if k != "ps"},
               **{(k if k.startswith("ps_") else f"ps_{k}"): v for k, v in raw["ps"].items()}}
    m = _MODULE_KEY.match(key)
    o = None if m else _OP_KEY.match(key)
    if m:
        module, cls, phase = m["path"] or "", m["cls"], m["phase"]
        call = int(m["n"])
        op = None
    elif o:
        parent = parents.get(key)
        pm = _MODULE_KEY.match(parent) if isinstance(parent, str) else None
        module, cls = (pm["path"] or "", pm["cls"]) if pm else ("", "")
        phase, op, call = o["phase"], f"{o['api']}.{o['name']}", None
    else:
        module, cls, phase, op, call = key, "", "forward", None, None
    tensors: list[tuple[str, TensorStats]] = []
    try:
        if phase in ("parameters_grad", "parameters_updated") or raw.get("ps_phase") in (
                "parameters_grad", "parameters_updated"):
            for name, v in raw.items():
                if not name.startswith("ps_"):  # msprobe's {"weight": [tensor]}: named "weight"
                    _flatten(name, v[0] if isinstance(v, list) and len(v) == 1 else v, tensors)
        else:
            grad = phase == "backward"
            for field in ("input_args", "input_kwargs", "input", "output"):
                if field in raw:
                    name = "output" if grad and field == "input" else field
                    if grad and field == "output":
                        continue  # gradients of a module's inputs: partial sums across TP, not recorded
                    _flatten(name, raw[field], tensors)
    except (TypeError, ValueError, KeyError) as e:
        raise ProbeInputError(f"{f}: entry {key!r} has a malformed tensor ({e})") from None
    return Entry(
        key=key, rank=rank, iteration=int(raw.get("ps_iteration", iteration)),
        micro_batch=int(raw.get("ps_micro_batch", 0 if phase in ("forward", "backward") else -1)),
        phase=str(raw.get("ps_phase") or phase), module=str(raw.get("ps_module") or module),
        cls=str(raw.get("ps_class") or cls), layer=_opt_int(raw.get("ps_layer")), seq=int(raw.get("ps_seq", seq)),
        chunk=int(raw.get("ps_chunk") or 0), op=raw.get("ps_op") or op, op_index=_opt_int(raw.get("ps_op_index")),
        call=_opt_int(raw.get("ps_call", call)), expert=_opt_int(raw.get("ps_expert")),
        recompute=bool(raw.get("ps_recompute", False)), tensors=tuple(tensors))


def _flatten(name: str, v: Any, out: list[tuple[str, TensorStats]]) -> None:
    if isinstance(v, list):
        for i, x in enumerate(v):
            _flatten(f"{name}.{i}", x, out)
    elif isinstance(v, dict) and "shape" in v and "Max" in v:
        out.append((name, _tensor(v)))
    elif isinstance(v, dict) and "type" not in v:  # kwargs, or a dict output
        for k, x in v.items():
            _flatten(f"{name}.{k}", x, out)


def _tensor(v: dict[str, Any]) -> TensorStats:
    lay = v.get("ps_layout") or {}
    groups = tuple(str(g) for g in lay.get("groups", ()))
    dims = lay.get("dims")
    if isinstance(dims, dict):
        dims = tuple((str(g), int(d)) for g, d in dims.items())
    else:  # one "dim" for every group
        dims = () if lay.get("dim") is None else tuple((g, int(lay["dim"])) for g in groups)
    return TensorStats(
        dtype=str(v.get("dtype", "")), shape=tuple(int(s) for s in v["shape"]),
        max=_num(v["Max"]), min=_num(v["Min"]), mean=_num(v.get("Mean")), norm=_num(v.get("Norm")),
        nan=_opt_int(v.get("ps_nan")), inf=_opt_int(v.get("ps_inf")),
        layout=str(lay.get("kind", "unknown")), groups=groups, dims=dims, flat="ps_shard" in v)


def _num(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, str):  # msprobe may write "nan" / "inf" as text
        return float(x.strip().lower().replace("infinity", "inf"))
    if isinstance(x, bool):
        raise TypeError(f"statistic {x!r} is not a number")
    return float(x)


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _check_consistent(dump: ProbeDump) -> None:
    """Every rank of one dump describes the same run (model, layout, releases); a model field a rank cannot know
    (None: the vocabulary on a pipeline stage without the embedding) is taken from the ranks that know it."""
    first = dump.meta
    for (it, rank), rd in sorted(dump.ranks.items()):
        for field in ("layout", "releases", "level", "dtype", "global_batch_size"):
            if rd.meta.get(field) != first.get(field):
                _one_run(rd, field, rd.meta.get(field), first.get(field))
    model: dict[str, Any] = {}
    for rd in dump.ranks.values():
        for k, v in (rd.meta.get("model") or {}).items():
            if v is not None and model.get(k) not in (None, v):
                _one_run(rd, f"model {k}", v, model[k])
            if v is not None or k not in model:
                model[k] = v
    dump.model = model


def _one_run(rd: RankDump, field: str, value: Any, other: Any) -> None:
    raise ProbeInputError(f"{rd.path}: its meta {field!r} is {value!r} but another rank's is {other!r}; a dump "
                          "folder holds one run, give each run its own --probe DIR")
