"""One recorded op replayed: its function found again, its arguments rebuilt, run in float64 on the CPU.

Why here: ``portspeed precheck`` judges a device's ops with no golden run, by replaying each op of
an op-level dump (``docs/probe-format.md``) against a float64 CPU result. This module knows how
the recorder wrote an op: ``<Family>.<name>.<c>.forward`` keys (``Functional`` = torch.nn.functional,
``Tensor`` = a Tensor method, ``Torch`` = a torch function, ``Kernel`` = a portable Transformer
Engine operation, ``portspeed.probe.kernel_calls``), every non-tensor argument in msprobe's
``{type, value}`` form (``entries.encode``), tensors as statistics and, with ``--probe-tensors``,
as saved files (``data_name``).

- ``op_of`` finds the functions: the torch function by its recorded name; a kernel's REFERENCE
  implementation as the oracle and, for a replay on the device, the implementation the run used
  (``ps_impl``: vendor / torch / reference, taken from the active adapter and
  ``portable_te.kernels.TABLE``).
- ``saved_inputs`` / ``generated_inputs`` rebuild the arguments: the saved tensors exactly, or
  tensors drawn from the recorded statistics as msprobe's ``acc_check`` does (uniform in
  ``[Min, Max]``, both extremes placed; integers in ``[Min, Max]``; booleans True with the recorded
  mean's probability).
- ``run`` calls the function with every tensor on a device and in a dtype; with ``float64`` every
  floating tensor is float64 and every floating dtype the function asks for is float64 too (a
  ``TorchFunctionMode`` widens ``.float()``, ``.to(torch.bfloat16)``, ``dtype=`` ..., so a kernel that
  "upcasts to fp32" computes in float64).

Ops that cannot be replayed raise ``NotReplayable`` with the reason: a random draw (dropout with
``p > 0``, ``rand*``), uninitialised memory (``empty*``), a collective, an argument that was not
recorded by value (a process group, an object), a function this torch does not have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import zlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["NotReplayable", "Op", "op_of", "saved_inputs", "saved_outputs", "generated_inputs", "run",
           "tensor_records", "dtype_of", "FAMILIES"]

#: the key families a replay understands (``Distributed`` and ``Module`` entries are not ops to replay)
FAMILIES = ("Functional", "Tensor", "Torch", "Kernel")
_RANDOM = {"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
           "bernoulli_", "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_",
           "log_normal_", "random_", "poisson", "rrelu", "rrelu_", "native_dropout", "fused_dropout"}
_DROPOUT = {"dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"}
_UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
_NARROW = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)  # methods that pick a floating dtype


class NotReplayable(Exception):
    """An op that cannot be replayed; ``str()`` is the reason, short (the summary groups by it)."""


@dataclasses.dataclass(frozen=True)
class Op:
    """A recorded op, with the functions to replay it."""

    family: str
    name: str
    #: the oracle, run in float64 on the CPU (a kernel's reference; a torch function itself)
    reference: Callable
    #: what the run ran, resolved on the active adapter only when needed (``device()``)
    impl: str | None = None

    def device(self) -> Callable:
        """The implementation the run used: a torch function itself; a kernel by ``ps_impl`` on the active adapter."""
        if self.family != "Kernel":
            return self.reference
        from portspeed.accelerator import selection
        from portspeed.accelerator.kernel_ops import resolve_kernel
        from portspeed.portable_te import kernels

        if self.impl == "vendor":
            acc = selection.get_accelerator()
            declared = acc.kernels().get(self.name)
            if declared is None:
                raise NotReplayable(f"the run's {self.name} was a vendor kernel; adapter {acc.name!r} declares none")
            return resolve_kernel(acc.name, self.name, declared)
        path = getattr(kernels.TABLE[self.name], self.impl or "reference") or kernels.TABLE[self.name].reference
        return kernels.import_path(path)


def op_of(key: str, entry: dict[str, Any]) -> Op:
    """The op an entry recorded, or NotReplayable (why)."""
    family = key.split(".", 1)[0]
    name = entry.get("ps_op") or key.split(".")[1]
    if family == "Distributed":
        raise NotReplayable("a collective")
    if family not in FAMILIES:
        raise NotReplayable(f"family {family}")
    if name in _RANDOM or (family == "Kernel" and _number(entry, "dropout_p", 99) not in (None, 0, 0.0)):
        raise NotReplayable("draws random numbers")
    if name in _DROPOUT and _number(entry, "p", 1) not in (0, 0.0) and _number(entry, "training", 2) is not False:
        raise NotReplayable("draws random numbers")
    if name in _UNINITIALISED:
        raise NotReplayable("uninitialised memory")
    if family == "Kernel":
        from portspeed.portable_te import kernels

        if name not in kernels.TABLE:
            raise NotReplayable(f"kernel {name} unknown to this portspeed")
        return Op(family, name, kernels.import_path(kernels.TABLE[name].reference), entry.get("ps_impl"))
    fn = _torch_function(family, name)
    if fn is None:
        raise NotReplayable(f"{family}.{name} not in this torch")
    return Op(family, name, fn)


def _number(entry: dict[str, Any], kw: str, position: int) -> Any:
    """A scalar argument by keyword, else by position (None where absent)."""
    v = entry.get("input_kwargs", {}).get(kw)
    if v is None:
        args = entry.get("input_args", [])
        v = args[position] if position < len(args) else None
    return v.get("value") if isinstance(v, dict) and "value" in v else v


def _torch_function(family: str, name: str) -> Callable | None:
    if family == "Tensor":
        return getattr(torch.Tensor, name, None)
    if family == "Functional":
        return getattr(F, name, None) or getattr(torch._C._nn, name, None)
    fn = getattr(torch, name, None)
    for prefix, module in (("linalg_", torch.linalg), ("special_", torch.special), ("fft_", torch.fft)):
        if fn is None and name.startswith(prefix):
            fn = getattr(module, name[len(prefix):], None)
    return fn if callable(fn) else None


def dtype_of(rec: dict[str, Any]) -> torch.dtype:
    """A tensor record's dtype (``"torch.float32"`` -> torch.float32)."""
    dt = getattr(torch, str(rec.get("dtype", "")).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise NotReplayable(f"dtype {rec.get('dtype')}")
    return dt


def tensor_records(value: Any) -> Iterator[dict[str, Any]]:
    """Every tensor record inside an argument (lists and dicts searched)."""
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            yield value
        elif "type" not in value:
            for v in value.values():
                yield from tensor_records(v)
    elif isinstance(value, list):
        for v in value:
            yield from tensor_records(v)


class _Device:
    """A recorded ``torch.device`` argument: replaced by the device a replay runs on."""


def _decode(value: Any, tensor: Callable[[dict[str, Any]], torch.Tensor]) -> Any:
    """An argument rebuilt from its record (``tensor`` makes each tensor)."""
    if value is None:
        return None
    if isinstance(value, list):
        return [_decode(v, tensor) for v in value]
    if not isinstance(value, dict):
        raise NotReplayable("a malformed argument")
    kind = value.get("type")
    if kind is None:
        return {k: _decode(v, tensor) for k, v in value.items()}
    v = value.get("value")
    if kind == "torch.Tensor":
        return tensor(value)
    if kind in ("int", "bool", "str"):
        return v
    if kind == "float":
        return float(v)
    if kind == "torch.Size":
        return torch.Size(v)
    if kind == "slice":
        return slice(*v)
    if kind == "ellipsis":
        return Ellipsis
    if kind == "torch.device":
        return _Device()
    if kind in ("torch.dtype", "torch.memory_format", "torch.layout"):
        return getattr(torch, str(v).replace("torch.", ""))
    raise NotReplayable(f"a {kind.split('.')[-1]} argument")


def _decode_call(entry: dict[str, Any], tensor: Callable[[dict[str, Any]], torch.Tensor]) -> tuple[list, dict]:
    args = [_decode(a, tensor) for a in entry.get("input_args", [])]
    kwargs = {k: _decode(v, tensor) for k, v in entry.get("input_kwargs", {}).items()}
    if entry.get("ps_op") in ("__getitem__", "__setitem__") and len(args) > 1 and isinstance(args[1], list):
        args[1] = tuple(args[1])  # an index tuple was written as a list
    return args, kwargs


def saved_inputs(entry: dict[str, Any], folder: str) -> tuple[list, dict]:
    """The arguments with the tensors ``--probe-tensors`` saved (NotReplayable when one was not saved)."""
    return _decode_call(entry, lambda rec: _load(rec, folder))


def saved_outputs(entry: dict[str, Any], folder: str) -> list[torch.Tensor | None]:
    """The run's own outputs as saved (None for an output that is not a tensor)."""
    return [_load(r, folder) if isinstance(r, dict) and r.get("type") == "torch.Tensor" else None
            for r in entry.get("output", [])]


def _load(rec: dict[str, Any], folder: str) -> torch.Tensor:
    name = rec.get("data_name")
    path = os.path.join(folder, "tensors", name) if name else None
    if path is None or not os.path.isfile(path):
        raise NotReplayable("tensors not saved")
    return torch.load(path, map_location="cpu", weights_only=True)


def generated_inputs(entry: dict[str, Any], seed: str) -> tuple[list, dict]:
    """The arguments with tensors drawn from their statistics (the same ``seed`` gives the same tensors)."""
    if entry.get("ps_op") == "grouped_mm":
        raise NotReplayable("offsets not generable")  # cumulative group ends: no statistic says them
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    return _decode_call(entry, lambda rec: _generate(rec, gen))


def _generate(rec: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    dtype, shape = dtype_of(rec), [int(s) for s in rec.get("shape", [])]
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    lo, hi, mean = rec.get("Min"), rec.get("Max"), rec.get("Mean")
    nan, inf = int(rec.get("ps_nan") or 0), int(rec.get("ps_inf") or 0)
    if dtype.is_floating_point and (nan == n or (inf == n and lo == hi)):
        return torch.full(shape, math.nan if nan == n else lo, dtype=dtype)  # all NaN, or all one infinity: exact
    if lo is None or hi is None:
        raise NotReplayable("no statistics")
    if not (math.isfinite(lo) and math.isfinite(hi)) or nan + inf:
        raise NotReplayable("non-finite input")  # where the non-finite elements sat is not recorded
    if dtype == torch.bool:
        t = torch.rand(n, generator=gen, dtype=torch.float64) < float(mean)
    elif not (dtype.is_floating_point or dtype.is_complex):
        t = torch.randint(int(lo), int(hi) + 1, (n,), generator=gen, dtype=torch.int64)
    else:
        t = lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)
    if n >= 2 and dtype != torch.bool:
        t[0], t[-1] = hi, lo  # both recorded extremes present, as msprobe places them
    return t.reshape(shape).to(dtype)


class _Float64(TorchFunctionMode):
    """Every floating dtype a torch function is asked for becomes float64 (``.float()`` too)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _NARROW:
            func = torch.Tensor.double
        return func(*[_wide(a) for a in args], **{k: _wide(v) for k, v in (kwargs or {}).items()})


def _wide(v: Any) -> Any:
    if isinstance(v, torch.dtype) and v.is_floating_point:
        return torch.float64
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.dtype) for x in v):
        return type(v)(_wide(x) for x in v)
    return v


@contextlib.contextmanager
def _float64() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64():
            yield
    finally:
        torch.set_default_dtype(before)


def _place(value: Any, device: torch.device, float64: bool) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if float64 and t.is_floating_point():
            t = t.to(torch.float64)
        return t.to(device).clone()  # a fresh tensor: an in-place op writes its own copy
    if isinstance(value, _Device):
        return device
    if isinstance(value, list):
        return [_place(v, device, float64) for v in value]
    if isinstance(value, tuple):
        return tuple(_place(v, device, float64) for v in value)
    if isinstance(value, dict):
        return {k: _place(v, device, float64) for k, v in value.items()}
    return value


def run(fn: Callable, args: list, kwargs: dict, device: torch.device | str, *, float64: bool) -> list[Any]:
    """``fn(*args, **kwargs)`` with every tensor on ``device`` (and float64 throughout with ``float64``): the
    output's leaves as the recorder lists them, tensors on the CPU."""
    device = torch.device(device)
    a, kw = _place(args, device, float64), _place(kwargs, device, float64)
    with torch.no_grad(), (_float64() if float64 else contextlib.nullcontext()):
        out = fn(*a, **kw)
    if out is None and a and isinstance(a[0], torch.Tensor):
        out = a[0]  # __setitem__: what it wrote is its first argument (as the recorder lists it)
    return [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in tree_flatten(out)[0]]
