"""Conformance kit: prove an adapter on the machine that has its hardware.

portspeed's CI has no vendor accelerator, so the vendor adapters cannot be proven there.
This kit is what a vendor (or a user) runs on its own machine against any adapter:

- ``device``: device/host separation (a host and a device tensor do not mix, moves are
  copies, views alias), the device generator is separate from the host's (seeding, state
  save/restore, dropout draws), streams, events and memory statistics answer;
- ``kernels``: every vendor kernel the adapter declares (``Accelerator.kernels()``) against the
  portable Transformer Engine's reference, values and gradients, fp32 and bf16 (``kernels.py``);
- ``collectives``: every collective Megatron and DeepSpeed use, through portspeed's router
  with ``"nccl"`` requested, on device tensors, value for value against a single-process
  reference (gaps the adapter declares are rewritten; a gap it does not declare is reported as
  the ``BackendGaps`` field to write, and with ``--declared-gaps`` a declared one the library
  does not have as one that can go: ``gaps``; the calls each rank makes: ``collective_cases``);
- ``training``: the example GPT trainer (megatron-core, TP2 on 2 ranks, fp32) compared with
  the CPU loss record shipped in this package.
- ``bandwidth`` (only when named): each collective's algorithm and bus bandwidth by message and group size,
  written into the link table `portspeed compare --perf` reads (``bandwidth.py``).

Run it with ``portspeed conformance --adapter NAME`` (``NAME``: an adapter's name,
``module:Class`` or ``path/to/file.py:Class``; exit 0: every check passed). The portspeed test
device (a test device, not hardware) is its first customer: CI runs it as a new vendor's
one-file adapter, ``examples/vendor_adapter.py``.
"""

from __future__ import annotations

from portspeed.conformance.report import Check, Report

__all__ = ["Check", "Report"]
