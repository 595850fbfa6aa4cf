"""What a vendor writes against: the whole adapter contract, in one module, read top to bottom.

A device is one ``Accelerator`` subclass (most: ``PrivateUse1Accelerator``, which needs names
only) that may declare what its collective library lacks (``BackendGaps``) and serve kernels of
its own (``kernels()``). Import everything from here; the names live in ``portspeed.accelerator``
(contract, privateuse1, capabilities, backend_gaps, kernel_ops), and this module is their one
public address. Try a file without packaging it: ``PORTSPEED_ACCELERATOR=path/to/acme.py:Acme``;
check it: ``portspeed conformance --adapter path/to/acme.py:Acme``. A worked file:
``examples/vendor_adapter.py``; a walk through it: ``docs/writing-an-adapter.md``.

1. Device, RNG, memory, streams (``Accelerator``; ``PrivateUse1Accelerator`` answers them all
   through ``torch.accelerator`` or the device module the vendor registered)

   required (``REQUIRED_MEMBERS``; a concrete class without one fails when defined or selected,
   ``AdapterContractError``; a base class that adapters subclass passes ``abstract=True``):
       name, device_type, backend (a PrivateUse1Accelerator subclass may leave backend empty)
   declared where the device falls short (``portspeed conformance`` prints the lines): total_memory_bytes (the
              device cannot say its memory), host_generator (its random ops draw from the host's generator),
              wrong_torch_ops (portable-TE ops whose torch form is wrong on it), staged_collectives (collectives
              its CCL lacks or gets wrong: staged through the host on Gloo, ``backend = "staged"`` for all of
              them), ccl_verified (its CCL is proven: no check of it when the job's default group is made)
   identity:  vendor_modules, vendor_package, runs_cuda_natively, device_is_host, verified_on_hardware,
              auto_detect (PrivateUse1Accelerator), detect(), load_vendor(), vendor_installed(), describe(),
              communication_backend (``backend`` unless PORTSPEED_BACKEND overrides it)
   devices:   is_available(), device_count(), current_device(), set_device(index), device(index),
              synchronize(index)
   RNG:       default_generator(index), get_rng_state(index), set_rng_state(state, index), manual_seed(seed),
              manual_seed_all(seed), initial_seed()
   streams:   Stream(...), Event(...), current_stream(index), default_stream(index), stream(stream)
   memory:    memory_allocated(index), max_memory_allocated(index), memory_reserved(index),
              max_memory_reserved(index), reset_peak_memory_stats(index), memory_stats(index),
              empty_cache(), total_memory(index), device_total_memory(index)
   dtypes:    is_bf16_supported(), is_fp16_supported(), is_fp64_supported(), supported_dtypes()
   profiling: range_push(msg), range_pop()

2. The collective library and its gaps (``Accelerator.backend_gaps = BackendGaps(...)``; the
   router rewrites what is declared, the rest goes straight through)

   BackendGaps(unsupported_ops, unsupported_dtypes, unsupported_collectives, wrong_dtypes,
               chunk_shaped_all_gather, note, sends_from_buffer, groups_hold_host_threads)
   collectives a gap may name: ``ROUTED_COLLECTIVES``; ``portspeed conformance`` prints the
   ``BackendGaps`` line for a gap left undeclared, and says when a declared one can go.
   the adapter's side: default_backend(), owns_backend(backend), capabilities(backend)

3. Kernels (``Accelerator.kernels()`` returns ``{op: function or "module:function"}``; each takes its
   contract's parameters by the same names, ``KERNEL_OPS[op]``'s docstring is the contract; within
   ``KERNEL_BANDS`` of the reference: fp32 1e-4, bf16 3e-2 of its largest magnitude)

       attention(q, k, v, *, attn_mask, causal, scale, dropout_p) -> out
       attention_lse(q, k, v, *, causal, scale) -> (out, lse)
       attention_lse_backward(grad_out, q, k, v, out, lse, *, causal, scale) -> (dq, dk, dv)
       rms_norm(x, weight, eps) -> y
       layer_norm(x, weight, bias, eps) -> y
       rope(t, freqs, *, interleaved) -> y
       swiglu(x) -> y
       grouped_mm(x, weights, offsets) -> y
   helpers: causal_allowed(sq, sk, bottom_right, device) (the causal rule as a mask),
            has_grouped_mm(dtype) (torch's own grouped_mm has a real kernel on the device)

4. DeepSpeed's ops (``Accelerator.deepspeed_ops()`` returns ``{op-builder class name: "module[:attr]"}``: a
   DeepSpeed ``OpBuilder`` subclass, or the loaded op module itself; checked at DeepSpeed's import)

       "QuantizerBuilder": quantize, dequantize, swizzle_quant, quantized_reduction, Symmetric, Asymmetric
                           (ZeRO++; default: portspeed's torch ops, portspeed.integrations.ds_quantizer)
       any other builder, e.g. "FusedAdamBuilder" (default: refused in one line naming the fix)
   ``portspeed conformance --suites kernels`` checks the quantizer on the device against a float reference
"""

from __future__ import annotations

# 1. device, RNG, memory, streams
from portspeed.accelerator.contract import REQUIRED_MEMBERS, Accelerator, AdapterContractError
from portspeed.accelerator.privateuse1 import ModuleGenerator, PrivateUse1Accelerator, registered_backend
from portspeed.errors import MissingVendorPackageError, UnsupportedCudaCallError

# 2. the collective library and its gaps
from portspeed.accelerator.backend_gaps import BackendGaps  # isort: skip
from portspeed.accelerator.capabilities import (BITWISE_OPS, REDUCING_COLLECTIVES, ROUTED_COLLECTIVES, Capabilities,
                                                op_type)
from portspeed.errors import UnknownBackendError

# 3. kernels
from portspeed.accelerator.kernel_ops import KERNEL_BANDS, KERNEL_OPS, KernelContractError, causal_allowed

__all__ = [
    # 1. device, RNG, memory, streams
    "Accelerator", "PrivateUse1Accelerator", "ModuleGenerator", "registered_backend", "REQUIRED_MEMBERS",
    "AdapterContractError", "MissingVendorPackageError", "UnsupportedCudaCallError",
    # 2. the collective library and its gaps
    "BackendGaps", "Capabilities", "ROUTED_COLLECTIVES", "REDUCING_COLLECTIVES", "BITWISE_OPS", "op_type",
    "UnknownBackendError",
    # 3. kernels
    "KERNEL_OPS", "KERNEL_BANDS", "KernelContractError", "causal_allowed",
]
