"""Does ``TORCH_GLOO_LAZY_INIT`` make a Gloo group lazy on this torch, and when does torch read it?

Why: portspeed creates Gloo groups (and the test device's staging groups) lazily through
``portspeed.comm.gloo_init.lazy_gloo``, which sets the variable around the construction. This
script needs nothing but torch, so it runs in a throw-away venv of any release
(``python -m venv /tmp/t && /tmp/t/bin/pip install torch==2.8.0 && /tmp/t/bin/python
benchmarks/check_torch_gloo_lazy.py``): a group of two is made with the peer absent; a lazy group
is made at once, an eager one waits for the peer (3 s) and raises. Figures: docs/megatron-unit-tests.md.
"""
import datetime, os, time
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=3), wait_for_workers=False)

def make(prefix, env_before_options, env_before_group):
    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    if env_before_options:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    o = ProcessGroupGloo._Options()
    o._timeout = datetime.timedelta(seconds=3)
    o._devices = [ProcessGroupGloo.create_default_device()]
    if env_before_group:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    t = time.time()
    try:
        ProcessGroupGloo(PrefixStore(prefix, store), 0, 2, o)
        r = "made at once (lazy)"
    except Exception:
        r = "waited for the absent peer (eager)"
    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    return f"{r}, {time.time() - t:.2f} s"

print("torch", torch.__version__)
print("  variable unset:                    ", make("a/", False, False))
print("  set before the options are made:   ", make("b/", True, True))
print("  set after the options, before group:", make("c/", False, True))
