"""Fingerprints of each Megatron patch's target source, per megatron-core release (see portspeed.drift).

Written by ``portspeed patches --check SOURCE --record``; edit by re-recording, not by hand.
"""

FINGERPRINTS: dict[str, dict[str, str]] = {'megatron.core.ddp_buffers.offload_copy': {'0.16.1': '9c9abc053443c442'},
 'megatron.core.fallbacks.config': {'0.16.1': '5c5804573dd497a2'},
 'megatron.core.fallbacks.torch_norm_sp': {'0.16.1': 'fd1afe387771a6f3'},
 'megatron.core.inference_comm.device_check': {'0.16.1': '04aedb4de05dc894'},
 'megatron.core.p2p.interleaved_pp2_guard': {'0.16.1': 'bd34acf830acf5ac'},
 'megatron.core.p2p.send_copy': {'0.16.1': '185c10bc0cb25cb8'},
 'megatron.core.p2p.send_copy_batched': {'0.16.1': '8e1f95ef421feaed'},
 'megatron.core.parallel_state.nccl_options': {'0.16.1': 'badc91bb4e14b2a9'},
 'megatron.core.rng.get_state': {'0.16.1': '70bf5f7daf7748fd'},
 'megatron.core.rng.set_state': {'0.16.1': 'd173c4dea727ebdb'},
 'megatron.core.rng.tracker_graphs': {'0.16.1': '966f7df661a3146c'},
 'megatron.legacy.fused_kernels.load': {'0.16.1': '14e575a73223de43'},
 'megatron.training.compile_helpers': {'0.16.1': '7f0be25e4e8a815c'},
 'megatron.training.data_iterators_rng': {'0.16.1': 'c8172f3c3edf3b9f'},
 'megatron.training.validate_args.torch_paths': {'0.16.1': '94e28c2f5cab662b'}}
