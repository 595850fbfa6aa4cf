"""Each module's forward and backward as spans between two clock stamps, nested, under the probe's canonical paths.

Why spans and not totals: a module's time includes its children's; naming where a port is slow needs
each module's own (self) time, its time minus its children's, or a slowed layer would show up in every
module above it. Spans nest on one stack: a forward pre-hook opens a forward span, the forward hook
closes it; the first gradient reaching any of a module's outputs opens its backward span, the gradient
of its inputs closes it (a tensor hook, or ``torch.autograd.graph.register_multi_grad_hook`` in mode "any"
for several tensors). A module whose output is its last child's (the model and its last layer) gets its
gradient hook called after the child's, at the same moment: its span is put under the child's. A span still
open when its parent closes is closed with it, and a backward span still open when autograd's engine
finishes the backward pass ends there (a module whose inputs need no gradient: the embedding, the
model chunk itself). A forward run while autograd's engine runs (an
activation recompute) is timed as part of the backward, where its cost lands.

Peak device memory: where the adapter keeps allocator statistics (not the CPU adapter), every boundary
reads the device's peak counter and resets it, so the peak of each stretch between two boundaries goes to
the innermost span open then, and a span's peak is the highest of its own stretches and its children's.
The reset is a side effect a script can see: in a timed iteration, ``max_memory_allocated()`` is the peak
since the last module boundary (docs/performance.md).

The paths are the probe's (``portspeed.probe.modules.ModuleTable``: wrappers stripped, global layer
and expert numbers), so a TP2 or PP2 run names a module as a one-rank run does; the model chunk itself
is ``(model)``. Hooks are installed for one iteration and removed at its end; they only stamp the clock.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from portspeed.perf.clock import Clock
from portspeed.probe.modules import ModuleTable

__all__ = ["ROOT", "Span", "SpanHooks"]

#: the path of a model chunk itself
ROOT = "(model)"


@dataclasses.dataclass(eq=False)
class Span:
    """One call of one module in one phase."""

    path: str
    cls: str
    phase: str  # forward | backward
    start: Any  # clock stamps
    end: Any = None
    parent: "Span | None" = None
    children: list["Span"] = dataclasses.field(default_factory=list)
    #: what the dispatch mode saw inside (this span only, not its children): "syncs" / "fallbacks" -> name -> count
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    copies: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # d2h / h2d / d2d -> [count, bytes]
    ops: list[tuple[str, Any, Any]] = dataclasses.field(default_factory=list)  # op level: (op, start, end)
    collectives: list[int] = dataclasses.field(default_factory=list)  # indexes into the iteration's collectives
    peak: int = -1  # the device's peak allocated bytes while it ran (children included); -1: not measured

    def count(self, kind: str, name: str) -> None:
        table = self.counts.setdefault(kind, {})
        table[name] = table.get(name, 0) + 1

    def add_copy(self, kind: str, nbytes: int) -> None:
        got = self.copies.setdefault(kind, [0, 0])
        got[0] += 1
        got[1] += int(nbytes)


def _needing_grad(value: Any) -> list[torch.Tensor]:
    """The tensors of a module's arguments or output that need a gradient (a tensor, a flat tuple or list: read
    directly, the common case; anything else through torch's pytree)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, torch.Tensor) for v in value):
        return [v for v in value if v is not None and v.requires_grad]
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _on_first_gradient(tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
    """``fn()`` once, when the first of ``tensors``' gradients is computed (one tensor: a plain tensor hook,
    cheaper than a multi-grad hook)."""
    if len(tensors) == 1:
        tensors[0].register_hook(lambda _grad: fn())
    else:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grads: fn(), mode="any")


def _inside(path: str, outer: str) -> bool:
    """Whether module ``path`` lies inside module ``outer`` (the model chunk holds every module)."""
    return outer == ROOT and path != ROOT or path.startswith(outer + ".")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class SpanHooks:
    """The hooks of one iteration; ``spans`` in the order they opened, ``current()`` the innermost open one."""

    def __init__(self, chunks: Sequence[torch.nn.Module], table: ModuleTable, clock: Clock,
                 memory: tuple[Callable[[], int], Callable[[], None]] | None = None) -> None:
        self.clock = clock
        self._memory = memory  # (read the device's peak counter, reset it), or None: no peak memory
        self.stack: list[Span] = []
        self.spans: list[Span] = []
        self._handles: list[Any] = []
        self._task = -1  # the backward pass whose end closes what it left open
        self._pending_inputs: dict[int, list[torch.Tensor]] = {}  # a forward span -> its inputs needing a gradient
        self._modules: list[tuple[torch.nn.Module, str, str]] = [
            (table.roots[c], ROOT, type(table.roots[c]).__name__) for c in range(len(chunks))]
        self._modules += [(i.module, i.path, i.cls) for i in table.infos]

    def install(self) -> "SpanHooks":
        for module, path, cls in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._pre(path, cls)))
            self._handles.append(module.register_forward_hook(self._post(path, cls)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def current(self) -> Span | None:
        """The innermost span open now (what a host sync or a collective is charged to)."""
        return self.stack[-1] if self.stack else None

    def close_all(self) -> None:
        """The forward/backward is over: whatever is still open ends now."""
        if self.stack:
            self._close(self.stack[0], self.clock.stamp())

    def _peak(self) -> None:
        """At a boundary: the device's peak since the last one goes to the innermost open span, the counter reset."""
        if self._memory is None:
            return
        read, reset = self._memory
        peak = int(read())
        reset()
        if self.stack and peak > self.stack[-1].peak:
            self.stack[-1].peak = peak

    def _ended(self, span: Span) -> None:
        """``span`` closed: its peak is its parent's too."""
        if span.parent is not None and span.peak > span.parent.peak:
            span.parent.peak = span.peak

    # ------------------------------------------------------------ spans
    def _open(self, path: str, cls: str, phase: str) -> Span:
        self._peak()
        stamp = self.clock.stamp()
        at = len(self.stack)
        if phase == "backward":  # a module and its last child share an output: the child's hook fired first
            while at and self.stack[at - 1].phase == "backward" and _inside(self.stack[at - 1].path, path):
                at -= 1
        parent = self.stack[at - 1] if at else None
        span = Span(path, cls, phase, stamp, parent=parent)
        if at < len(self.stack):  # the outer module goes under the spans its own gradient opened
            inner = self.stack[at]
            span.start = inner.start
            if parent is not None:
                parent.children.remove(inner)
            inner.parent = span
            span.children.append(inner)
        if parent is not None:
            parent.children.append(span)
        self.stack.insert(at, span)
        self.spans.append(span)
        return span

    def _close(self, span: Span, stamp: Any = None) -> None:
        if span.end is not None or span not in self.stack:
            return
        self._peak()
        stamp = self.clock.stamp() if stamp is None else stamp
        while self.stack:
            top = self.stack.pop()
            top.end = stamp
            self._ended(top)
            if top is span:
                return

    def _close_at_backward_end(self) -> None:
        """Once per backward pass: when autograd's engine finishes it, the spans it left open end (a module whose
        inputs need no gradient, the model chunk itself)."""
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return
        self._task = task

        def done() -> None:
            stamp = None
            while self.stack and self.stack[-1].phase == "backward":
                if stamp is None:
                    self._peak()
                    stamp = self.clock.stamp()
                top = self.stack.pop()
                top.end = stamp
                self._ended(top)

        torch.autograd.Variable._execution_engine.queue_callback(done)

    # ------------------------------------------------------------ hooks
    def _pre(self, path: str, cls: str) -> Callable:
        def pre(module: torch.nn.Module, args: Any) -> None:
            span = self._open(path, cls, "backward" if _in_backward() else "forward")
            module_inputs = _needing_grad(args)
            if module_inputs and not _in_backward():
                self._pending_inputs[id(span)] = module_inputs
            return None
        return pre

    def _post(self, path: str, cls: str) -> Callable:
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            span = next((s for s in reversed(self.stack) if s.path == path and s.end is None), None)
            if span is None:
                return None
            self._close(span)
            inputs = self._pending_inputs.pop(id(span), None)
            outputs = _needing_grad(output)
            if span.phase != "forward" or not outputs:
                return None
            holder: dict[str, Span] = {}

            def begin() -> None:
                if "span" not in holder:
                    holder["span"] = self._open(path, cls, "backward")
                    self._close_at_backward_end()

            def finish() -> None:
                opened = holder.get("span")
                if opened is not None:
                    self._close(opened)

            _on_first_gradient(outputs, begin)
            if inputs:
                _on_first_gradient(inputs, finish)
            return None
        return post
