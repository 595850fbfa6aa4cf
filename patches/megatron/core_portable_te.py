"""Megatron's Transformer Engine path off CUDA: the portable Transformer Engine, served to its TE modules.

Why: stock ``pretrain_gpt.py`` with Megatron's defaults (``--transformer-impl transformer_engine``)
builds its layers from ``transformer_engine.pytorch``; without TE it dies at start-up
(``NameError: name 'TESpecProvider' is not defined``). This patch replaces
``portspeed.translation.importer.served_import`` (asked only after a framework module's
import found no module) with ``portspeed.portable_te.serve.served_import``, which answers
``transformer_engine`` and its served submodules for the Megatron modules that build TE layers,
when the command line does not ask for ``--transformer-impl local``.

Gated: off CUDA only (``translated``; on a CUDA machine NVIDIA's TE is the one to install),
and never when a ``transformer_engine`` distribution is installed (NVIDIA's, or anything under
that name): then ``portspeed patches`` shows this patch inactive and Megatron imports the
installed package. ``PORTSPEED_DISABLE=megatron.core.transformer_engine.portable`` turns it
off (Megatron then behaves as without TE); ``revert()`` puts the original function back.
The reach and the API subset: docs/transformer-engine.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from portspeed.accelerator.conditions import translated
from portspeed.patching.record import REPLACE, Patch
from portspeed.portable_te.serve import nvidia_installed, served_import

from .ranges import CORE, DISTRIBUTION

if TYPE_CHECKING:
    from portspeed.accelerator import Accelerator

__all__ = ["PATCHES", "portable_te_wanted"]


def portable_te_wanted(acc: Accelerator) -> bool:
    """Off CUDA, and no Transformer Engine distribution installed (an installed one always wins)."""
    return translated(acc) and nvidia_installed() is None


PATCHES: list[Patch] = [
    Patch(name="megatron.core.transformer_engine.portable", target="portspeed.translation.importer:served_import",
          kind=REPLACE, impl=served_import, distribution=DISTRIBUTION, versions=CORE, when=portable_te_wanted,
          reason="Megatron's default --transformer-impl transformer_engine needs transformer_engine.pytorch, which "
          "has no build off CUDA; its TE modules (and only they) are served portspeed's portable Transformer "
          "Engine (plain torch), unless --transformer-impl local is given or a Transformer Engine is installed"),
]
