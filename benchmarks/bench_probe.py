"""A/B in one run: the example trainer's step with the probe off, module statistics, op statistics and --probe-nan.

One process (TP1, world size 1, Gloo) builds examples/pretrain_gpt.py's model once and runs its
``train_step`` round after round, each round one step per configuration in a rotating order:

- ``off``: no probe session (the probe's Megatron patches are installed, since the process was
  started with ``PORTSPEED_PROBE_DIR``, and pass straight through: two Python frames per step);
- ``module``: every module's outputs and gradients, every parameter's gradient and value, in full,
  and the dump written (``--probe-level module``);
- ``op``: the same plus every torch function inside the modules (``--probe-level op``);
- ``nan``: the ``--probe-nan`` watch of an iteration outside ``--probe-iterations`` (flags only, what
  every unrecorded iteration of a ``--probe-nan`` run pays).

Each configuration has its own session and dump folder; the step time includes the iteration's end
(the one read of every statistic, the files). Prints the medians, their ratios to ``off`` and the
disk one probed iteration takes (dump.json + construct.json + stack.json of one rank)::

    OMP_NUM_THREADS=1 python benchmarks/bench_probe.py --rounds 20
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
_ROOT = tempfile.mkdtemp(prefix="bench-probe-")
# the probe's patches (and the collectives' wrappers of op level) are declared at the adaptor's set-up
os.environ.update({"PORTSPEED_PROBE_DIR": os.path.join(_ROOT, "unused"), "PORTSPEED_PROBE_LEVEL": "op"})

import portspeed.megatron_adaptor  # noqa: E402,F401

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from portspeed import config  # noqa: E402
from portspeed.probe import session as probe_session  # noqa: E402

CONFIGS = ("off", "module", "op", "nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sessions() -> dict[str, probe_session.ProbeSession | None]:
    base = config.settings()
    out: dict[str, probe_session.ProbeSession | None] = {"off": None}
    for name, kw in (("module", dict(probe_level="module")), ("op", dict(probe_level="op")),
                     ("nan", dict(probe_level="module", probe_nan=True, probe_iterations=(10**8, 10**8)))):
        folder = os.path.join(_ROOT, name)
        out[name] = probe_session.ProbeSession(dataclasses.replace(
            base, probe_dir=folder, probe_iterations=kw.pop("probe_iterations", (1, 10**8)), **kw))
    return out


def _disk(folder: str) -> float | None:
    steps = [p for p in Path(folder).glob("step*/rank0") if p.is_dir()]
    if not steps:
        return None
    return statistics.median(sum(f.stat().st_size for f in s.rglob("*") if f.is_file()) for s in steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (one step of each configuration each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--num-layers", default="4")
    p.add_argument("--hidden-size", default="64")
    p.add_argument("--seq-length", default="32")
    opts = p.parse_args(argv)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import pretrain_gpt as pg

    args = pg.parse_args(["--num-layers", opts.num_layers, "--hidden-size", opts.hidden_size, "--seq-length",
                          opts.seq_length, "--vocab-size", "128", "--global-batch-size", "8", "--micro-batch-size",
                          "2"])
    model, optimizer, _, _ = pg.setup(args)
    sessions = _sessions()
    chosen: list[probe_session.ProbeSession | None] = [None]
    probe_session.current = lambda: chosen[0]  # the patches ask for the session each step: this round's, or none
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    it = 0
    for r in range(opts.warmup + opts.rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for name in order:
            chosen[0] = sessions[name]
            it += 1
            t0 = time.perf_counter()
            pg.train_step(args, model, optimizer, it)
            dt = (time.perf_counter() - t0) * 1000
            if r >= opts.warmup:
                times[name].append(dt)
    off = statistics.median(times["off"])
    print(f"example step (TP1, {opts.num_layers} layers, hidden {opts.hidden_size}, seq {opts.seq_length}, "
          f"4 micro-batches), {opts.rounds} rounds")
    for name in CONFIGS:
        med = statistics.median(times[name])
        disk = _disk(os.path.join(_ROOT, name)) if name in ("module", "op") else None
        print(f"{name:7s} median {med:8.1f} ms  x off {med / off:5.2f}  min {min(times[name]):8.1f} ms"
              + (f"  disk per probed iteration {disk / 1024:.0f} KiB" if disk else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
