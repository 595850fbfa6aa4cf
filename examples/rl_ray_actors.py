"""Run the RL actor loop's Megatron ranks as Ray actors on a local Ray cluster (no torchrun, no `portspeed run`).

    OMP_NUM_THREADS=1 python examples/rl_ray_actors.py --ranks 2 -- --tp 2 --init DIR --loss-log /tmp/ray_tp2.json

Everything after ``--`` goes to examples/rl_actor_loop.py in every actor. The actors import
``rl_ray_worker``, whose first line is ``import portspeed.megatron_adaptor``; this driver only
starts Ray and sets what the actors inherit: PORTSPEED_FRAMEWORK_MODULES naming the user's own
modules (``rl_ray_worker,rl_actor_loop``) and this folder on PYTHONPATH. Prints one JSON line per
actor (its rank, pid and what its torch.cuda is).
"""

import argparse
import json
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    loop_args = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    opts = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    # inherited by the Ray processes ray.init starts (and so by every actor)
    named = [n for n in os.environ.get("PORTSPEED_FRAMEWORK_MODULES", "").split(",") if n]
    os.environ["PORTSPEED_FRAMEWORK_MODULES"] = ",".join(dict.fromkeys(named + ["rl_ray_worker", "rl_actor_loop"]))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *paths])
    sys.path.insert(0, HERE)
    import ray

    import rl_ray_worker  # noqa: F401  (Ray pickles the actor class by reference to this module)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=opts.ranks, include_dashboard=False, log_to_driver=True)
    try:
        actor = ray.remote(num_cpus=1)(rl_ray_worker.MegatronActor)
        actors = [actor.remote(r, opts.ranks, "127.0.0.1", port) for r in range(opts.ranks)]
        results = ray.get([a.run.remote(loop_args) for a in actors])
    finally:
        ray.shutdown()
    for r in results:
        print(json.dumps(r), flush=True)
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
