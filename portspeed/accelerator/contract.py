"""``Accelerator``: the device-abstraction contract every adapter implements.

An adapter (one file per device in ``portspeed.adapters``, or a third-party package through
the ``portspeed.adapters`` entry points) subclasses ``Accelerator`` and sets a few class
attributes; the base class delegates everything else to the device's torch module
(``torch.cuda``, ``torch.npu``, ``torch.xpu``...), so a vendor file stays small. The CPU
adapter overrides what the CPU has no notion of (streams, events, memory statistics) with
honest null objects. Where adapters come from: ``registry``; which one is active:
``selection``; the properties patches are gated on: ``conditions``.

Required: ``REQUIRED_MEMBERS`` (``name``, ``device_type``, ``backend``) have no default; a concrete
adapter class that lacks one is refused when it is defined, and again when it is selected, with
``AdapterContractError`` naming the member. An intermediate base that concrete adapters subclass
(``PrivateUse1Accelerator``) is declared with ``abstract=True`` and is exempt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from portspeed.accelerator.declarations import (STAGED_BACKEND, check_declarations, class_label, groups_backend,
                                                host_memory_bytes, unknown_total_memory)
from portspeed.errors import MissingVendorPackageError, PortspeedError

if TYPE_CHECKING:
    from portspeed.accelerator.backend_gaps import BackendGaps
    from portspeed.accelerator.capabilities import Capabilities

__all__ = ["Accelerator", "AdapterContractError", "REQUIRED_MEMBERS", "check_adapter", "host_memory_bytes",
           "missing_members"]

#: The members a concrete adapter must set, and what each one is; every other member has a working default.
REQUIRED_MEMBERS: dict[str, str] = {
    "name": "the name PORTSPEED_ACCELERATOR selects, e.g. 'acme'",
    "device_type": "the torch device type its tensors live on, e.g. 'acme' for torch.device('acme', 0)",
    "backend": "the c10d backend its collectives use, e.g. 'accl' (a PrivateUse1Accelerator subclass may leave it "
               "empty: it then uses the backend the vendor registered for its device type)",
}


class AdapterContractError(PortspeedError, TypeError):
    """An adapter class lacks a member the contract requires (``REQUIRED_MEMBERS``)."""


def missing_members(adapter: Any) -> list[str]:
    """The required members ``adapter`` (a class or an instance) leaves empty, in ``REQUIRED_MEMBERS``' order.

    ``backend`` counts as set where the class overrides ``default_backend()`` (PrivateUse1Accelerator:
    the backend registered for its device type).
    """
    cls = adapter if isinstance(adapter, type) else type(adapter)
    missing = []
    for member in REQUIRED_MEMBERS:
        value = getattr(adapter, member, None)
        if isinstance(value, str) and value.strip():
            continue
        if member == "backend" and getattr(cls.default_backend, "__func__", None) is not _BASE_DEFAULT_BACKEND:
            continue
        missing.append(member)
    return missing


def check_adapter(adapter: Any) -> None:
    """Raise AdapterContractError naming each required member ``adapter`` (class or instance) lacks."""
    missing = missing_members(adapter)
    if missing:
        cls = adapter if isinstance(adapter, type) else type(adapter)
        what = "; ".join(f"{m!r}: {REQUIRED_MEMBERS[m]}" for m in missing)
        s, them = ("s", "them") if len(missing) > 1 else ("", "it")
        raise AdapterContractError(
            f"adapter class {class_label(cls)} lacks the required member{s} {what}; set {them} as class attribute{s} "
            "(portspeed.vendor: the contract; a base class that adapters subclass passes abstract=True)")


class Accelerator:
    """One device family: its torch device, its collective backend, and device-runtime calls.

    Subclasses set ``name``, ``device_type``, ``backend`` and, for vendor devices,
    ``vendor_modules`` (import names that must load) and ``vendor_package`` (what to pip
    install), and declare what their backend lacks in ``backend_gaps``. Methods have
    working defaults that delegate to ``torch.<device_type>``; out-of-tree devices
    subclass ``portspeed.vendor.PrivateUse1Accelerator`` instead, which goes
    through ``torch.accelerator``. ``device()`` never returns None.
    """

    _abstract: ClassVar[bool] = True  # the contract itself; every subclass sets its own (__init_subclass__)
    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    backend: ClassVar[str] = ""
    vendor_modules: ClassVar[tuple[str, ...]] = ()
    vendor_package: ClassVar[str | None] = None
    #: The framework's CUDA code runs here as written (CUDA, ROCm): nothing is translated and
    #: no patch that replaces a CUDA path applies. Declared, never inferred from a name.
    runs_cuda_natively: ClassVar[bool] = False
    #: The device is the host: a device tensor is a host tensor and ``.cpu()`` is no copy.
    device_is_host: ClassVar[bool] = False
    #: True for adapters whose hardware has been run in this project's own tests.
    verified_on_hardware: ClassVar[bool] = False
    #: What this adapter's own collective backend lacks (None: nothing beyond the built-in
    #: defaults of ``portspeed.accelerator.capabilities``); the router rewrites what is listed.
    backend_gaps: ClassVar[BackendGaps | None] = None
    #: Device memory per device, in bytes, answered where the device cannot say (its runtime raises, as a new
    #: vendor's allocator often does for ``torch.accelerator.get_memory_info``). None: ask the device; if it cannot
    #: answer, ``total_memory`` degrades to the host's physical memory, with one warning naming this attribute.
    total_memory_bytes: ClassVar[int | None] = None
    #: Random ops on the device draw from the host's default generator (a device whose random ops run through the
    #: CPU fallback): portspeed's RNG calls (seed, state, the generators the framework forks) then serve the host's
    #: generator, the one the draws really use. Declared (``portspeed conformance`` says when it holds).
    host_generator: ClassVar[bool] = False
    #: Operations of the portable Transformer Engine (``portspeed.vendor.KERNEL_OPS``) whose torch form is wrong on
    #: this device (``portspeed conformance`` finds them): the kernel ladder skips torch for them, so the adapter's
    #: own kernel or portspeed's reference serves. Torch ops with no other rung (``host_rung.HOST_OPS``: matmul,
    #: softmax, gelu, cross_entropy...) named here are computed on the host, for every caller.
    wrong_torch_ops: ClassVar[tuple[str, ...]] = ()
    #: Collectives (``declarations.STAGEABLE``) the adapter's CCL lacks or gets wrong: staged through the host on
    #: Gloo (``portspeed.comm.staged``), the rest on ``backend``; its groups run on ``staged`` (``groups_backend``).
    #: ``backend = "staged"`` stages them all. ``portspeed conformance`` prints the line.
    staged_collectives: ClassVar[tuple[str, ...]] = ()
    #: The CCL is proven (conformance, hardware): no check of its collectives when the job's default group is made.
    ccl_verified: ClassVar[bool] = False

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        """Refuse, when the class is defined, a concrete adapter that lacks a required member."""
        super().__init_subclass__(**kwargs)
        cls._abstract = abstract  # per class: a subclass of an abstract base is concrete unless it says so
        check_declarations(cls, AdapterContractError)
        if not abstract:
            check_adapter(cls)

    def __init__(self, backend: str | None = None) -> None:
        self._backend_override = backend

    # -- identity -------------------------------------------------------------
    @classmethod
    def vendor_installed(cls) -> bool:
        """Whether the vendor's torch extension can be imported (without importing it)."""
        return all(importlib.util.find_spec(m.split(".")[0]) is not None for m in cls.vendor_modules)

    @classmethod
    def load_vendor(cls) -> None:
        """Import the vendor modules, or raise MissingVendorPackageError naming the package."""
        for mod in cls.vendor_modules:
            try:
                importlib.import_module(mod)
            except ImportError as exc:
                raise MissingVendorPackageError(
                    f"the {cls.name!r} adapter needs the vendor package {cls.vendor_package or mod!r} "
                    f"(import {mod!r} failed: {exc}); install it, or pick another adapter with "
                    "PORTSPEED_ACCELERATOR (see `portspeed info`)"
                ) from exc

    @classmethod
    def detect(cls) -> bool:
        """Cheap check used by auto-detection: vendor package present and a device usable."""
        if cls.vendor_modules and not cls.vendor_installed():
            return False
        try:
            cls.load_vendor()
            return bool(cls().is_available())
        except Exception:  # detection must never crash selection
            return False

    @property
    def communication_backend(self) -> str:
        """The c10d backend collectives use on this device (PORTSPEED_BACKEND overrides)."""
        return self._backend_override or self.backend

    @property
    def module(self) -> Any:
        """The torch device module (``torch.cuda``, ``torch.npu``...)."""
        mod = getattr(torch, self.device_type, None)
        if mod is None:
            raise MissingVendorPackageError(
                f"torch has no 'torch.{self.device_type}' module; the {self.name!r} adapter needs "
                f"{self.vendor_package or 'a torch build with ' + self.device_type} installed and imported"
            )
        return mod

    # -- devices ----------------------------------------------------------------
    def is_available(self) -> bool:
        return bool(self.module.is_available())

    def device_count(self) -> int:
        return int(self.module.device_count())

    def current_device(self) -> int:
        return int(self.module.current_device())

    def set_device(self, index: int | str | torch.device) -> None:
        self.module.set_device(self._index(index))

    def device(self, index: int | None = None) -> torch.device:
        """A torch.device for ``index`` (default: the current device); never None."""
        return torch.device(self.device_type, self.current_device() if index is None else int(index))

    def synchronize(self, index: int | None = None) -> None:
        self.module.synchronize(index)

    def _index(self, index: int | str | torch.device | None) -> int:
        if index is None:
            return self.current_device()
        if isinstance(index, torch.device):
            return 0 if index.index is None else index.index
        if isinstance(index, str):
            dev = torch.device(index)
            return 0 if dev.index is None else dev.index
        return int(index)

    # -- random number generation ----------------------------------------------
    def default_generator(self, index: int | None = None) -> torch.Generator:
        """The generator ops on this device draw from (what Megatron forks per TP rank)."""
        return self.module.default_generators[self._index(index)]

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return self.default_generator(index).get_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        self.default_generator(index).set_state(state)

    def manual_seed(self, seed: int) -> None:
        self.default_generator().manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        for i in range(max(1, self.device_count())):
            self.default_generator(i).manual_seed(int(seed))

    def initial_seed(self) -> int:
        return int(self.default_generator().initial_seed())

    # -- streams and events -----------------------------------------------------
    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        return self.module.Stream(*args, **kwargs)

    def Event(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        return self.module.Event(*args, **kwargs)

    def current_stream(self, index: int | None = None) -> Any:
        return self.module.current_stream(index)

    def default_stream(self, index: int | None = None) -> Any:
        return self.module.default_stream(index)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.module.stream(stream)

    # -- memory -------------------------------------------------------------------
    def memory_allocated(self, index: int | None = None) -> int:
        return int(self.module.memory_allocated(index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        return int(self.module.max_memory_allocated(index))

    def memory_reserved(self, index: int | None = None) -> int:
        return int(self.module.memory_reserved(index))

    def max_memory_reserved(self, index: int | None = None) -> int:
        return int(self.module.max_memory_reserved(index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self.module.reset_peak_memory_stats(index)

    def memory_stats(self, index: int | None = None) -> dict[str, Any]:
        return dict(self.module.memory_stats(index))

    def empty_cache(self) -> None:
        self.module.empty_cache()

    def total_memory(self, index: int | None = None) -> int:
        """Device memory in bytes: what the device answers (``device_total_memory``); where it cannot, the declared
        ``total_memory_bytes``, else the host's physical memory with one warning naming what to declare."""
        i = self._index(index)
        try:
            return self.device_total_memory(i)
        except (NotImplementedError, RuntimeError, AttributeError) as exc:  # the device cannot say
            return unknown_total_memory(self, i, exc)

    def device_total_memory(self, index: int | None = None) -> int:
        """What the device itself answers for its total memory, in bytes; raises where it cannot say."""
        return int(self.module.get_device_properties(self._index(index)).total_memory)

    # -- dtypes -------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        fn = getattr(self.module, "is_bf16_supported", None)
        return bool(fn()) if fn else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_fp64_supported(self) -> bool:
        """Whether float64 tensors compute in float64 here (some devices lack or downcast it)."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        if self.is_fp64_supported():
            out.append(torch.float64)
        return out

    # -- profiling ranges ---------------------------------------------------------
    def range_push(self, msg: str) -> None:
        nvtx = getattr(self.module, "nvtx", None)
        if nvtx is not None:
            nvtx.range_push(msg)

    def range_pop(self) -> None:
        nvtx = getattr(self.module, "nvtx", None)
        if nvtx is not None:
            nvtx.range_pop()

    # -- vendor kernels -------------------------------------------------------------
    @classmethod
    def kernels(cls) -> dict[str, Any]:
        """The operations this device serves with its own kernels: ``{op: function or "module:attr"}``.

        The ops and their contracts: ``portspeed.accelerator.kernel_ops``. Declared in Python, read
        without loading the device runtime (an import path is resolved when the op is first used);
        checked against the contract at activation. Default: none (torch's fused operators, which
        reach a vendor kernel registered with torch's dispatcher, then the reference).
        """
        return {}

    @classmethod
    def deepspeed_ops(cls) -> dict[str, Any]:
        """DeepSpeed's ops this device serves with its own kernels: ``{builder class name: "module[:attr]"}``.

        Keys are DeepSpeed's op-builder class names (``"QuantizerBuilder"``, ``"FusedAdamBuilder"``...).
        A value names (or is) either a DeepSpeed ``OpBuilder`` subclass, which DeepSpeed builds and
        loads as usual, or the loaded op module itself: an object with the functions DeepSpeed calls
        on ``load()``'s result (for ``QuantizerBuilder``: ``quantize``, ``dequantize``, ``swizzle_quant``,
        ``quantized_reduction``, ``Symmetric``, ``Asymmetric``). Read without importing DeepSpeed or
        the device runtime; resolved when DeepSpeed first asks for its op builders, at its import
        (``portspeed.integrations.ds_op_builders``).
        Default: none, so portspeed serves its torch implementations (``QuantizerBuilder``) and
        DeepSpeed's host builders, and refuses the rest naming what to do.
        """
        return {}

    # -- grouped GEMM capability -------------------------------------------------------
    def has_grouped_mm(self, dtype: torch.dtype) -> bool:
        """Whether torch's ``grouped_mm`` runs a real grouped kernel on this device for ``dtype``
        (not a loop of matmuls): declared per device, never inferred from a name. Default: no."""
        return False

    # -- collectives --------------------------------------------------------------
    @classmethod
    def default_backend(cls) -> str:
        """The backend this adapter uses when PORTSPEED_BACKEND does not override it."""
        return cls.backend

    def owns_backend(self, backend: str) -> bool:
        """Whether ``backend`` is this adapter's own, the one ``backend_gaps`` describes."""
        low = backend.lower()
        return low == self.default_backend().lower() or (low == STAGED_BACKEND and bool(self.staged_collectives))

    def capabilities(self, backend: str | None = None) -> Capabilities:
        """What ``backend`` (default: this adapter's) lacks: the router's table for its groups.

        The built-in defaults (``capabilities_for``: Gloo by torch release, NCCL), plus
        ``backend_gaps`` when ``backend`` is this adapter's own.
        """
        from portspeed.accelerator.capabilities import capabilities_for

        name = (backend or groups_backend(self)).lower()
        caps = (self.backend_gaps.capabilities(name, adapter=self.name)
                if self.backend_gaps is not None and self.owns_backend(name) else capabilities_for(name))
        if name == STAGED_BACKEND and caps.groups_hold_host_threads:
            # a Python c10d group: torch 2.13 cannot destroy one sub-group of it (as the stand-in CCL's)
            caps = dataclasses.replace(caps, groups_hold_host_threads=False)
        return caps

    def describe(self) -> dict[str, Any]:
        """A summary for `portspeed info` and loss records."""
        return {
            "name": self.name,
            "device_type": self.device_type,
            "backend": self.communication_backend,
            "vendor_package": self.vendor_package,
            "verified_on_hardware": self.verified_on_hardware,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} backend={self.communication_backend!r}>"


_BASE_DEFAULT_BACKEND = Accelerator.default_backend.__func__

