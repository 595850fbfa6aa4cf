"""Who gets the portable Transformer Engine, and when: the reach, decided here (docs/transformer-engine.md).

The decision: ``transformer_engine`` is served only

1. to the Megatron modules that build or query the TE layers (``IMPORTERS``: the TE
   extension, the TE spec provider, the GPT / MoE layer specs, ``megatron.core.utils``,
   whose ``get_te_version`` answers ``is_te_min_version``, and the two Megatron-Bridge modules
   that import ``transformer_engine.pytorch`` unguarded), and to a module that already holds
   ``HAVE_TE = True`` imported from one of them (it was told TE is there before asking), through the scoped import the
   translation gives framework modules; it is never put in ``sys.modules``, so every other
   Megatron module (``tensor_parallel.random``, ``moe_utils``, the optimizers, ``fp8_utils``,
   the transformer block, ...) keeps its ``HAVE_TE = False`` path, and other libraries
   (accelerate, transformers, DeepSpeed) that probe for TE see none;
2. when the TE path is requested: the command line does not say ``--transformer-impl local``
   (Megatron-LM's default is ``transformer_engine``); with ``local`` nothing is served, so the
   local path is exactly what it was;
3. when no Transformer Engine is installed (``nvidia_installed()``: a ``transformer_engine``
   distribution; the served import is also only asked after the real import failed).

``served_import`` is what the declared patch ``megatron.core.transformer_engine.portable``
installs in place of ``portspeed.translation.importer.served_import``.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from typing import Any

from portspeed.versions import distribution_version, gate_version

from .namespace import build
from .version import te_version_for

__all__ = ["IMPORTERS", "describe", "nvidia_installed", "requested", "served_import", "tree"]

#: the framework modules that are served ``transformer_engine`` (exact module names)
IMPORTERS: frozenset[str] = frozenset({
    "megatron.core.extensions.transformer_engine",
    "megatron.core.extensions.transformer_engine_spec_provider",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.moe_module_specs",
    "megatron.core.utils",
    # Megatron-Bridge: the two modules that import transformer_engine.pytorch unguarded (docs/megatron-core-loop.md)
    "megatron.bridge.peft.lora_layers",
    "megatron.bridge.models.gpt_full_te_layer_autocast_spec",
})
_TOP = "transformer_engine"
_lock = threading.Lock()
_tree: dict[str, types.ModuleType] | None = None
log = logging.getLogger("portspeed.portable_te")


def nvidia_installed() -> str | None:
    """The version of an installed ``transformer_engine`` distribution (NVIDIA's), or None."""
    for name in ("transformer_engine", "transformer-engine"):
        v = distribution_version(name)
        if v is not None:
            return str(v)
    return None


def requested(argv: list[str] | None = None) -> bool:
    """The TE path is asked for: no ``--transformer-impl local`` on the command line (Megatron's default is TE)."""
    args = sys.argv if argv is None else argv
    impl = None
    for i, a in enumerate(args):
        if a == "--transformer-impl" and i + 1 < len(args):
            impl = args[i + 1]
        elif a.startswith("--transformer-impl="):
            impl = a.split("=", 1)[1]
    return impl != "local"


def tree() -> dict[str, types.ModuleType]:
    """The served module tree, built once per process for the imported megatron-core release."""
    global _tree
    with _lock:
        if _tree is None:
            gv = gate_version("megatron-core").version
            version = te_version_for(str(gv) if gv is not None else None)
            _tree = build(version)
            log.warning("portspeed: Megatron's Transformer Engine path (--transformer-impl transformer_engine) uses "
                        "portspeed's portable Transformer Engine (plain torch), reported as version %s; "
                        "--transformer-impl local avoids it", version)
        return _tree


def served_import(name: str, globals: Any, fromlist: Any, level: int) -> Any:
    """The replacement of ``translation.served_import``: the portable module for IMPORTERS, else None."""
    if level != 0 or not (name == _TOP or name.startswith(_TOP + ".")):
        return None
    if not isinstance(globals, dict):
        return None
    # an importer outside IMPORTERS is served only when it already holds HAVE_TE = True taken from a served
    # module (megatron-core 0.19's moe/shared_experts.py: `from ...transformer_engine import HAVE_TE`, then
    # `if HAVE_TE: import transformer_engine`); modules that probe for TE themselves have no HAVE_TE yet
    if (globals.get("__name__") not in IMPORTERS and globals.get("HAVE_TE") is not True) or not requested():
        return None
    modules = tree()
    mod = modules.get(name)
    if mod is None:
        return None
    return mod if fromlist else modules[_TOP]


def describe() -> str:
    """One line for ``portspeed info``: which Transformer Engine Megatron gets here."""
    nvidia = nvidia_installed()
    if nvidia is not None:
        return f"NVIDIA transformer_engine {nvidia} (installed; the portable one stays off)"
    gv = gate_version("megatron-core").version
    version = te_version_for(str(gv) if gv is not None else None)
    return (f"portspeed portable (plain torch), reported as {version} to megatron-core {gv}; served to "
            f"{len(IMPORTERS)} Megatron modules when the TE path is requested (no --transformer-impl local)")
