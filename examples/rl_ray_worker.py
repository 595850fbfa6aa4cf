"""The actor side of examples/rl_ray_actors.py: one Megatron rank of the RL actor loop inside a Ray actor.

As verl places its Megatron workers: no torchrun and no ``portspeed run``; each actor sets the
torch.distributed environment itself and runs the loop of examples/rl_actor_loop.py. The adaptor
is this module's first line, so it is active in every actor process (Ray imports this module
there to build the actor). This module and the loop's are the user's own code: the driver names
both in PORTSPEED_FRAMEWORK_MODULES for the actors.
"""

import portspeed.megatron_adaptor  # noqa: F401  (first line: active in each actor process)

import os
import sys
import time
from typing import Any

import torch

import rl_actor_loop


class MegatronActor:
    """One rank: ``run`` joins the group at ``master`` and trains with the loop's command line."""

    def __init__(self, rank: int, world: int, master_addr: str, master_port: int) -> None:
        # what torchrun would set: this actor is rank `rank` of `world`, one device each
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        self.rank = rank

    def run(self, argv: list[str]) -> dict[str, Any]:
        """Train; report which accelerator this process's torch.cuda answered for (the adaptor's)."""
        code = rl_actor_loop.main(argv)
        return {"rank": self.rank, "exit": code, "pid": os.getpid(),
                "device": str(torch.cuda.current_device()), "torch_cuda": type(torch.cuda).__name__,
                "adaptor_active": "portspeed.megatron_adaptor" in sys.modules, "cpu_s": round(time.process_time(), 1)}
