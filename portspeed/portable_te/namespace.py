"""The ``transformer_engine`` module tree the portable layers are served as (never put in sys.modules).

Why a tree of plain module objects: Megatron imports ``transformer_engine``,
``transformer_engine.pytorch`` (``as te``), ``transformer_engine.pytorch.fp8``,
``transformer_engine.pytorch.distributed``, ``transformer_engine.pytorch.attention.rope`` (the
fused RoPE behind ``apply_rope_fusion``) and ``transformer_engine.common.recipe``, and
subclasses what it finds there. ``build(version)`` makes those modules, each marked
``__portspeed_portable__`` and documented as portspeed's; a submodule or name not in the tree
(``cpu_offload``, ``permutation``, ``cross_entropy``, ``cpp_extensions``, ``router``,
``optimizers``, ``attention._SplitAlongDim``, ...) is not served, so Megatron's own
``except ImportError`` fallbacks run, as without Transformer Engine. ``te.pytorch.ops`` (the operation-fuser API),
the fp8 recipes and ``TransformerLayer`` (TE's fused whole layer) exist only to refuse, naming the option.
"""

from __future__ import annotations

import contextlib
import enum
import types
from typing import Any, Iterator

import torch

from . import attention, grouped, linear, norms, rng, rope
from .refuse import refuse

__all__ = ["build", "SERVED"]

_DOC = "portspeed's portable Transformer Engine (plain torch operations), not NVIDIA's: {}"


class FP8GlobalStateManager:
    """fp8 is never on here."""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return False

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return False

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        return False

    @classmethod
    def get_fp8_recipe(cls) -> None:
        return None


@contextlib.contextmanager
def fp8_autocast(enabled: bool = False, *args: Any, **kwargs: Any) -> Iterator[None]:
    """A no-op when fp8 is off; refused when on."""
    if enabled:
        refuse("fp8 training (--fp8-format)", "drop --fp8-format")
    yield


@contextlib.contextmanager
def fp8_model_init(enabled: bool = False, *args: Any, **kwargs: Any) -> Iterator[None]:
    """A no-op when fp8 parameters are off; refused when on."""
    if enabled:
        refuse("fp8 parameters (--fp8-param-gather)", "drop --fp8-param-gather")
    yield


class Format(enum.Enum):
    """The fp8 formats' names (Megatron reads them only to build recipes, which are refused)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


class _Recipe:
    _flag = "--fp8-recipe"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse(f"the fp8 / fp4 recipe {type(self).__name__} ({self._flag})", "drop --fp8-format / --fp4-format")


class DelayedScaling(_Recipe):
    """Refused: fp8."""


class _Op:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse(f"Transformer Engine's operation API te.pytorch.ops.{type(self).__name__} (--use-te-activation-func, "
               "--use-transformer-engine-op-fuser)", "drop those flags")


class TransformerLayer(torch.nn.Module):
    """Refused: TE's fused whole-layer module (Megatron-Bridge's ``use_transformer_engine_full_layer_spec``).

    Served so that the name exists, and refused where it is used: Megatron-Bridge subclasses it
    in ``models/gpt_full_te_layer_autocast_spec.py``, which it imports only when the provider asks
    for the full-layer spec; the subclass statement is that moment (its ``__init__`` asks the
    ``transformer-engine`` distribution's version before building the layer, so a refusal at
    construction would come too late). The package and the default TE layer spec are unaffected.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        refuse("Transformer Engine's fused transformer_engine.pytorch.TransformerLayer (Megatron-Bridge's "
               "use_transformer_engine_full_layer_spec=True)",
               "leave use_transformer_engine_full_layer_spec False: the Bridge's default Transformer Engine layer "
               "spec runs on the portable layers")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse("Transformer Engine's fused transformer_engine.pytorch.TransformerLayer",
               "build the layer from Megatron's Transformer Engine layer spec instead")


def _ops_getattr(name: str) -> Any:
    """Any te.pytorch.ops name is a class (Megatron names some in annotations) that refuses when built."""
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Op,), {"__doc__": "Refused: the operation API."})


def _recipe_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Recipe,), {"__doc__": "Refused: fp8 / fp4."})


def _module(name: str, what: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, _DOC.format(what))
    mod.__dict__.update(attrs)
    mod.__portspeed_portable__ = True
    return mod


#: the served module names (relative to ``transformer_engine``); anything else raises ImportError
SERVED = ("", "pytorch", "pytorch.fp8", "pytorch.distributed", "pytorch.ops", "pytorch.attention",
          "pytorch.attention.rope", "common", "common.recipe")


def build(version: str) -> dict[str, types.ModuleType]:
    """Full name -> module for every served ``transformer_engine`` module, reporting ``version``."""
    fp8 = _module("transformer_engine.pytorch.fp8", "fp8 state (always off)",
                  FP8GlobalStateManager=FP8GlobalStateManager, fp8_autocast=fp8_autocast, fp8_model_init=fp8_model_init)
    distributed = _module("transformer_engine.pytorch.distributed", "RNG tracker and activation recompute",
                          CudaRNGStatesTracker=rng.CudaRNGStatesTracker, checkpoint=rng.checkpoint)
    ops = _module("transformer_engine.pytorch.ops", "the operation API (refused)")
    rope_mod = _module("transformer_engine.pytorch.attention.rope", "rotary position embedding (apply_rope_fusion)",
                       apply_rotary_pos_emb=rope.apply_rotary_pos_emb)
    attention_pkg = _module("transformer_engine.pytorch.attention", "attention helpers: rope only", rope=rope_mod)
    ops.__getattr__ = _ops_getattr  # type: ignore[attr-defined]
    pytorch = _module("transformer_engine.pytorch", "the layers", Linear=linear.Linear,
                      LayerNormLinear=linear.LayerNormLinear, LayerNorm=norms.LayerNorm, RMSNorm=norms.RMSNorm,
                      DotProductAttention=attention.DotProductAttention, GroupedLinear=grouped.GroupedLinear,
                      TransformerLayer=TransformerLayer,
                      fp8=fp8, distributed=distributed, ops=ops, attention=attention_pkg, fp8_autocast=fp8_autocast,
                      fp8_model_init=fp8_model_init, checkpoint=rng.checkpoint)
    recipe = _module("transformer_engine.common.recipe", "fp8 recipes (refused)", DelayedScaling=DelayedScaling,
                     Format=Format)
    recipe.__getattr__ = _recipe_getattr  # type: ignore[attr-defined]
    common = _module("transformer_engine.common", "common", recipe=recipe)
    top = _module("transformer_engine", "the package", pytorch=pytorch, common=common, __version__=version)
    tree = {"transformer_engine": top}
    for rel in SERVED[1:]:
        obj: Any = top
        for part in rel.split("."):
            obj = getattr(obj, part)
        tree[f"transformer_engine.{rel}"] = obj
    return tree
