"""Megatron-LM's own scripts are framework code: from core_v0.18 on they move batches to the GPU themselves.

Up to core_v0.17 ``pretrain_gpt.py`` handed the batch to ``megatron.training.utils``, which
moved it with ``.cuda()`` (a framework module, so translated). From core_v0.18 the script's
own ``get_batch`` calls ``batch[key].cuda(non_blocking=True)``; the script runs as
``__main__``, which is not a framework module, so on a machine without a GPU the call
reached the real ``torch.cuda`` ("Found no NVIDIA driver" on PyPI's CUDA build, "Torch not
compiled with CUDA" on the CPU build).

When ``pretrain()`` starts, and the running ``__main__`` file lies in a Megatron-LM checkout
(its folder holds ``megatron/training``), ``__main__`` and the checkout's other top-level
modules (``model_provider``, ``gpt_builders``...) become framework modules
(``portspeed.translation.importer.add_framework_prefixes``): they see the translated torch like the
rest of Megatron. A user's own script is left alone (name it in PORTSPEED_FRAMEWORK_MODULES
to opt in).

A module counts only when its ``__file__`` is an absolute path to a real file at the top of
the checkout, and its name is one the scope accepts (``scope.valid_prefix``): torch sets
relative ``__file__`` values on ``torch.classes`` / ``torch.ops`` (``_classes.py``,
``_ops.py``), which resolve into whatever folder the run started from, so a run launched
from the checkout's root (as Megatron-LM's ``examples/`` scripts launch it) would otherwise
offer ``torch.classes`` to the scope, which refuses it with ConfigError.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from portspeed.accelerator.conditions import translated
from portspeed.translation.scope import valid_prefix
from portspeed.patching.record import WRAP, Patch

from ._training_common import log_once
from .ranges import DISTRIBUTION, SCRIPT_MOVES_BATCHES

__all__ = ["PATCHES", "checkout_root", "checkout_modules", "scope_checkout_scripts"]


def checkout_root(path: str | None) -> str | None:
    """The Megatron-LM checkout holding file ``path`` at its top level, or None."""
    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(folder, "megatron", "training", "__init__.py")):
        return folder
    return None


def checkout_modules(root: str) -> list[str]:
    """Names of imported modules whose file sits at the top of checkout ``root`` (``__main__`` included).

    Only an absolute ``__file__`` naming a real file counts (a relative one says nothing about
    where the module lives), and only names the scope accepts, so what is returned can always
    be handed to ``add_framework_prefixes``.
    """
    real_root = os.path.realpath(root)
    names = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not (isinstance(f, str) and os.path.isabs(f) and os.path.isfile(f)):
            continue
        if os.path.dirname(os.path.realpath(f)) == real_root and valid_prefix(name):
            names.append(name)
    return sorted(names)


def scope_checkout_scripts(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``megatron.training.training.pretrain``: see the module docstring."""
    main = sys.modules.get("__main__")
    root = checkout_root(getattr(main, "__file__", None))
    if root is not None:
        from portspeed.translation import importer as translation

        names = checkout_modules(root)
        if names:
            translation.add_framework_prefixes(*names)
            log_once("checkout_scripts", "portspeed: Megatron-LM's own script modules (%s) see the translated "
                     "torch, like megatron.*", ", ".join(names))
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(
        name="megatron.training.scripts_are_framework",
        target="megatron.training.training:pretrain",
        kind=WRAP,
        impl=scope_checkout_scripts,
        distribution=DISTRIBUTION,
        versions=SCRIPT_MOVES_BATCHES,
        when=translated,
        reason="From core_v0.18 the stock pretrain_gpt.py moves each batch with tensor.cuda() in its own "
        "get_batch; the script is __main__, not a framework module, so the call reached the real torch.cuda.",
    ),
]
