"""What the probe and the perf recording share about their session: one per process, and an own loop's calls to it.

Why shared: both recorders are driven by the same calls from the same places (Megatron's schedule and
optimizer, DeepSpeed's engine, the HF Trainer, an own loop's ``iteration(n, model)``), and both must make
nothing while their setting is unset. ``ProcessSession`` is the one session of a recorder in this process,
made on first use; ``LoopMarks`` is what ``portspeed.probe.iteration`` and ``portspeed.perf.iteration``
do, with the session module imported only on the first call (``import portspeed.perf`` stays light).
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Generic, Iterator, TypeVar

from portspeed import config

__all__ = ["LoopMarks", "ProcessSession", "chunks"]

T = TypeVar("T")


class ProcessSession(Generic[T]):
    """The session of one recorder in this process: made by ``make(settings)`` on first use, None while the
    setting ``field`` (``probe_dir``, ``perf_dir``) is unset."""

    def __init__(self, field: str, make: Callable[[Any], T]) -> None:
        self.field, self.make = field, make
        self.value: T | None = None

    def current(self) -> T | None:
        s = self.value
        if s is None:
            settings = config.settings()
            if not getattr(settings, self.field):
                return None
            s = self.value = self.make(settings)
        return s

    def reset(self) -> None:
        """Forget the session (tests; an open iteration is ended first)."""
        s = self.value
        if s is not None:
            s.end()  # type: ignore[attr-defined]
        self.value = None


def chunks(model: Any) -> list:
    """A module, or a list of model chunks, as the list of chunks."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


class LoopMarks:
    """An own loop's calls for the recorder whose session module is ``module`` (its ``current()`` is looked up
    at each call, so a benchmark may replace it); ``begun(session)`` runs after an iteration begins,
    ``is_active(session)`` says whether one is being recorded."""

    def __init__(self, module: str, is_active: Callable[[Any], bool],
                 begun: Callable[[Any], None] | None = None) -> None:
        self.module, self.is_active, self.begun = module, is_active, begun

    def session(self) -> Any:
        return importlib.import_module(self.module).current()

    def begin(self, n: int, model: Any) -> None:
        s = self.session()
        if s is not None:
            s.begin(int(n), chunks(model), framework="loop", explicit=True)
            if self.begun is not None:
                self.begun(s)

    def call(self, name: str) -> None:
        """The session's ``name()`` (``end``, ``forward_backward_done``), when there is a session."""
        s = self.session()
        if s is not None:
            getattr(s, name)()

    @contextlib.contextmanager
    def around(self, n: int, model: Any) -> Iterator[None]:
        """``begin(n, model)`` ... the session's ``end()`` around the block (also when it raises)."""
        self.begin(n, model)
        try:
            yield
        finally:
            self.call("end")

    def active(self) -> bool:
        s = self.session()
        return s is not None and self.is_active(s)
