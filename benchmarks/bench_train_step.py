"""A/B: one TP1 training step of examples/pretrain_gpt.py with portspeed's translation vs bypassed.

A (portspeed): the step as it runs under ``import portspeed.megatron_adaptor``.
B (bypassed): the same process, model and data, with the translation's hot entry points
short-circuited for the timed region only: the torch view's factories become the cheapest
hand-port (a device argument, if any, is replaced by the CPU device without looking at it;
Megatron's step passes ``device="cuda"`` literally, so raw torch cannot run it),
``torch.cuda.current_device()`` in the view answers ``torch.device('cpu')`` directly (what
a hand-written CPU port would pass), framework modules' ``import`` statements use the plain
``__import__``, and the torch_cuda wrappers on
Tensor/Module (``to``, ``cuda``) are taken off (``type`` becomes a plain function that always
answers in CUDA spelling, since Megatron's clip_grads asserts it every step). That is the cost floor a
translation could reach; the ratio A/B is its overhead (goal <= 1.01).

Steps alternate A,B / B,A to spread drift; the ratio of medians and the ratio of minima
(less sensitive to other processes on a shared machine) are printed. Single
process (world size 1, Gloo), OMP_NUM_THREADS=1::

    OMP_NUM_THREADS=1 python benchmarks/bench_train_step.py --pairs 30

``--trace N``: the flight recorder's cost instead (issue 25). Recording (``PORTSPEED_TRACE=N``,
write-through on) is installed at import; A is the step with it, B the same step with every
recorded ``torch.distributed`` function swapped back, wherever it is bound, for the function it
wraps (the router's, or torch's): recording off, as a run without ``PORTSPEED_TRACE`` has it::

    OMP_NUM_THREADS=1 python benchmarks/bench_train_step.py --pairs 30 --trace 2000

``--trace N --per-call``: the same A/B, resolved per call (a 2 % effect is within a shared machine's
step-to-step noise): every binding, recorded or not, goes through one timing frame; each call's time
is kept by its position in the step, and the recorder's cost per step is the sum over positions of
median(recording) - median(off). (The recorded entries then name the timing frame as the caller.)
"""

from __future__ import annotations

import os
import socket
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "--trace" in sys.argv:  # recording is decided when the patches are made, at the adaptor's import
    import tempfile

    os.environ["PORTSPEED_TRACE"] = sys.argv[sys.argv.index("--trace") + 1]
    os.environ.setdefault("PORTSPEED_TRACE_DIR", tempfile.mkdtemp(prefix="bench-trace-"))

import portspeed.megatron_adaptor  # noqa: E402,F401

import argparse  # noqa: E402
import builtins  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

import torch  # noqa: E402
import wrapt  # noqa: E402

from portspeed.translation import importer as translation  # noqa: E402

_METHODS = [(torch.Tensor, "to"), (torch.Tensor, "cuda"), (torch.Tensor, "type"),
            (torch.nn.Module, "to"), (torch.nn.Module, "cuda")]
_TYPE = torch._C.TensorBase.type


def _direct_type(self, *args, **kwargs):
    """Hand-port of Tensor.type for B: CUDA spelling for everyone, no caller check, no wrapt."""
    if args or kwargs:
        return _TYPE(self, *args, **kwargs)
    return "torch.cuda." + _TYPE(self)[6:]


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Short-circuit the translation's hot paths (see the module docstring); restore them after."""
    tv, cv = translation.torch_view(), translation.cuda_view()
    saved_tv = {n: tv.__dict__[n] for n in translation.FACTORIES + ("autocast",) if n in tv.__dict__}
    cpu = torch.device("cpu")
    saved_methods = []
    try:
        for n in saved_tv:
            tv.__dict__[n] = _forced_cpu(getattr(torch, n), cpu)
        cv.__dict__["current_device"] = lambda: cpu
        if translation._BUILTINS is not None:  # in-function `import` statements of framework modules
            scoped_import = translation._BUILTINS["__import__"]
            translation._BUILTINS["__import__"] = builtins.__import__
        for owner, name in _METHODS:
            raw = owner.__dict__.get(name)
            if raw is None:
                continue
            if isinstance(raw, wrapt.FunctionWrapper):
                inner = raw
                while isinstance(inner, wrapt.FunctionWrapper):
                    inner = inner.__wrapped__
            elif getattr(raw, "__module__", "").startswith("portspeed"):  # a replacement function
                inner = vars(torch._C.TensorBase)[name]
            else:
                continue
            saved_methods.append((owner, name, raw))
            setattr(owner, name, _direct_type if name == "type" else inner)
        yield
    finally:
        for owner, name, raw in saved_methods:
            setattr(owner, name, raw)
        cv.__dict__.pop("current_device", None)
        if translation._BUILTINS is not None:
            translation._BUILTINS["__import__"] = scoped_import
        tv.__dict__.update(saved_tv)


def _recorded_bindings() -> list[tuple[dict, str, object, object]]:
    """(namespace, name, recorded, unrecorded) for every binding of a recorded torch.distributed function."""
    from portspeed.trace import flight_recorder as trace

    c10d = sys.modules["torch.distributed.distributed_c10d"]
    swap = {}
    for name in (*trace.OPS, "batch_isend_irecv"):
        f = getattr(c10d, name, None)
        code = getattr(f, "__code__", None)
        if code is None or not getattr(f, "__module__", "").startswith("portspeed.trace.flight_recorder"):
            continue
        free = code.co_freevars
        inner = "inner" if "inner" in free else "original"
        swap[id(f)] = (f, f.__closure__[free.index(inner)].cell_contents)
    out = []
    for mod in list(sys.modules.values()):
        ns = getattr(mod, "__dict__", None)
        if not isinstance(ns, dict):
            continue
        for k, v in list(ns.items()):
            if id(v) in swap and swap[id(v)][0] is v:
                out.append((ns, k, v, swap[id(v)][1]))
    return out


def per_call_timers(bindings: list, clock=time.perf_counter_ns) -> tuple[list, list, dict]:
    """Bindings that time every call (recorded and unrecorded alike, one frame each): (recorded bindings,
    unrecorded bindings, {"pos": [next position in the step], "on": {position: [ns]}, "off": {...}})."""
    state: dict = {"pos": [0], "side": None, "on": {}, "off": {}}  # side None: not kept (warm-up)

    def timed(fn):
        def call(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                if state["side"] is not None:
                    p = state["pos"][0]
                    state["pos"][0] = p + 1
                    state[state["side"]].setdefault(p, []).append(dt)
        return call

    made: dict[int, object] = {}
    on = [(ns, k, made.setdefault(id(r), timed(r)), None) for ns, k, r, _ in bindings]
    off = [(ns, k, None, made.setdefault(id(u), timed(u))) for ns, k, _, u in bindings]
    return on, off, state


@contextlib.contextmanager
def unrecorded(bindings: list) -> Iterator[None]:
    """Recording off for the block: each binding back to the function the recorder wraps."""
    for ns, k, _, plain in bindings:
        ns[k] = plain
    try:
        yield
    finally:
        for ns, k, rec, _ in bindings:
            ns[k] = rec


def _forced_cpu(fn, cpu: torch.device):
    def direct(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = cpu
        return fn(*args, **kwargs)
    return direct


def count_translation_calls(step) -> "collections.Counter[str]":
    """Run ``step`` once under a profile hook; count calls into portspeed's translation and patch code."""
    import collections

    roots = (str(Path(translation.__file__).parent), str(Path(__file__).resolve().parents[1] / "patches"))
    counts: collections.Counter[str] = collections.Counter()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            counts[f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"] += 1

    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=30, help="timed A/B pairs (after warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-layers", default="4")
    p.add_argument("--hidden-size", default="64")
    p.add_argument("--trace", type=int, default=None, metavar="N",
                   help="A/B the flight recorder instead: A recording (ring of N), B recording off")
    p.add_argument("--per-call", action="store_true",
                   help="with --trace: also time each call through its binding, by position in the step")
    opts = p.parse_args(argv)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import pretrain_gpt as pg

    args = pg.parse_args(["--num-layers", opts.num_layers, "--hidden-size", opts.hidden_size, "--seq-length", "32",
                          "--vocab-size", "128", "--global-batch-size", "8", "--micro-batch-size", "2"])
    model, optimizer, _, _ = pg.setup(args)
    timers = None
    if opts.trace:
        bindings = _recorded_bindings()
        assert bindings, "PORTSPEED_TRACE is set but no recorded torch.distributed function was found"
        other = lambda: unrecorded(bindings)  # noqa: E731
        if opts.per_call:  # A: the timed recorded functions; B: the timed unrecorded ones
            on, off, timers = per_call_timers(bindings)
            for ns, k, f, _ in on:
                ns[k] = f
            swap = [(*timed[:3], plain[3]) for timed, plain in zip(on, off)]  # (namespace, key, recorded, unrecorded)
            other = lambda: unrecorded(swap)  # noqa: E731
        from portspeed.trace import flight_recorder as trace
        rec = trace.recorder()
        first_id = rec.record_id
    else:
        other = bypassed
    it = 0
    for _ in range(opts.warmup):
        it += 1
        pg.train_step(args, model, optimizer, it)
        with other():
            it += 1
            pg.train_step(args, model, optimizer, it)
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(opts.pairs):
        for side in ("AB" if i % 2 == 0 else "BA"):
            it += 1
            ctx = other() if side == "B" else contextlib.nullcontext()
            if timers is not None:
                timers["pos"][0], timers["side"] = 0, ("on" if side == "A" else "off")
            with ctx:
                t0 = time.perf_counter()
                pg.train_step(args, model, optimizer, it)
                times[side].append(time.perf_counter() - t0)
    if opts.trace:
        per_step = (rec.record_id - first_id) / (opts.warmup + opts.pairs)
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        amin, bmin = min(times["A"]), min(times["B"])
        paired = statistics.median(x / y for x, y in zip(times["A"], times["B"]))  # each pair: adjacent steps
        print(f"train step TP1 ({opts.num_layers} layers, hidden {opts.hidden_size}), {opts.pairs} pairs, "
              f"{per_step:.1f} recorded calls per step ({len(bindings)} bindings swapped for B): "
              f"recording median {a * 1e3:.2f} ms, off median {b * 1e3:.2f} ms, ratio {a / b:.4f}; "
              f"min {amin * 1e3:.2f} / {bmin * 1e3:.2f} ms, ratio of minima {amin / bmin:.4f}; "
              f"median of pair ratios {paired:.4f}")
        if timers is not None:
            both = sorted(set(timers["on"]) & set(timers["off"]))
            deltas = [(statistics.median(timers["on"][q]) - statistics.median(timers["off"][q])) / 1e3 for q in both]
            print(f"per call ({len(both)} call positions a step, {opts.pairs} steps each side): recording adds "
                  f"{sum(deltas):.0f} us a step ({sum(deltas) / (b * 1e6):.2%} of the off median), "
                  f"median {statistics.median(deltas):.1f} us a call; by position (us): "
                  + " ".join(f"{d:.0f}" for d in deltas))
        return 0
    counts = count_translation_calls(lambda: pg.train_step(args, model, optimizer, it + 1))
    print("portspeed calls in one step: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    amin, bmin = min(times["A"]), min(times["B"])
    print(f"train step TP1 ({opts.num_layers} layers, hidden {opts.hidden_size}), {opts.pairs} pairs: "
          f"portspeed median {a * 1e3:.2f} ms, bypassed median {b * 1e3:.2f} ms, ratio {a / b:.4f}; "
          f"min {amin * 1e3:.2f} / {bmin * 1e3:.2f} ms, ratio of minima {amin / bmin:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
