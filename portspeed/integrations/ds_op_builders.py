"""Which op builders a portspeed-backed DeepSpeed accelerator offers: the vendor slot, torch, host, refusal.

Why: DeepSpeed asks its accelerator for op builders by class name (``get_op_builder``,
``create_op_builder``) and loads the kernel they build. portspeed answers, in this order:

1. the adapter's own kernels, declared in ``Accelerator.deepspeed_ops()`` (the vendor op-builder
   slot): ``{builder class name: "module[:attr]"}`` naming a DeepSpeed ``OpBuilder`` subclass, or the
   op module itself (served by a builder whose ``load()`` returns it: nothing to compile);
2. portspeed's torch implementations (``TORCH_OPS``: ``QuantizerBuilder``, what ZeRO++ loads);
3. DeepSpeed's host builders (``HOST_OP_BUILDERS``: offload and async I/O run on the host whatever
   the device), with an install hint where DeepSpeed's own error names no package;
4. for any other device kernel, a builder class that reports itself incompatible and, when loaded,
   raises ``PortspeedError`` naming the kernel, the adapter and the fix: DeepSpeed's torch path
   where one exists (``TORCH_PATHS``), else a kernel declared through the slot.

DeepSpeed's own CPU comm kernels are withheld, since their collectives would bypass the process
group and so the adapter's backend. A declaration that does not resolve, names no DeepSpeed
builder, or lacks an op the module must have (``OP_MODULE_MEMBERS``) fails in one line when
DeepSpeed first asks for builders (its ``deepspeed.ops.op_builder`` import).

Limits: the builder classes import DeepSpeed's ``OpBuilder``; call these only once DeepSpeed is
imported (the accelerator object is built from DeepSpeed's import hook).
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any

from portspeed.accelerator import Accelerator
from portspeed.errors import PortspeedError

__all__ = ["COMM_OP_BUILDERS", "HOST_OP_BUILDERS", "OP_MODULE_MEMBERS", "TORCH_OPS", "TORCH_PATHS",
           "deepspeed_builder_names", "host_builder", "module_builder", "served_builder", "unavailable_builder"]

#: DeepSpeed op builders whose kernels do collectives themselves, bypassing torch.distributed.
COMM_OP_BUILDERS = frozenset({"ShareMemCommBuilder", "CCLCommBuilder"})

#: DeepSpeed op builders whose kernels run on the host whatever the device: optimizer steps
#: on host (offloaded) partitions, NVMe async I/O, page-locked host buffers.
HOST_OP_BUILDERS = frozenset({"CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "AsyncIOBuilder",
                              "PinMemoryBuilder"})

#: DeepSpeed ops portspeed implements in torch operators: the default on every adapter that declares none
TORCH_OPS = {"QuantizerBuilder": "portspeed.integrations.ds_quantizer"}

#: what an op module served for a builder must hold (DeepSpeed calls these on ``load()``'s result)
OP_MODULE_MEMBERS = {
    "QuantizerBuilder": ("quantize", "dequantize", "swizzle_quant", "quantized_reduction", "Symmetric", "Asymmetric"),
}

#: DeepSpeed's own way around a device kernel, where it has one (the refusal names it)
TORCH_PATHS = {
    "FusedAdamBuilder": "\"torch_adam\": true in the Adam optimizer's params (torch's Adam)",
    "FusedLambBuilder": "a torch optimizer passed to deepspeed.initialize instead of \"type\": \"Lamb\"",
    "FusedLionBuilder": "\"offload_optimizer\" to the cpu (DeepSpeed's host Lion), or a torch optimizer",
    "InferenceBuilder": "deepspeed.init_inference(..., replace_with_kernel_inject=False)",
    "InferenceCoreBuilder": "deepspeed.init_inference(..., replace_with_kernel_inject=False)",
    "RandomLTDBuilder": "\"random_ltd\" off in \"data_efficiency\"",
    "DeepCompileBuilder": "\"compile\": {\"deepcompile\": false}",
    "GDSBuilder": "\"nvme\" offload through async I/O (AsyncIOBuilder, offered) instead of GPUDirect Storage",
}

#: what to install when a host op cannot be built (DeepSpeed's own error names no package)
INSTALL_HINTS = {
    "AsyncIOBuilder": "DeepSpeed's async I/O op (ZeRO-Infinity's NVMe offload) needs libaio's headers and library: "
                      "on Debian/Ubuntu run `apt-get install -y libaio-dev` as root (portspeed's set-up: `make "
                      "sysdeps`), elsewhere libaio's development package; then run again (the op is JIT-built)",
}
_hinted: dict[type, type] = {}
_served: dict[tuple[str, str, int], type] = {}
_names: list[frozenset[str]] = []


def host_builder(builder: type) -> type:
    """DeepSpeed's host builder class, or (``INSTALL_HINTS``) a subclass whose ``load`` fails naming what to install.

    DeepSpeed's own ``load`` on a machine without libaio raises "Unable to JIT load the async_io
    op due to it not being compatible due to hardware/software issue. None", which says
    neither what is missing nor how to get it.
    """
    hint = INSTALL_HINTS.get(builder.__name__)
    if hint is None:
        return builder
    if builder not in _hinted:
        def load(self: Any, verbose: bool = True) -> Any:
            if not self.is_compatible(verbose=False):
                raise PortspeedError(f"cannot build DeepSpeed's {builder.__name__} on this machine. {hint}")
            return builder.load(self, verbose=verbose)

        _hinted[builder] = type(builder.__name__, (builder,), {"load": load, "__module__": builder.__module__,
                                                                "__doc__": host_builder.__doc__})
    return _hinted[builder]


def deepspeed_builder_names() -> frozenset[str]:
    """The op-builder class names of the installed DeepSpeed (what a ``deepspeed_ops()`` key may be)."""
    if not _names:
        import deepspeed.ops.op_builder as package

        found = set()
        for info in pkgutil.iter_modules(package.__path__):
            if info.name in ("all_ops", "builder") or info.ispkg:
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            found.update(n for n in vars(module) if n.endswith("Builder") and n not in ("OpBuilder", "CUDAOpBuilder"))
        _names.append(frozenset(found | HOST_OP_BUILDERS | COMM_OP_BUILDERS))
    return _names[0]


def module_builder(class_name: str, op_module: Any, origin: str) -> type:
    """A DeepSpeed builder class for an op already in Python: ``load()`` returns ``op_module``, nothing is built."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    where = getattr(op_module, "__name__", type(op_module).__qualname__)

    class ServedBuilder(OpBuilder):
        NAME = f"portspeed_{class_name}"
        BUILD_VAR = "DS_BUILD_PORTSPEED_SERVED"

        def __init__(self, name: str | None = None) -> None:
            super().__init__(name=self.NAME if name is None else name)

        def absolute_name(self) -> str:
            return where

        def sources(self) -> list[str]:
            return []

        def is_compatible(self, verbose: bool = False) -> bool:
            return True

        def load(self, verbose: bool = True) -> Any:
            return op_module

        def jit_load(self, verbose: bool = True) -> Any:
            return op_module

    ServedBuilder.__name__ = ServedBuilder.__qualname__ = class_name
    ServedBuilder.served_by = origin  # type: ignore[attr-defined]
    return ServedBuilder


def _resolve(adapter: Accelerator, class_name: str, spec: Any) -> Any:
    if not isinstance(spec, str):
        return spec
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        return getattr(obj, attr) if attr else obj
    except (ImportError, AttributeError) as exc:
        raise PortspeedError(f"the {adapter.name!r} adapter's deepspeed_ops() serves {class_name} with {spec!r}, "
                             f"which does not resolve ({type(exc).__name__}: {exc}); give 'module' or "
                             "'module:attr' of an installed package") from exc


def _check_names(adapter: Accelerator, declared: dict[str, Any]) -> None:
    known = deepspeed_builder_names()
    for name in declared:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise PortspeedError(
                f"the {adapter.name!r} adapter's deepspeed_ops() names {name!r}, which is not one of DeepSpeed's op "
                f"builders{f' (did you mean {close[0]!r}?)' if close else ''}; keys are builder class names such as "
                "'QuantizerBuilder' or 'FusedAdamBuilder'")


def served_builder(class_name: str, adapter: Accelerator) -> type | None:
    """The builder for ``class_name`` from the adapter's slot, else portspeed's torch implementation, else None."""
    declared = type(adapter).deepspeed_ops()
    if class_name in declared:
        spec, origin = declared[class_name], f"the {adapter.name!r} adapter's deepspeed_ops()"
    elif class_name in TORCH_OPS:
        spec, origin = TORCH_OPS[class_name], "portspeed's torch implementation"
    else:
        return None
    key = (class_name, spec if isinstance(spec, str) else repr(spec), id(adapter))
    if key in _served:
        return _served[key]
    if declared:
        _check_names(adapter, declared)
    from deepspeed.ops.op_builder.builder import OpBuilder

    obj = _resolve(adapter, class_name, spec)
    if isinstance(obj, type) and issubclass(obj, OpBuilder):
        builder = obj
    elif isinstance(obj, type):
        raise PortspeedError(f"{origin} serves {class_name} with the class {obj.__qualname__}, which is no DeepSpeed "
                             "OpBuilder; give an OpBuilder subclass or the op module itself")
    else:
        missing = [m for m in OP_MODULE_MEMBERS.get(class_name, ()) if not hasattr(obj, m)]
        if missing:
            raise PortspeedError(f"{origin} serves {class_name} with {spec!r}, which lacks {', '.join(missing)}; "
                                 f"DeepSpeed calls {', '.join(OP_MODULE_MEMBERS[class_name])} on it")
        builder = module_builder(class_name, obj, origin)
    _served[key] = builder
    return builder


def unavailable_builder(class_name: str, adapter: Accelerator) -> type:
    """An op builder class standing for a device kernel the adapter has not: incompatible, and
    loading it raises a clear error naming the fix (instead of DeepSpeed calling None)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    torch_path = TORCH_PATHS.get(class_name)
    message = (
        f"DeepSpeed's {class_name} builds a CUDA kernel that the {adapter.name!r} adapter (device "
        f"{adapter.device_type!r}) does not serve. Fix: "
        + (f"use DeepSpeed's torch path, {torch_path}; or " if torch_path else "")
        + f"declare a kernel for it in the adapter's deepspeed_ops(), e.g. {{{class_name!r}: 'vendor_pkg.ops'}} "
        "(portspeed.vendor; docs/deepspeed.md, the op-builder slot). portspeed serves "
        f"{', '.join(sorted(TORCH_OPS))} in torch and DeepSpeed's host builders ({', '.join(sorted(HOST_OP_BUILDERS))})"
    )

    class UnavailableBuilder(OpBuilder):
        NAME = f"portspeed_unavailable_{class_name}"
        BUILD_VAR = "DS_BUILD_PORTSPEED_UNAVAILABLE"

        def __init__(self, name: str | None = None) -> None:
            super().__init__(name=self.NAME)

        def absolute_name(self) -> str:
            return f"portspeed.unavailable.{class_name}"

        def sources(self) -> list[str]:
            return []

        def is_compatible(self, verbose: bool = False) -> bool:
            if verbose:
                self.warning(message)
            return False

        def load(self, verbose: bool = True) -> Any:
            raise PortspeedError(message)

        def jit_load(self, verbose: bool = True) -> Any:
            raise PortspeedError(message)

    UnavailableBuilder.__name__ = UnavailableBuilder.__qualname__ = class_name
    UnavailableBuilder.unavailable_reason = message  # type: ignore[attr-defined]
    return UnavailableBuilder
