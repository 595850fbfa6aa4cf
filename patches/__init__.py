"""Declared patches, one module per thing patched (installed as ``portspeed.patches``).

``torch_cuda``: torch.cuda translation for framework modules; ``torch_distributed``: the
collective router's entry points; ``megatron/``: Megatron-Core and Megatron-LM;
``deepspeed``: what DeepSpeed's accelerator hook does not cover; ``hf_accelerate``: the
Hugging Face Trainer's DeepSpeed path on a device Accelerate does not know.
"""
