"""Exceptions portspeed raises: each names what was wrong and what to do about it."""

from __future__ import annotations

__all__ = [
    "PortspeedError",
    "ConfigError",
    "UnknownAcceleratorError",
    "MissingVendorPackageError",
    "UnknownBackendError",
    "PatchDefinitionError",
    "PatchConflictError",
    "PatchStrictError",
    "UnsupportedCudaCallError",
    "CollectiveUnsupportedError",
    "CclCheckError",
    "UnsupportedOptionError",
]


class PortspeedError(RuntimeError):
    """Base class of every error portspeed raises on purpose."""


class ConfigError(PortspeedError, ValueError):
    """A PORTSPEED_* environment variable or option holds a value portspeed cannot use."""


class UnknownAcceleratorError(PortspeedError, ValueError):
    """The requested accelerator adapter is neither built in nor registered by an entry point."""


class MissingVendorPackageError(PortspeedError, ImportError):
    """A known adapter was selected but the vendor's torch extension is not installed."""


class UnknownBackendError(PortspeedError, ValueError):
    """A collective backend name that neither portspeed nor torch.distributed knows."""


class PatchDefinitionError(PortspeedError, ValueError):
    """A Patch record is malformed (bad target, kind, version specifier...)."""


class PatchConflictError(PortspeedError):
    """Two patches cannot both apply to one target (for example two replacements)."""


class PatchStrictError(PortspeedError):
    """PORTSPEED_STRICT=1 and a patch was skipped or failed."""


class UnsupportedCudaCallError(PortspeedError, AttributeError):
    """Framework code called a torch.cuda API that the active adapter does not translate."""


class CollectiveUnsupportedError(PortspeedError):
    """A collective the active backend lacks and portspeed cannot rewrite."""


class CclCheckError(PortspeedError):
    """The collective library gave a wrong value in the check made when the job's default group was created."""


class UnsupportedOptionError(PortspeedError, ValueError):
    """A framework option needs what the active adapter lacks (a CUDA-only library or kernel); refused at start-up."""
