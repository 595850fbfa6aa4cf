"""``BackendGaps``: how an adapter declares what its collective library lacks, and the record it becomes.

Why a declaration and not code: the router rewrites each listed case into calls the library does
right (AVG as SUM then divide, a missing dtype in float32, a missing collective through another),
so an adapter only has to say what is missing. ``BackendGaps.capabilities(backend)`` adds the
declaration to the built-in record of the backend (``capabilities.capabilities_for``: empty for a
vendor's own backend); ``source()`` writes it back as the Python an adapter holds, which is how
``portspeed conformance`` says what to declare (``portspeed.conformance.gaps``).

Example::

    BackendGaps(unsupported_ops=[dist.ReduceOp.AVG]).capabilities("myccl").gap("reduce", dist.ReduceOp.AVG)
    BackendGaps(unsupported_dtypes=[("all_reduce", torch.bfloat16)]).source()
    # 'BackendGaps(unsupported_dtypes=[("all_reduce", torch.bfloat16)])'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable

import torch

from portspeed.accelerator.capabilities import (CHUNK_SHAPED, REDUCING_COLLECTIVES, Capabilities, Gap, capabilities_for,
                                                op_type)

__all__ = ["BackendGaps", "DECLARABLE", "GAP_FIELDS"]

#: What ``BackendGaps``' op, dtype and collective fields may name (the shape gap has its own field).
DECLARABLE = REDUCING_COLLECTIVES + ("all_to_all",)
#: The fields that declare gaps (the others say how the library behaves, or where the knowledge comes from).
GAP_FIELDS = ("unsupported_ops", "unsupported_dtypes", "unsupported_collectives", "wrong_dtypes",
              "chunk_shaped_all_gather")


def _pairs(value: Iterable[Any], field: str) -> tuple[tuple[str, torch.dtype], ...]:
    out = []
    for pair in value:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], torch.dtype)):
            raise TypeError(f"BackendGaps.{field} takes (collective, torch.dtype) pairs, got {pair!r}; "
                            "e.g. ('reduce_scatter_tensor', torch.bfloat16)")
        out.append((_collective(pair[0], field), pair[1]))
    return tuple(out)


def _collective(name: Any, field: str) -> str:
    if name == CHUNK_SHAPED:
        raise ValueError(f"BackendGaps.{field}: the router only reshapes the output of {CHUNK_SHAPED}, it "
                         "cannot replace the collective; declare chunk_shaped_all_gather=True when the library "
                         "wants each output chunk shaped as the input")
    if name not in DECLARABLE:
        raise ValueError(f"BackendGaps.{field}: {name!r} is not a collective the router can rewrite; "
                         f"name one of {', '.join(DECLARABLE)} (other collectives must work as they are)")
    return name


@dataclasses.dataclass(frozen=True)
class BackendGaps:
    """What an adapter's collective library lacks, declared in a few lines (``Accelerator.backend_gaps``).

    Why a declaration and not code: the router rewrites each listed case into calls the
    library does right (AVG as SUM then divide, a missing dtype in float32, a missing
    collective through another), so an adapter only has to say what is missing.

    - ``unsupported_ops``: reduce ops every reducing collective refuses (``ReduceOp.AVG``...);
    - ``unsupported_dtypes``: ``(collective, dtype)`` pairs the library refuses;
    - ``unsupported_collectives``: collectives it lacks for every op and dtype;
    - ``wrong_dtypes``: ``(collective, dtype)`` pairs it accepts but computes wrongly (for
      example float64 narrowed to float32): the router refuses these loudly;
    - ``chunk_shaped_all_gather``: True when its ``all_gather_into_tensor`` wants each dim-0
      chunk of the output shaped as the input, as Gloo does (a flat output of a 2-d input,
      a stacked output, a 0-d input raise): the router then views such outputs as chunks;
    - ``note``: where the knowledge comes from, shown by ``portspeed info``.

    Collectives are named as in ``ROUTED_COLLECTIVES``; anything else raises, as the router
    could not rewrite it. Lists are accepted and stored as tuples.
    """

    unsupported_ops: tuple[Any, ...] = ()
    unsupported_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    unsupported_collectives: tuple[str, ...] = ()
    wrong_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    chunk_shaped_all_gather: bool = False
    note: str = "declared by the adapter"
    #: see ``Capabilities.sends_from_buffer``: True when the library reads a send's tensor until
    #: the send completes (portspeed then sends private copies from Megatron's pipeline p2p)
    sends_from_buffer: bool = False
    #: see ``Capabilities.groups_hold_host_threads`` (a library staging through Gloo, or working like it)
    groups_hold_host_threads: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "unsupported_ops", tuple(op_type(o) for o in self.unsupported_ops))
        set_(self, "unsupported_dtypes", _pairs(self.unsupported_dtypes, "unsupported_dtypes"))
        set_(self, "wrong_dtypes", _pairs(self.wrong_dtypes, "wrong_dtypes"))
        if isinstance(self.unsupported_collectives, str):
            raise TypeError("BackendGaps.unsupported_collectives takes a sequence of names, not one string "
                            f"({self.unsupported_collectives!r}); write ({self.unsupported_collectives!r},)")
        set_(self, "unsupported_collectives",
             tuple(_collective(c, "unsupported_collectives") for c in self.unsupported_collectives))
        if type(self.chunk_shaped_all_gather) is not bool:
            raise TypeError("BackendGaps.chunk_shaped_all_gather takes True or False, got "
                            f"{self.chunk_shaped_all_gather!r}")

    def items(self) -> list[tuple[str, Any, tuple[Gap, ...]]]:
        """Each declared item as ``(field, value, the Gap rows it stands for)``: what one entry of the
        declaration makes the router rewrite (the conformance kit checks each on the raw backend)."""
        n = self.note
        return (
            [("unsupported_ops", op, tuple(Gap(c, "raises", f"{n} (no {op.name})", op) for c in REDUCING_COLLECTIVES))
             for op in self.unsupported_ops]
            + [("unsupported_dtypes", (c, dt), (Gap(c, "raises", f"{n} (no {str(dt)[6:]} {c})", dtype=dt),))
               for c, dt in self.unsupported_dtypes]
            + [("unsupported_collectives", c, (Gap(c, "raises", f"{n} (no {c})"),))
               for c in self.unsupported_collectives]
            + [("wrong_dtypes", (c, dt), (Gap(c, "wrong", f"{n} ({str(dt)[6:]} {c} computed wrongly)", dtype=dt),))
               for c, dt in self.wrong_dtypes]
            + ([("chunk_shaped_all_gather", True, (Gap(CHUNK_SHAPED, "raises", f"{n} ({CHUNK_SHAPED} wants each output "
                                                                            "chunk shaped as the input)"),))]
               if self.chunk_shaped_all_gather else [])
        )

    def gaps(self) -> tuple[Gap, ...]:
        """The declaration as Gap rows."""
        return tuple(g for _, _, rows in self.items() for g in rows)

    def field_source(self, field: str) -> str:
        """``field=value`` as an adapter writes it (``torch``, ``torch.distributed as dist``), '' at its default."""
        value = getattr(self, field)
        if value == next(f.default for f in dataclasses.fields(self) if f.name == field):
            return ""
        if field == "unsupported_ops":
            text = "[" + ", ".join(f"dist.ReduceOp.{op.name}" for op in value) + "]"
        elif field in ("unsupported_dtypes", "wrong_dtypes"):
            text = "[" + ", ".join(f'("{c}", {dt})' for c, dt in value) + "]"
        elif field == "unsupported_collectives":
            text = "[" + ", ".join(f'"{c}"' for c in value) + "]"
        else:
            text = repr(value)
        return f"{field}={text}"

    def source(self) -> str:
        """The declaration as the Python an adapter writes, fields at their default left out."""
        parts = (self.field_source(f.name) for f in dataclasses.fields(self))
        return "BackendGaps(" + ", ".join(p for p in parts if p) + ")"

    def capabilities(self, backend: str, torch_version: str | None = None, adapter: str = "") -> Capabilities:
        """The record of ``backend``: its built-in table (if torch's own) plus these gaps."""
        return _declared(self, backend.lower(), torch_version, adapter)


@functools.lru_cache(maxsize=64)
def _declared(gaps: BackendGaps, backend: str, torch_version: str | None, adapter: str) -> Capabilities:
    base = capabilities_for(backend, torch_version)
    who = f"the {adapter!r} adapter" if adapter else "its adapter"
    notes = tuple(n for n in base.notes if "no capability table" not in n)
    notes += (f"gaps declared by {who}: {gaps.note}",)
    return Capabilities(backend=backend, torch_version=base.torch_version, gaps=base.gaps + gaps.gaps(),
                        notes=notes, sends_from_buffer=base.sends_from_buffer or gaps.sends_from_buffer,
                        groups_hold_host_threads=base.groups_hold_host_threads or gaps.groups_hold_host_threads)


