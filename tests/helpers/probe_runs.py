"""One true iteration of a two-layer model, recorded as probe dumps the way TP x PP x DP runs would record it.

For the ``portspeed compare --probe`` tests (tests/test_probe_compare.py, tests/test_probe_compare_order.py):
``record`` writes the dump of a layout (halves, copies, other ranks; a tweak or noise where asked), ``probe``
runs the comparison as the command line does. The dump format: tests/helpers/probe_dumps.py.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import torch

from helpers.probe_dumps import RankDump, full, meta, split

from portspeed.parity import compare as compare_cli

__all__ = ["BATCH", "FC1", "FC2", "HIDDEN", "LAYERS", "SEQ", "Tweak", "fc", "off_by", "probe", "record", "truth"]

LAYERS, SEQ, BATCH, HIDDEN = 2, 4, 2, 8
FC1, FC2 = "ColumnParallelLinear", "RowParallelLinear"


def fc(layer: int, n: int) -> str:
    return f"decoder.layers.{layer}.mlp.linear_fc{n}"


def truth(micro_batches: int, seed: int = 0) -> dict[tuple, torch.Tensor]:
    """One iteration's tensors on one rank: (phase, micro-batch, layer, name) -> tensor."""
    g = torch.Generator().manual_seed(seed)
    t: dict[tuple, torch.Tensor] = {}
    for mb in range(micro_batches):
        t[("forward", mb, -1, "embedding")] = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        for layer in range(LAYERS):
            for n in (1, 2):
                t[("forward", mb, layer, n)] = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
                t[("backward", mb, layer, n)] = torch.randn(SEQ, BATCH, HIDDEN, generator=g) * 1e-3
    for layer in range(LAYERS):
        for n in (1, 2):
            t[("parameters_grad", -1, layer, n)] = torch.randn(HIDDEN, HIDDEN, generator=g) * 1e-2
    return t


Tweak = Callable[[tuple, int, torch.Tensor], torch.Tensor]


def record(root: Path, *, tp: int = 1, dp: int = 1, pp: int = 1, per_rank_mbs: int | None = None,
           order: str = "contiguous", declared_order: str | None = None, grad_scale: float = 1.0,
           tweak: Tweak | None = None, noise: float = 0.0, phases: tuple[str, ...] = ("forward", "backward",
           "parameters_grad"), fc2_layout: dict | None = None, device: str = "cpu", **meta_over) -> Path:
    """Write the true iteration as a TP x PP x DP run records it (rank = tp_r + tp*(pp_r + pp*dp_r))."""
    m_local = per_rank_mbs or 4 // dp
    t = truth(m_local * dp)
    run_meta = meta(tp=tp, pp=pp, dp=dp, micro_batches=m_local, global_batch_size=2 * m_local * dp,
                    dp_order=declared_order or order, grad_scale=grad_scale, device=device, **meta_over)
    g = torch.Generator().manual_seed(99)
    for dp_r in range(dp):
        for pp_r in range(pp):
            for tp_r in range(tp):
                rank = tp_r + tp * (pp_r + pp * dp_r)
                r = RankDump(run_meta, rank=rank, tp=tp_r, pp=pp_r, dp=dp_r)
                layers = [L for L in range(LAYERS) if L * pp // LAYERS == pp_r]

                def put(key: tuple, part: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
                    x = t[key] * (grad_scale if key[0] == "backward" else 1.0)
                    if noise:
                        x = x * (1 + noise * torch.randn(x.shape, generator=g, dtype=x.dtype))
                    x = part(x)
                    return tweak(key, rank, x) if tweak else x

                col = lambda x, d=-1: x.chunk(tp, dim=d)[tp_r]  # noqa: E731
                for j in range(m_local):
                    mb = dp_r * m_local + j if order == "contiguous" else j * dp + dp_r
                    if "forward" in phases:
                        if pp_r == 0:
                            r.forward("embedding", "LanguageModelEmbedding",
                                      [put(("forward", mb, -1, "embedding"), lambda x: x)], layer=-1, mb=j,
                                      layout=full("tp"))
                        for L in layers:
                            r.forward(fc(L, 1), FC1, [put(("forward", mb, L, 1), col)], layer=L, mb=j,
                                      layout=split("tp", dim=-1))
                            r.forward(fc(L, 2), FC2, [put(("forward", mb, L, 2), lambda x: x)], layer=L, mb=j,
                                      layout=fc2_layout or full("tp"))
                    if "backward" in phases:
                        for L in reversed(layers):
                            r.backward(fc(L, 2), FC2, [put(("backward", mb, L, 2), lambda x: x)], layer=L, mb=j,
                                       layout=full("tp"))
                            r.backward(fc(L, 1), FC1, [put(("backward", mb, L, 1), col)], layer=L, mb=j,
                                       layout=split("tp", dim=-1))
                if "parameters_grad" in phases:
                    for L in reversed(layers):
                        for n, d in ((2, 1), (1, 0)):
                            r.params(fc(L, n), FC1 if n == 1 else FC2,
                                     {"weight": put(("parameters_grad", -1, L, n), lambda x: col(x, d))}, layer=L,
                                     layout=split("tp", dim=d) if tp > 1 else full("dp"))
                r.write(root)
    return root


def probe(ref: Path, run: Path, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = compare_cli.main(["--probe", str(ref), str(run), *extra], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def off_by(rel: float, where: Callable[[tuple, int], bool]) -> Tweak:
    return lambda key, rank, x: x * (1 + rel) if where(key, rank) else x
