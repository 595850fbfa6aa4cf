"""One rank of the collective checks: its inputs, the references, and the results it reports.

Why a class of its own: every check records the same way (``check``: a value against the exact
reference; ``case``: the calls of one check, keyed ``(collective, op, dtype)`` so that a call that
raises is one failed check, not a dead rank, and ``gaps.suggest`` can say which ``BackendGaps``
field it means). The rank program (``collectives``) and the raw checks (``gaps``) both use it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from portspeed.conformance import gaps

__all__ = ["Rank"]


class Rank:
    """One rank's inputs, references and results (tensors on ``dev``, references on the host)."""

    def __init__(self, rank: int, n: int, dev: Any, caps: Any = None) -> None:
        self.rank, self.n, self.dev, self.caps = rank, n, dev, caps
        self.results: list[dict[str, Any]] = []
        self.key: dict[str, Any] = {}

    def data(self, r: int, shape: tuple, dtype: Any, salt: int = 0) -> Any:
        """Rank ``r``'s input on this rank's device."""
        from portspeed.conformance.reference import values

        return values(r, shape, dtype, salt).to(self.dev)

    def everyone(self, shape: tuple, salt: int = 0) -> Any:
        """Every rank's input, stacked, in float64 on the host."""
        from portspeed.conformance.reference import all_values

        return all_values(self.n, shape, salt)

    def empty(self, shape: Any, dtype: Any = None) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype, device=self.dev)

    def check(self, name: str, got: Any, want: Any) -> None:
        import torch

        if isinstance(got, torch.Tensor):
            got, want = got.cpu(), want.cpu()
            ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
            detail = "" if ok else f"got {got.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()} ({got.dtype})"
        else:
            ok, detail = got == want, f"got {got!r} want {want!r}"
        self.results.append({"check": name, "ok": bool(ok), "detail": "" if ok else detail, **self.key,
                             **({} if ok else {"effect": "wrong"})})

    @contextlib.contextmanager
    def case(self, name: str, collective: str, op: str | None, dtype: Any) -> Iterator[None]:
        """The calls of one check, keyed ``(collective, op, dtype)`` for ``gaps.suggest``: a call that raises fails
        the check (``effect`` raises) and the rank goes on to the next check."""
        import torch.distributed as dist

        op = "PREMUL_SUM" if op == "PREMUL" else op
        real_op = getattr(dist.ReduceOp, op) if op not in (None, gaps.SHAPE) else None
        flagged = self.caps.gap(collective, real_op, dtype) is not None
        self.key = {"key": [collective, op, str(dtype)[6:]], "flagged": flagged}
        try:
            yield
        except Exception as exc:  # an undeclared gap (or a second one): reported with the declaration to write
            text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            self.results.append({"check": name, "ok": False, "detail": f"raised {type(exc).__name__}: {text}",
                                 **self.key, "effect": "raises"})
        finally:
            self.key = {}
