"""Per-backend collective capability tables, by torch version: what each backend lacks or gets wrong.

Contract
- ``capabilities_for(backend, torch_version=None, device_type=None)`` returns a frozen
  ``Capabilities`` record listing ``Gap`` entries: a (collective, reduce op, dtype)
  combination the backend either **raises** on or silently computes **wrong**. Anything
  not listed is taken to work, and the router sends it straight through.
- ``Capabilities.gap(collective, op, dtype)`` answers for one call; it is what the router
  asks on every collective, so it is a dict lookup and a short loop.
- Collective names are torch.distributed's public function names (``all_reduce``,
  ``reduce_scatter_tensor``, ``all_to_all``...). Ops are ``ReduceOp.RedOpType`` members.

Sources: the Gloo table was value-checked on torch 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0,
2.11.0, 2.12.0 and 2.13.0 with 2-3 ranks (docs/reference notes, pytorch#149781 and
#149869). The vendor rows come from vendor documentation and source reading, not from
hardware runs (we have none); they err on the side of rewriting, which is always
correct and only costs time. ``standin`` is portspeed's own test backend
(``portspeed.testing.standin_ccl``) and lists the gaps it raises on purpose.

Limits: a backend without a table (``ucc``, ``mpi``, third-party names) gets an empty
record with a note, so its calls go straight through. Torch versions outside 2.6-2.13
use the nearest checked row, and the record's notes say so.

Example::

    caps = capabilities_for("gloo", torch_version="2.7.1")
    caps.gap("all_reduce", dist.ReduceOp.AVG, torch.float32).effect   # 'raises'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Literal

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version

from .errors import UnknownBackendError

__all__ = [
    "Capabilities",
    "Gap",
    "KNOWN_BACKENDS",
    "REDUCING_COLLECTIVES",
    "TABLED_BACKENDS",
    "CHECKED_TORCH",
    "capabilities_for",
    "check_backend_name",
    "op_type",
    "CANONICAL_OPS",
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
CHECKED_TORCH = (Version("2.6"), Version("2.13.99"))

#: Collectives that take a reduce op.
REDUCING_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")

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


# ---------------------------------------------------------------------- tables
def _gaps(collectives: Iterable[str], effect: Effect, note: str, ops: Iterable[Any] = (None,),
          dtypes: Iterable[torch.dtype | None] = (None,)) -> list[Gap]:
    return [Gap(c, effect, note, op, dt) for c in collectives for op in ops for dt in dtypes]


def _gloo(v: Version) -> list[Gap]:
    out = _gaps(REDUCING_COLLECTIVES, "raises", "Gloo has no PREMUL_SUM (every release)", ops=[RedOpType.PREMUL_SUM])
    if v < Version("2.8"):
        out += _gaps(["all_reduce", "reduce"], "raises", "Gloo AVG raises before torch 2.8 (pytorch#149781)",
                     ops=[RedOpType.AVG])
    if v < Version("2.9"):
        out += _gaps(["reduce_scatter_tensor"], "wrong",
                     "Gloo reduce_scatter_tensor ignores the op and sums before torch 2.9 (pytorch#149869); "
                     "AVG/MAX value-checked, MIN/PRODUCT take the same code path",
                     ops=[RedOpType.AVG, RedOpType.MAX, RedOpType.MIN, RedOpType.PRODUCT])
    if v < Version("2.8"):
        out += _gaps(["reduce_scatter"], "raises", "Gloo has no list reduce_scatter before torch 2.8")
    elif v < Version("2.9"):
        out += _gaps(["reduce_scatter"], "wrong", "Gloo list reduce_scatter ignores the op (sums) on torch 2.8",
                     ops=[RedOpType.AVG, RedOpType.MAX, RedOpType.MIN, RedOpType.PRODUCT])
    if v < Version("2.12"):
        out += _gaps(["all_to_all"], "raises", "Gloo has no list all_to_all before torch 2.12")
    return out


def _standin(v: Version) -> list[Gap]:
    note = "stand-in backend declares this gap on purpose, like a vendor CCL"
    return (
        _gaps(REDUCING_COLLECTIVES, "raises", note + " (no AVG)", ops=[RedOpType.AVG])
        + _gaps(REDUCING_COLLECTIVES, "raises", note + " (no PREMUL_SUM)", ops=[RedOpType.PREMUL_SUM])
        + _gaps(["reduce_scatter", "reduce_scatter_tensor"], "raises", note + " (no bf16 reduce_scatter)",
                dtypes=[torch.bfloat16])
        + _gaps(["all_to_all"], "raises", note + " (no list all_to_all)")
    )


_BITWISE = [RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR]
_VENDOR_NOTE = "from vendor documentation, not run on hardware here"


def _hccl_npu(v: Version) -> list[Gap]:
    return _gaps(REDUCING_COLLECTIVES, "raises", f"HCCL (Ascend) has no bitwise reductions; {_VENDOR_NOTE}",
                 ops=_BITWISE + [RedOpType.PREMUL_SUM])


def _hccl_hpu(v: Version) -> list[Gap]:
    return _gaps(REDUCING_COLLECTIVES, "raises", f"HCCL (Habana) has no PRODUCT/AVG/bitwise; {_VENDOR_NOTE}",
                 ops=[RedOpType.PRODUCT, RedOpType.AVG, RedOpType.PREMUL_SUM] + _BITWISE)


def _xccl(v: Version) -> list[Gap]:
    return _gaps(REDUCING_COLLECTIVES, "raises",
                 f"oneCCL: AVG only with recent releases (rewritten to be safe), no bitwise; {_VENDOR_NOTE}",
                 ops=[RedOpType.AVG, RedOpType.PREMUL_SUM] + _BITWISE)


def _cncl(v: Version) -> list[Gap]:
    return (_gaps(REDUCING_COLLECTIVES, "raises", f"CNCL has no AVG/bitwise; {_VENDOR_NOTE}",
                  ops=[RedOpType.AVG, RedOpType.PREMUL_SUM] + _BITWISE)
            + _gaps(REDUCING_COLLECTIVES, "wrong", f"CNCL maps float64 to float32 silently; {_VENDOR_NOTE}",
                    dtypes=[torch.float64]))


def _mccl(v: Version) -> list[Gap]:
    return _gaps(REDUCING_COLLECTIVES, "raises", f"MCCL supports bf16 only in some builds (upcast to be safe); "
                 f"{_VENDOR_NOTE}", dtypes=[torch.bfloat16])


def _nccl(v: Version) -> list[Gap]:
    return []


_TABLES = {
    "gloo": _gloo,
    "standin": _standin,
    "nccl": _nccl,
    "hccl": _hccl_npu,
    "hccl@hpu": _hccl_hpu,
    "xccl": _xccl,
    "ccl": _xccl,
    "cncl": _cncl,
    "mccl": _mccl,
}

#: Backends with a table (others go straight through).
TABLED_BACKENDS = frozenset(k for k in _TABLES if "@" not in k)


def check_backend_name(name: str) -> None:
    """Raise UnknownBackendError unless ``name`` is a backend portspeed or torch.distributed knows."""
    if not isinstance(name, str) or not name.strip():
        raise UnknownBackendError(
            f"collective backend name must be a non-empty string, got {name!r}; known: "
            f"{', '.join(sorted(KNOWN_BACKENDS))}"
        )
    registered = {b.lower() for b in getattr(dist.Backend, "backend_list", [])} - {"undefined"}
    if name.lower() not in KNOWN_BACKENDS and name.lower() not in registered:
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


@functools.lru_cache(maxsize=64)
def capabilities_for(backend: str, torch_version: str | None = None, device_type: str | None = None) -> Capabilities:
    """The capability record of ``backend`` on ``torch_version`` (default: the installed torch).

    ``device_type`` separates backends that share a name (``hccl`` is Ascend's on ``npu``
    and Habana's on ``hpu``).
    """
    name = backend.lower()
    v = _torch_version(torch_version)
    notes: list[str] = []
    lo, hi = CHECKED_TORCH
    if not (lo <= v <= hi):
        notes.append(f"torch {v} is outside the checked range 2.6-2.13; the nearest checked row is used")
        v = lo if v < lo else Version("2.13")
    key = f"{name}@{device_type}" if f"{name}@{device_type}" in _TABLES else name
    table = _TABLES.get(key)
    if table is None:
        notes.append(f"no capability table for backend {backend!r}: its collectives go straight through")
        return Capabilities(backend=name, torch_version=str(v), notes=tuple(notes))
    return Capabilities(backend=name, torch_version=str(v), gaps=tuple(table(v)), notes=tuple(notes))
