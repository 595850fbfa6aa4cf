"""Framework integrations: the patch sets for Megatron and DeepSpeed, and when they are set up.

Layer: integrations, the only layer that imports ``portspeed.patches``. It composes the
engine (``portspeed.patching``, ``portspeed.accelerator``, ``portspeed.comm``) with the
patch modules. The public entry points ``portspeed.megatron_adaptor`` and
``portspeed.deepspeed_adaptor`` are thin facades over ``megatron`` and ``deepspeed`` here.

- ``activation``      deferred set-up at the framework's first import.
- ``megatron``        the Megatron patch set and its activation.
- ``deepspeed``       the DeepSpeed patch set, its activation and accelerator hook.
- ``ds_accelerator``  DeepSpeed's accelerator object, answered by the active adapter.
- ``ds_op_builders``  which DeepSpeed op builders it offers (the vendor slot, torch, host), and the refusals.
- ``ds_quantizer``    DeepSpeed's quantizer op (what ZeRO++ loads) in torch operators.
- ``ds_nodes``        what DeepSpeed counts as a node: the ranks the launcher started here.
"""
