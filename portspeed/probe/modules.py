"""Module-level recording: every module's outputs (all tensors) and their gradients, under canonical paths.

Why canonical paths: two runs in different layouts must name the same module the same way. A
path is taken below the wrappers (Megatron's DDP and Float16Module, DeepSpeed's engine, torch's
DDP: their ``module.`` prefixes go), ``decoder.layers.<i>`` is renumbered to the global layer
(``TransformerLayer.layer_number - 1``: a PP2 or VPP stage names layer 2 as a one-stage run does)
and a MoE local expert ``experts.local_experts.<i>`` to its global index
(``MoELayer.local_expert_indices``). The root model is not recorded (msprobe does not either).

Hooks (installed for one iteration, removed at its end; they return None and change nothing):
- a forward pre-hook on each model chunk: a micro-batch of that chunk begins;
- a forward hook on each selected module: its output tensors' statistics, its inputs' when asked,
  and a tensor hook on each output that requires grad, whose gradient becomes the module's
  ``backward.<n>`` entry (``input``: the gradients of its outputs, in output order);
- at op level, a forward pre-hook too, so that ops know their innermost module and call.

A forward run while autograd's engine runs (``torch._C._current_graph_task_id() != -1``) is an
activation recompute's re-run: it gets a ``recompute.<n>`` entry (``ps_recompute``) whose ``n`` is
the call it re-runs (the oldest call of that module whose outputs had no gradient to hook, so the
gradient hooks go on the re-run's outputs and land in the original call's ``backward.<n>``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import traceback
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from portspeed.probe import sharding as lay
from portspeed.probe.entries import IterationRecord

__all__ = ["ModuleInfo", "ModuleTable", "ModuleHooks", "unwrap", "WRAPPERS"]

#: wrapper classes whose ``module`` attribute is the model (their path prefix is dropped)
WRAPPERS = {"DistributedDataParallel", "Float16Module", "DeepSpeedEngine", "FullyShardedDataParallel",
            "PipelineEngine", "DataParallel", "OptimizedModule"}
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)(?=\.|$)")
_MEGATRON_LAYERS = re.compile(r"^(.*?(?:^|\.)layers)\.(\d+)$")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model below its wrappers (``.module`` of DDP, Float16Module, DeepSpeedEngine, ...; ``_orig_mod``)."""
    while True:
        name = type(model).__name__
        inner = getattr(model, "_orig_mod", None) if name == "OptimizedModule" else getattr(model, "module", None)
        if name in WRAPPERS and isinstance(inner, torch.nn.Module):
            model = inner
        else:
            return model


@dataclasses.dataclass(eq=False)
class ModuleInfo:
    """One module of the model as the dump names it."""

    module: torch.nn.Module
    path: str  # canonical
    local_path: str  # this rank's path below the wrappers
    cls: str
    chunk: int
    layer: int | None  # global transformer layer from the path, None outside the layers
    expert: int | None
    selected: bool
    calls: int = 0  # forward calls this iteration (recompute re-runs not counted)
    open_calls: list[int] = dataclasses.field(default_factory=list)  # op level: calls entered, not yet left
    awaiting_recompute: list[tuple[int, dict]] = dataclasses.field(default_factory=list)  # (call, its ps_* fields)
    call_site: tuple[str, ...] | None = None  # stack.json: where the model called it first (found once per process)

    layouts: dict = dataclasses.field(default_factory=dict)  # (gradient?, index, parallel) -> layout, made once

    def layout(self, index: int, parallel: lay.Parallel) -> dict[str, Any]:
        """The layout of this module's output ``index`` (one dict per output, shared by every entry)."""
        got = self.layouts.get((False, index, parallel))
        if got is None:
            got = self.layouts[(False, index, parallel)] = lay.output_layout(self.module, index, parallel,
                                                                             self.path.rsplit(".", 1)[-1])
        return got

    def grad_layout(self, index: int, parallel: lay.Parallel) -> dict[str, Any]:
        """The layout of the gradient of this module's output ``index``."""
        got = self.layouts.get((True, index, parallel))
        if got is None:
            got = self.layouts[(True, index, parallel)] = lay.grad_layout(self.module, index, parallel,
                                                                          self.path.rsplit(".", 1)[-1])
        return got


def _renames(root: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """local path -> (its last segment renamed, expert) for Megatron's layers and local experts."""
    out: dict[str, tuple[str, int | None]] = {}
    for name, mod in root.named_modules():
        number = getattr(mod, "layer_number", None)
        if _MEGATRON_LAYERS.match(name) and isinstance(number, int) and not isinstance(number, bool):
            out[name] = (str(number - 1), None)
        indices = getattr(mod, "local_expert_indices", None)
        experts = getattr(getattr(mod, "experts", None), "local_experts", None)
        if isinstance(indices, (list, tuple)) and experts is not None:
            for i, g in enumerate(indices):
                out[f"{name}.experts.local_experts.{i}" if name else f"experts.local_experts.{i}"] = (str(int(g)),
                                                                                                      int(g))
    return out


def _canonical(name: str, renames: dict[str, tuple[str, int | None]]) -> tuple[str, int | None]:
    """``name`` with every renamed segment replaced, and the global expert it lies in (None outside experts)."""
    local: list[str] = []
    out: list[str] = []
    expert = None
    for part in name.split("."):
        local.append(part)
        new = renames.get(".".join(local))
        if new is None:
            out.append(part)
        else:
            out.append(new[0])
            expert = new[1] if new[1] is not None else expert
    return ".".join(out), expert


class ModuleTable:
    """The recorded modules of a list of model chunks, with canonical paths (built once per chunk list)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], modules_glob: str | None) -> None:
        self.chunks = list(chunks)
        self.roots = [unwrap(c) for c in self.chunks]
        self.infos: list[ModuleInfo] = []
        for c, root in enumerate(self.roots):
            renames = _renames(root)
            for name, mod in root.named_modules():
                if mod is root:
                    continue
                path, expert = _canonical(name, renames)
                m = _LAYER.search(path)
                layer = int(m.group(1)) if m else None
                selected = modules_glob is None or fnmatch.fnmatchcase(path, modules_glob)
                self.infos.append(ModuleInfo(mod, path, name, type(mod).__name__, c, layer, expert, selected))
        config = getattr(self.roots[0], "config", None) if self.roots else None
        layers = getattr(config, "num_layers", None)
        if not isinstance(layers, int):
            seen = [i.layer for i in self.infos if i.layer is not None]
            layers = max(seen) + 1 if seen else 0
        self.num_layers = layers

    def reset(self) -> None:
        for info in self.infos:
            info.calls = 0
            info.open_calls.clear()
            info.awaiting_recompute.clear()


_NO_KWARGS: dict = {}


def _leaves(output: Any) -> list:
    """A module's outputs in order: a tensor, a flat tuple or list as it is, anything else through torch's pytree."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in output):
        return list(output)
    return tree_flatten(output)[0]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_SKIP_FRAMES = ("torch/nn/modules/module.py", "/portspeed/probe/", "/portspeed/patching/", "wrapt/")


def _call_site() -> tuple[str, ...]:
    """msprobe's frame strings of the stack, innermost first, without torch's and the probe's own frames."""
    frames = traceback.extract_stack()[:-1]
    return tuple(f"File {f.filename}, line {f.lineno}, in {f.name}, \n {f.line}" for f in reversed(frames)
                 if not any(s in f.filename for s in _SKIP_FRAMES))


class ModuleHooks:
    """The hooks of one iteration (see the module docstring); ``remove()`` takes every one off."""

    def __init__(self, table: ModuleTable, record: IterationRecord, parallel: lay.Parallel, *, inputs: bool,
                 op_level: bool, on_micro_batch: Callable[[int], None]) -> None:
        self.table, self.record, self.parallel = table, record, parallel
        self.inputs, self.op_level = inputs, op_level
        self.on_micro_batch = on_micro_batch
        self.stack: list[tuple[ModuleInfo, int]] = []  # op level: the modules being run, innermost last
        self.stacks: dict[tuple[str, ...], list[str]] = {}  # stack.json: frames -> keys (first calls only)
        self.parents: dict[str, str | None] = {}  # construct.json
        self._handles: list[Any] = []
        self._leaf_waiting: dict[int, list[tuple[tuple[int, int], Callable]]] = {}  # id(leaf): (mb, hook) oldest first
        self._seen_layer = False

    # ------------------------------------------------------------ install / remove
    def install(self) -> "ModuleHooks":
        self.table.reset()
        for c, chunk in enumerate(self.table.chunks):
            self._handles.append(chunk.register_forward_pre_hook(self._root_hook(c)))
        every = not self.record.full  # flags look at every module; statistics at the selected ones
        for info in self.table.infos:
            if not (every or info.selected or self.op_level):
                continue
            if self.op_level:
                self._handles.append(info.module.register_forward_pre_hook(self._pre_hook(info)))
            post = self._post_hook(info)
            if self.inputs or self.record.full and self.record.saves_any:
                self._handles.append(info.module.register_forward_hook(post, with_kwargs=True))
            else:  # no inputs recorded: the cheaper hook torch calls without the keyword arguments
                self._handles.append(info.module.register_forward_hook(
                    lambda m, args, out, post=post: post(m, args, _NO_KWARGS, out)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._leaf_waiting.clear()

    # ------------------------------------------------------------ hooks
    def _root_hook(self, chunk: int) -> Callable:
        def root_pre(module: torch.nn.Module, args: Any) -> None:
            if _in_backward():
                return None
            self.stack.clear()
            self._seen_layer = False
            self.on_micro_batch(chunk)
            return None
        return root_pre

    def _pre_hook(self, info: ModuleInfo) -> Callable:
        def pre(module: torch.nn.Module, args: Any) -> None:
            if _in_backward():
                self.stack.append((info, -1))
                return None
            n = info.calls
            info.calls += 1
            info.open_calls.append(n)
            self.stack.append((info, n))
            return None
        return pre

    def innermost(self) -> tuple[ModuleInfo, int] | None:
        """The innermost module running now and its call index (op level)."""
        return self.stack[-1] if self.stack else None

    def _layer_of(self, info: ModuleInfo) -> int:
        if info.layer is not None:
            self._seen_layer = True
            return info.layer
        return self.table.num_layers if self._seen_layer else -1

    def _base(self, info: ModuleInfo, phase: str, mb: int, chunk: int) -> dict[str, Any]:
        e = {"ps_micro_batch": mb, "ps_chunk": chunk, "ps_phase": phase, "ps_module": info.path,
             "ps_class": info.cls, "ps_local_path": info.local_path, "ps_layer": self._layer_of(info)}
        if info.expert is not None:
            e["ps_expert"] = info.expert
        return e

    def _post_hook(self, info: ModuleInfo) -> Callable:
        def post(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            rec = self.record
            leaves = _leaves(output)
            if _in_backward():
                if self.op_level and self.stack:
                    self.stack.pop()
                self._recompute(info, args, kwargs, leaves)
                return None
            if self.op_level:
                if self.stack:
                    self.stack.pop()
                n = info.open_calls.pop() if info.open_calls else info.calls - 1
            else:
                n = info.calls
                info.calls += 1
            if rec.full and not info.selected:
                return None
            base = self._base(info, "forward", rec.micro_batch, rec.chunk)
            key = f"Module.{info.path}.{info.cls}.forward.{n}"
            if rec.full:
                self._forward_entry(info, key, n, args, kwargs, leaves, base)
            else:
                for i, t in enumerate(leaves):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        rec.flag(t, key, "output", i, base)
            if torch.is_grad_enabled():
                self._hook_grads(info, n, leaves, base)
            elif any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
                # no graph is built (activation checkpointing's first pass; an output may still say
                # requires_grad, a checkpoint's input handed through): the re-run's outputs get the hooks
                info.awaiting_recompute.append((n, base))
            return None
        return post

    def _forward_entry(self, info: ModuleInfo, key: str, n: int, args: tuple, kwargs: dict, leaves: list,
                       base: dict[str, Any], *, recompute: bool = False) -> None:
        rec = self.record
        entry = dict(base)
        if recompute:
            entry["ps_recompute"] = True
        save = rec.saves(key)
        if self.inputs or save:
            inp = lay.unknown(self.parallel)  # an input's spread is its producer's: unknown here
            entry["input_args"] = [rec.value(a, key, "input_args", i, inp, save) for i, a in enumerate(args)]
            entry["input_kwargs"] = {k: rec.value(v, key, f"input_kwargs.{k}", 0, inp, save)
                                     for k, v in kwargs.items()}
        else:
            entry["input_args"], entry["input_kwargs"] = [], {}
        entry["output"] = [rec.value(t, key, "output", i, info.layout(i, self.parallel), save)
                           for i, t in enumerate(leaves)]
        rec.add(key, entry)
        self.parents[key] = self._parent_key(info, "forward")
        if n == 0 and not recompute and info.call_site is None:
            info.call_site = _call_site()
        if n == 0 and not recompute:
            self.stacks.setdefault(info.call_site, []).append(key)

    def _parent_key(self, info: ModuleInfo, phase: str) -> str | None:
        """The enclosing module call's key (op level, where the stack is known), else None."""
        for other, n in reversed(self.stack):
            if other is not info and n >= 0:
                return f"Module.{other.path}.{other.cls}.{phase}.{n}"
        return None

    def _hook_grads(self, info: ModuleInfo, n: int, leaves: list, base: dict[str, Any]) -> bool:
        idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return False
        key = f"Module.{info.path}.{info.cls}.backward.{n}"
        back = {**base, "ps_phase": "backward"}
        back.pop("ps_recompute", None)
        for i in idx:
            hook = self._grad_hook(info, key, i, len(leaves), back)
            if leaves[i].grad_fn is None:  # a leaf handed back as an output (a bias parameter)
                self._leaf_hook(leaves[i], hook, (back["ps_micro_batch"], back["ps_chunk"]))
            else:
                leaves[i].register_hook(hook)
        return True

    def _leaf_hook(self, leaf: torch.Tensor, hook: Callable, micro_batch: tuple[int, int]) -> None:
        """A leaf handed back by every call (a bias parameter) is one tensor: a hook per call would fire in every
        later backward pass too (micro-batch 0's entry overwritten with micro-batch 1's gradient). So the leaf gets
        one hook for the iteration (taken off at its end), and each gradient that reaches it, once per backward
        pass, goes to the oldest calls still waiting: those of one micro-batch (Megatron's schedules, and a loop,
        run backward passes in their forwards' order, per model chunk)."""
        waiting = self._leaf_waiting.get(id(leaf))
        if waiting is None:
            waiting = self._leaf_waiting[id(leaf)] = []

            def first_waiting(g: torch.Tensor) -> None:
                mb = waiting[0][0] if waiting else None
                while waiting and waiting[0][0] == mb:
                    waiting.pop(0)[1](g)
                return None
            self._handles.append(leaf.register_hook(first_waiting))
        waiting.append((micro_batch, hook))

    def _grad_hook(self, info: ModuleInfo, key: str, i: int, width: int, base: dict[str, Any]) -> Callable:
        def grad(g: torch.Tensor) -> None:
            rec = self.record
            if rec is None or g is None:
                return None
            if not rec.full:
                rec.flag(g, key, "input", i, base)
                return None
            entry = rec.entries.get(key)
            if entry is None:
                entry = rec.add(key, {**base, "input": [None] * width, "output": []})
                self.parents[key] = None
            entry["input"][i] = rec.tensor(g, key, "input", i, info.grad_layout(i, self.parallel), rec.saves(key))
            return None
        return grad

    def _recompute(self, info: ModuleInfo, args: tuple, kwargs: dict, leaves: list) -> None:
        """A forward re-run inside backward: the grads of its outputs belong to the call it re-runs."""
        rec = self.record
        if not info.awaiting_recompute or (rec.full and not info.selected):
            return
        n, base = info.awaiting_recompute.pop(0)
        if rec.full:
            key = f"Module.{info.path}.{info.cls}.recompute.{n}"
            self._forward_entry(info, key, n, args, kwargs, leaves, base, recompute=True)
        self._hook_grads(info, n, leaves, base)

    def detach(self) -> None:
        """After the iteration: tensor hooks that fire later (a graph kept alive) record nothing."""
        self.record = None  # type: ignore[assignment]
