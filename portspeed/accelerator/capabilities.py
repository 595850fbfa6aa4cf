"""Collective capability records: what a backend lacks or gets wrong, and torch's own backends' tables.

Contract
- ``Capabilities`` is a frozen record of ``Gap`` entries: a (collective, reduce op, dtype)
  combination the backend either **raises** on or silently computes **wrong**. Anything
  not listed is taken to work, and the router sends it straight through.
  ``Capabilities.gap(collective, op, dtype)`` answers for one call (a dict lookup and a
  short loop; the router resolves one record per group and caches it).
- ``BackendGaps`` (``backend_gaps``, still importable from here) is how an adapter says what
  its own collective library lacks, in a few lines (``Accelerator.backend_gaps``);
  ``BackendGaps.capabilities(backend)`` turns it into a record. The router asks the active
  adapter (``Accelerator.capabilities(backend)``), never this module, for a group's record.
- ``capabilities_for(backend, torch_version=None)`` holds the defaults the base adapter
  returns: the tables of torch's own backends, Gloo by torch release and NCCL (no gaps).
  Any other name gets an empty record with a note, so its calls go straight through
  unless its adapter declares gaps.
- Collective names are torch.distributed's public function names (``all_reduce``,
  ``reduce_scatter_tensor``, ``all_to_all``...). Ops are ``ReduceOp.RedOpType`` members.
- One gap is about shapes, not ops or dtypes: ``all_gather_into_tensor`` (any op, any
  dtype) means the backend wants each dim-0 chunk of the output shaped as the input
  (Gloo: ``at::chunk(output, world)``, then every chunk must have the input's sizes), where
  NCCL only counts elements. The router looks at the shapes of such a call and views a
  flat or stacked output as chunks; a chunk-shaped call still goes straight through.
  Adapters declare it with ``BackendGaps(chunk_shaped_all_gather=True)``.

Sources: the Gloo table was value-checked on torch 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0,
2.11.0, 2.12.0 and 2.13.0 with 2-3 ranks (docs/reference notes, pytorch#149781 and
#149869); the all_gather_into_tensor shape row was run on torch 2.13.0 only (2 ranks on
127.0.0.1: flat, stacked and 0-d cases raise), and read, not run, in the 2.7.1 source
(``ProcessGroupGloo::_allgather_base``, the same chunk-and-compare code), so it is listed
for every release. torch 2.14.1 (2026-11-26, CPU, 2 and 3 ranks; on Python 3.11, and on 3.12 as
CI's leg 2 installs it): the collective
conformance (``--declared-gaps``) gives the 2.13 row, no more and no less: PREMUL_SUM and
the flat all_gather_into_tensor output raise raw, every other op and dtype matches the
reference straight through (docs/benchmarks.md, "Gloo on torch 2.14.1"); torch 2.15.0 (2026-11-27,
CPU, 2 and 3 ranks, Python 3.12, CI's leg 2: `portspeed conformance --adapter cpu --suites collectives
--declared-gaps`) gives the same row again (docs/benchmarks.md, "Gloo on torch 2.15.0"). PREMUL_SUM
(2026-11-26, 2 ranks, value-checked): raises on all_reduce and reduce in 2.6.0, 2.8.0 and
2.13.0; reduce_scatter_tensor ignores it and sums on 2.6.0 and 2.8.0 (a 'wrong' row, as for
AVG/MAX), and so does the list reduce_scatter on 2.8.0. Its factor is readable on every
release run (``ReduceOp.factor`` where it exists, the op's ``(type, factor)`` pickling state on
2.6.0, 2.8.0 and 2.11.0, which have no ``factor``), so the router rewrites it there too; the
collective conformance passes on 2.6.0, 2.8.0, 2.11.0 and 2.13.0 with these rows.
Vendor declarations live in the vendor adapters (``portspeed.adapters``).
Torch versions outside 2.6-2.15 use the nearest checked row, and the record's notes say so.

Example::

    caps = capabilities_for("gloo", torch_version="2.7.1")
    caps.gap("all_reduce", dist.ReduceOp.AVG, torch.float32).effect   # 'raises'
    caps.gap("all_gather_into_tensor", None, torch.float32).effect   # 'raises' (a flat output)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Iterable, Literal

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version

from portspeed.accelerator.declarations import STAGED_BACKEND  # its table is Gloo's (below)
from portspeed.errors import UnknownBackendError

if TYPE_CHECKING:
    from portspeed.accelerator.backend_gaps import BackendGaps

__all__ = [
    "BackendGaps",
    "Capabilities",
    "Gap",
    "KNOWN_BACKENDS",
    "REDUCING_COLLECTIVES",
    "ROUTED_COLLECTIVES",
    "TABLED_BACKENDS",
    "CHECKED_TORCH",
    "CHUNK_SHAPED",
    "capabilities_for",
    "check_backend_name",
    "op_type",
    "CANONICAL_OPS",
    "STAGED_BACKEND",
]

#: Backend names portspeed knows, with the device type they serve. (The test backend
#: ``standin`` is not listed: it is known once registered, like any third-party backend.)
KNOWN_BACKENDS: dict[str, str] = {
    "gloo": "cpu",
    "nccl": "cuda",
    "hccl": "npu",
    "xccl": "xpu",
    "ccl": "xpu",
    "cncl": "mlu",
    "mccl": "musa",
    "mpi": "cpu",
    "ucc": "cuda",
}

#: Torch releases whose Gloo behaviour was value-checked.
CHECKED_TORCH = (Version("2.6"), Version("2.15.99"))

#: Collectives that take a reduce op.
REDUCING_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
#: The collective whose only gap is the shape of its output (see the module docstring).
CHUNK_SHAPED = "all_gather_into_tensor"
#: Collectives the router can rewrite, so the only ones a gap may name.
ROUTED_COLLECTIVES = REDUCING_COLLECTIVES + ("all_to_all", CHUNK_SHAPED)

Effect = Literal["raises", "wrong"]
RedOpType = dist.ReduceOp.RedOpType
_R = dist.ReduceOp


#: The RedOpType members, one object each (pybind returns fresh enum objects from
#: properties such as ``ReduceOp.op``, and comparing them with == is slow): tables and the
#: router compare these by identity.
CANONICAL_OPS: dict[int, Any] = {int(v): v for v in RedOpType.__members__.values()}
CANONICAL_OP_IDS = frozenset(id(v) for v in CANONICAL_OPS.values())


def op_type(op: Any) -> Any:
    """The canonical ``RedOpType`` member of ``op`` (a RedOpType, or a ReduceOp object such as PREMUL_SUM)."""
    if id(op) in CANONICAL_OP_IDS:
        return op
    inner = op if type(op) is RedOpType else getattr(op, "op", None)
    if type(inner) is RedOpType:
        return CANONICAL_OPS[int(inner)]
    raise TypeError(f"{op!r} is not a torch.distributed.ReduceOp; pass a member such as dist.ReduceOp.SUM")


@dataclasses.dataclass(frozen=True)
class Gap:
    """One thing a backend does not do right. ``op``/``dtype`` None means 'any'."""

    collective: str
    effect: Effect
    note: str
    op: Any = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.op is not None:
            object.__setattr__(self, "op", op_type(self.op))  # canonical: compared by identity

    def matches(self, op: Any, dtype: torch.dtype | None) -> bool:
        """Whether a call with this (canonical) op and dtype falls in the gap."""
        return (self.op is None or self.op is op) and (self.dtype is None or self.dtype is dtype)

    def as_dict(self) -> dict[str, str]:
        return {
            "collective": self.collective,
            "op": self.op.name if self.op is not None else "any",
            "dtype": str(self.dtype).replace("torch.", "") if self.dtype is not None else "any",
            "effect": self.effect,
            "note": self.note,
        }


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one backend gets wrong or lacks on one torch version; no gaps means 'does everything right'."""

    backend: str
    torch_version: str = ""
    gaps: tuple[Gap, ...] = ()
    notes: tuple[str, ...] = ()
    #: the backend reads a send's tensor until the send completes (Gloo), instead of having
    #: taken its data when the call returned (NCCL's stream order, a staging CCL): then the
    #: caller must not free or reuse the tensor before wait(), and Megatron's p2p does
    sends_from_buffer: bool = False
    #: each group keeps host threads and sockets until destroyed (Gloo, a CCL staging through Gloo):
    #: portspeed destroys the groups Megatron drops without destroying them
    groups_hold_host_threads: bool = False

    def __post_init__(self) -> None:
        index: dict[str, tuple[Gap, ...]] = {}
        # dtype gaps first: the router then computes in a supported dtype before other rewrites
        for g in sorted(self.gaps, key=lambda g: g.dtype is None):
            index[g.collective] = index.get(g.collective, ()) + (g,)
        # per collective: (ids of ops with gaps, some gap covers every op, dtypes with gaps)
        quick = {c: (frozenset(id(g.op) for g in gs if g.op is not None), any(g.op is None and g.dtype is None
                                                                               for g in gs),
                     frozenset(g.dtype for g in gs if g.dtype is not None))
                 for c, gs in index.items()}
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_quick", quick)

    @property
    def missing(self) -> frozenset[str]:
        """Collectives with at least one gap."""
        return frozenset(self._index)  # type: ignore[attr-defined]

    def affects(self, collective: str) -> bool:
        """Whether any call of ``collective`` may need a rewrite."""
        return collective in self._index  # type: ignore[attr-defined]

    def gap(self, collective: str, op: Any = None, dtype: torch.dtype | None = None) -> Gap | None:
        """The first gap matching this call, or None when the backend does it right."""
        gaps = self._index.get(collective)  # type: ignore[attr-defined]
        if gaps is None:
            return None
        if op is not None and id(op) not in CANONICAL_OP_IDS:
            op = op_type(op)
        op_ids, every_op, dtypes = self._quick[collective]  # type: ignore[attr-defined]
        if not every_op and id(op) not in op_ids and dtype not in dtypes:
            return None  # the common case, decided without comparing pybind enums
        for g in gaps:
            if (g.op is None or g.op is op) and (g.dtype is None or g.dtype is dtype):
                return g
        return None

    def describe(self) -> list[dict[str, str]]:
        """The gaps as printable rows (for `portspeed info`)."""
        return [g.as_dict() for g in self.gaps]


#: The bitwise reduce ops, which many accelerator CCLs lack.
BITWISE_OPS = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


# ---------------------------------------------------------------------- tables
def _gaps(collectives: Iterable[str], effect: Effect, note: str, ops: Iterable[Any] = (None,),
          dtypes: Iterable[torch.dtype | None] = (None,)) -> list[Gap]:
    return [Gap(c, effect, note, op, dt) for c in collectives for op in ops for dt in dtypes]


def _gloo(v: Version) -> list[Gap]:
    # PREMUL_SUM is refused by name, except by a reduce-scatter that ignores every op (a 'wrong' row below)
    ignores_op = {"reduce_scatter_tensor"} if v < Version("2.8") else {"reduce_scatter_tensor", "reduce_scatter"}
    premul_raises = [c for c in REDUCING_COLLECTIVES if v >= Version("2.9") or c not in ignores_op]
    out = _gaps(premul_raises, "raises", "Gloo has no PREMUL_SUM (every release)", ops=[RedOpType.PREMUL_SUM])
    if v < Version("2.8"):
        out += _gaps(["all_reduce", "reduce"], "raises", "Gloo AVG raises before torch 2.8 (pytorch#149781)",
                     ops=[RedOpType.AVG])
    if v < Version("2.9"):
        out += _gaps(["reduce_scatter_tensor"], "wrong",
                     "Gloo reduce_scatter_tensor ignores the op and sums before torch 2.9 (pytorch#149869); "
                     "AVG/MAX/PREMUL_SUM value-checked on 2.6.0 and 2.8.0, MIN/PRODUCT take the same code path",
                     ops=[RedOpType.AVG, RedOpType.MAX, RedOpType.MIN, RedOpType.PRODUCT, RedOpType.PREMUL_SUM])
    if v < Version("2.8"):
        out += _gaps(["reduce_scatter"], "raises", "Gloo has no list reduce_scatter before torch 2.8")
    elif v < Version("2.9"):
        out += _gaps(["reduce_scatter"], "wrong", "Gloo list reduce_scatter ignores the op (sums) on torch 2.8 "
                     "(AVG/MAX/PREMUL_SUM value-checked on 2.8.0)",
                     ops=[RedOpType.AVG, RedOpType.MAX, RedOpType.MIN, RedOpType.PRODUCT, RedOpType.PREMUL_SUM])
    if v < Version("2.12"):
        out += _gaps(["all_to_all"], "raises", "Gloo has no list all_to_all before torch 2.12")
    out += _gaps([CHUNK_SHAPED], "raises",
                 "Gloo wants each output chunk of all_gather_into_tensor shaped as the input; flat or stacked "
                 "outputs and 0-d inputs raise (run on torch 2.13.0, 2.14.1 and 2.15.0; the same code read in the "
                 "2.7.1 source)")
    return out


def _nccl(v: Version) -> list[Gap]:
    return []


#: The built-in tables, the defaults an adapter gets for these backends (torch's own).
_TABLES = {
    "gloo": _gloo,
    "nccl": _nccl,
    STAGED_BACKEND: _gloo,  # it runs each collective on Gloo (host copies of the device's tensors)
}

#: Backends with a built-in table (others go straight through unless their adapter declares gaps).
TABLED_BACKENDS = frozenset(_TABLES)
#: torch's backends that read a send's tensor while the send is in flight (host memory, no stream)
_SENDS_FROM_BUFFER = frozenset({"gloo", STAGED_BACKEND})
_HOLD_HOST_THREADS = frozenset({"gloo"})  # torch's backends whose groups keep host threads until destroyed


def check_backend_name(name: str) -> None:
    """Raise UnknownBackendError unless ``name`` is a backend portspeed or torch.distributed knows."""
    if not isinstance(name, str) or not name.strip():
        raise UnknownBackendError(
            f"collective backend name must be a non-empty string, got {name!r}; known: "
            f"{', '.join(sorted(KNOWN_BACKENDS))}"
        )
    registered = {b.lower() for b in getattr(dist.Backend, "backend_list", [])} - {"undefined"}
    if name.lower() not in KNOWN_BACKENDS and name.lower() not in registered and name.lower() != STAGED_BACKEND:
        known = sorted(set(KNOWN_BACKENDS) | registered)
        raise UnknownBackendError(
            f"unknown collective backend {name!r}; known: {', '.join(known)}. A vendor backend must be "
            "registered with torch.distributed.Backend.register_backend (usually by importing the vendor package) first"
        )


def _torch_version(text: str | None) -> Version:
    raw = text or torch.__version__
    try:
        return Version(Version(raw.split("+")[0]).base_version)
    except InvalidVersion:
        raise ValueError(f"torch version {raw!r} is not a PEP 440 version; pass something like '2.13.0'") from None


def _checked_version(torch_version: str | None) -> tuple[Version, list[str]]:
    v = _torch_version(torch_version)
    lo, hi = CHECKED_TORCH
    if lo <= v <= hi:
        return v, []
    top = Version(f"{hi.major}.{hi.minor}")
    note = f"torch {v} is outside the checked range {lo.base_version}-{top}; the nearest checked row is used"
    return (lo if v < lo else top), [note]


@functools.lru_cache(maxsize=64)
def capabilities_for(backend: str, torch_version: str | None = None) -> Capabilities:
    """The built-in record of ``backend`` on ``torch_version`` (default: the installed torch).

    Only torch's own backends have tables here; an adapter's ``capabilities()`` adds what
    it declares for its own backend.
    """
    name = backend.lower()
    v, notes = _checked_version(torch_version)
    table = _TABLES.get(name)
    if table is None:
        notes.append(f"no capability table for backend {backend!r} and no gaps declared by its adapter: "
                     "its collectives go straight through")
        return Capabilities(backend=name, torch_version=str(v), notes=tuple(notes))
    return Capabilities(backend=name, torch_version=str(v), gaps=tuple(table(v)), notes=tuple(notes),
                        sends_from_buffer=name in _SENDS_FROM_BUFFER,
                        groups_hold_host_threads=name in _HOLD_HOST_THREADS)


def __getattr__(name: str) -> Any:
    """``BackendGaps`` moved to ``backend_gaps`` (which imports this module): still importable from here."""
    if name == "BackendGaps":
        from portspeed.accelerator.backend_gaps import BackendGaps

        return BackendGaps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
