"""Op-level recording (``--probe-level op``): every torch function called inside a module's forward.

Why a ``TorchFunctionMode``: it sees every call into torch's Python API (``torch.*``,
``torch.nn.functional.*``, ``Tensor`` methods) without wrapping any of them, on every device, and
it is pushed for the forward/backward of a probed iteration only. Each call becomes
``<Family>.<name>.<c>.forward`` (msprobe's keys: ``Functional`` for torch.nn.functional,
``Tensor`` for Tensor methods, ``Torch`` for torch's functions; ``<c>`` counts that function's
calls in the iteration on this rank), keyed to the innermost module running it (``ps_module``,
``ps_call`` = that module call's ``<n>``, ``ps_op_index`` = the op's index in that call), with its
inputs' statistics (taken before the call, so an in-place op shows what it read), its outputs'
(after), and every non-tensor argument in msprobe's ``{type, value}`` form, so a replay can rebuild
the call.

Limits: calls made while autograd's engine runs (backward, and recompute re-runs inside it) are
not recorded: on a GPU they run on the engine's threads, which a mode pushed on the main thread
does not see, so recording them on the CPU only would make the two dumps differ. Metadata calls
(``size``, ``dim``, attribute reads, ...) and calls that return no tensor are not recorded. An
allocation that writes nothing (``empty``, ``empty_like``, ...) is recorded with ``ps_uninitialized`` and no
statistics: its memory holds anything, NaN included; so is a view of such memory until something writes it
(Megatron's global memory buffer). A call whose tensor arguments are all integers or booleans (masks,
positions, Megatron's check that the CPU RNG state did not move) is bookkeeping and is not recorded.
The NaN watch does not watch views (a view cannot make a value).
``torch.distributed`` functions are not torch functions: collectives are recorded by their own
wrappers (``portspeed.probe.collectives``). The portable Transformer Engine's kernels are recorded
as one ``Kernel.<op>`` entry each, the torch functions inside them not (``portspeed.probe.kernel_calls``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from portspeed.probe import kernel_calls
from portspeed.probe import sharding as lay
from portspeed.probe import stats
from portspeed.probe.entries import IterationRecord

__all__ = ["OpRecorder", "op_name"]

#: Tensor methods that read metadata or convert, never compute: not recorded
_METADATA = {"__get__", "__set__", "size", "dim", "stride", "numel", "nelement", "ndimension", "is_contiguous",
             "data_ptr", "element_size", "storage_offset", "untyped_storage", "is_floating_point", "is_complex",
             "get_device", "__len__", "__format__", "__repr__", "__hash__", "__bool__", "__index__", "__int__",
             "__float__", "item", "tolist", "type", "register_hook", "retain_grad", "requires_grad_", "backward",
             "has_names", "_is_view", "__reduce_ex__", "__deepcopy__", "is_nonzero", "__array__", "numpy",
             "_typed_storage", "storage", "__dlpack__", "__iter__", "__contains__", "data", "grad_fn"}
#: calls whose output holds exactly the elements of their first argument (a view, a copy, a layout change): the
#: output's statistics are the argument's, so they are not measured again
_SAME_ELEMENTS = {"view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "flatten", "unflatten",
                  "squeeze", "unsqueeze", "contiguous", "detach", "clone", "movedim", "swapaxes", "swapdims",
                  "__get__"}
#: calls that allocate without writing (their output holds whatever the memory held, NaN included)
_UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
_names: dict[Any, tuple[str, str]] = {}


def op_name(func: Callable) -> tuple[str, str]:
    """(family, name) of a torch function as msprobe names it: Functional / Tensor / Torch."""
    got = _names.get(func)
    if got is not None:
        return got
    name = getattr(func, "__name__", None) or type(func).__name__
    qual = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", None) or ""
    if qual.startswith(("TensorBase.", "Tensor.", "_TensorBase.")) or module == "torch._tensor":
        family = "Tensor"
    elif module.startswith(("torch.nn.functional", "torch._C._nn")):
        family = "Functional"
    else:
        family = "Torch"
    try:
        _names[func] = (family, name)
    except TypeError:  # unhashable callables: named each time
        pass
    return family, name


class OpRecorder(TorchFunctionMode):
    """The mode of one iteration; ``innermost()`` answers (module info, call index) or None."""

    def __init__(self, record: IterationRecord, innermost: Callable[[], Any], parallel: lay.Parallel,
                 selected: Callable[[Any], bool]) -> None:
        super().__init__()
        self.record = record
        self.innermost = innermost
        self.parallel = parallel
        self.selected = selected
        self.counts: dict[tuple[str, str], int] = {}
        self.in_call: dict[tuple[int, int], int] = {}  # (id(module info), call) -> ops so far
        self.reduced: set[tuple[int, int]] = set()  # module calls whose collective ran (row-parallel reduces)
        self.parents: dict[str, str | None] = {}
        self._layouts: dict[tuple[int, bool], dict[str, Any]] = {}
        self.on = True

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        family, name = op_name(func)
        if not self.on or name in _METADATA or torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)
        where = self.innermost()
        if (where is not None and not self.selected(where[0])) or not _floating(args, kwargs):
            return func(*args, **kwargs)
        c = self.counts.get((family, name), 0)
        key = f"{family}.{name}.{c}.forward"
        save = self.record.saves(key)
        inplace = name.endswith("_") and not name.endswith("__") or "out" in kwargs or name == "__setitem__"
        if inplace:
            pending = self._inputs(key, args, kwargs, save)
        out = func(*args, **kwargs)
        leaves = tree_flatten(out)[0]
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            if not (inplace and args and isinstance(args[0], torch.Tensor)):
                return out
            leaves = [args[0]]  # __setitem__ returns None: what it wrote is its first argument
        if not inplace:
            pending = self._inputs(key, args, kwargs, save)
        self.counts[(family, name)] = c + 1
        self._add(key, name, where, pending, leaves, save, args, inplace)
        return out

    def _inputs(self, key: str, args: tuple, kwargs: dict, save: bool) -> tuple[list, dict]:
        """The arguments, each tensor's statistics queued now (before an in-place op writes it)."""
        rec = self.record
        if not rec.full:
            return [], {}
        return ([_arg(a, rec, key, "input_args", i, save) for i, a in enumerate(args)],
                {k: _arg(v, rec, key, f"input_kwargs.{k}", 0, save) for k, v in kwargs.items()})

    def _add(self, key: str, name: str, where: Any, pending: tuple[list, dict], leaves: list, save: bool,
             args: tuple = (), inplace: bool = False) -> None:
        rec = self.record
        if where is not None:
            info, call = where
            slot = (id(info), call)
            index = self.next_index(where)
            out_layout = self._layout(info.module, slot in self.reduced)
            entry: dict[str, Any] = {"ps_micro_batch": rec.micro_batch, "ps_chunk": rec.chunk, "ps_phase": "forward",
                                     "ps_module": info.path, "ps_class": info.cls, "ps_local_path": info.local_path,
                                     "ps_layer": info.layer if info.layer is not None else -1, "ps_op": name,
                                     "ps_op_index": index, "ps_call": call}
            if info.expert is not None:
                entry["ps_expert"] = info.expert
            parent = f"Module.{info.path}.{info.cls}.forward.{call}"
        else:
            out_layout = self._layout(None, False)
            entry = {"ps_micro_batch": rec.micro_batch, "ps_chunk": rec.chunk, "ps_phase": "forward",
                     "ps_module": None, "ps_class": None, "ps_local_path": None, "ps_layer": -1, "ps_op": name,
                     "ps_op_index": -1, "ps_call": -1}
            parent = None
        garbage = [_uninitialized(name, t, inplace) for t in leaves]
        if not rec.full:  # the NaN watch: flags of the outputs, entries only if one turns out non-finite
            for i, t in enumerate(leaves):
                # a view made by a call that writes nothing cannot be where a NaN is made: not watched
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not garbage[i] and \
                        (inplace or t._base is None):
                    rec.flag(t, key, "output", i, entry, out_layout)
            return
        entry["input_args"], entry["input_kwargs"] = pending
        if any(garbage):  # whatever the memory held: no statistics (they would differ run to run), no NaN
            entry["ps_uninitialized"] = True
        same = args[0] if name in _SAME_ELEMENTS and len(leaves) == 1 and args and \
            isinstance(args[0], torch.Tensor) else None
        entry["output"] = [dict(stats.describe(t), **stats.empty_stats(), ps_layout=out_layout) if garbage[i]
                           else rec.value(t, key, "output", i, out_layout, save, same) for i, t in enumerate(leaves)]
        rec.add(key, entry)
        self.parents[key] = parent

    def _layout(self, module: Any, reduced: bool) -> dict[str, Any]:
        """The op layout inside ``module`` (one dict per module and side of its reduce, shared by the entries)."""
        key = (id(module), reduced)
        got = self._layouts.get(key)
        if got is None:
            got = self._layouts[key] = lay.op_layout(module, reduced, self.parallel)
        return got

    def next_index(self, where: tuple[Any, int]) -> int:
        """The next op index inside the module call ``where`` (ops and collectives share it)."""
        slot = (id(where[0]), where[1])
        index = self.in_call.get(slot, 0)
        self.in_call[slot] = index + 1
        return index

    def mark_reduced(self) -> None:
        """A collective ran inside the innermost module's call (a row-parallel linear's reduce): its later ops are
        no longer partial sums."""
        where = self.innermost()
        if where is not None:
            self.reduced.add((id(where[0]), where[1]))

    def start(self) -> "OpRecorder":
        self.__enter__()
        kernel_calls.observe(self)
        return self

    def stop(self) -> None:
        if self.on:
            self.on = False
            kernel_calls.observe(None)
            self.__exit__(None, None, None)


def _floating(args: tuple, kwargs: dict) -> bool:
    """Whether a floating-point tensor is among the arguments (one level into lists): calls on integers and
    booleans alone (masks, positions, Megatron's RNG-state check) are bookkeeping, not the model's arithmetic.
    An allocation (``empty``, ``zeros``, ...) has no tensor argument and is kept."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            tensors.extend(x for x in v if isinstance(x, torch.Tensor))
    return not tensors or any(t.is_floating_point() or t.is_complex() for t in tensors)


#: storages (by address) an allocation that writes nothing made, until something writes them or a fresh tensor
#: takes the address: Megatron's global memory buffer is such a storage, read through views of it
_UNWRITTEN: set[int] = set()


def _uninitialized(name: str, t: Any, inplace: bool) -> bool:
    """Whether ``t`` (an output of call ``name``) holds memory nothing wrote yet, updating what is known."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    try:
        where = t.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage (a subclass): nothing to know
        return False
    if name in _UNINITIALIZED:
        _UNWRITTEN.add(where)
        return True
    if inplace or t._base is None:  # written now, or a fresh tensor at that address
        _UNWRITTEN.discard(where)
        return False
    return where in _UNWRITTEN  # a view: as its storage is


def _arg(value: Any, rec: IterationRecord, key: str, field: str, index: int, save: bool) -> Any:
    """An argument: a tensor's pending record, tensors inside lists and tuples too (``torch.cat([a, b])``), any
    other value encoded."""
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return [_arg(v, rec, key, f"{field}.{index}", j, save) for j, v in enumerate(value)]
    if isinstance(value, torch.Tensor) and _UNWRITTEN and _unwritten(value):
        return dict(stats.describe(value), **stats.empty_stats(), ps_uninitialized=True)
    return rec.value(value, key, field, index, None, save)


def _unwritten(t: torch.Tensor) -> bool:
    try:
        return t.device.type != "meta" and t.untyped_storage().data_ptr() in _UNWRITTEN
    except RuntimeError:
        return False
