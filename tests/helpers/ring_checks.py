"""What the ring context-parallel runs must show, row by row (tests/test_te_ring.py, tests/test_te_ring_megatron.py).

Each rank prints one row: per case, the largest differences (output, dq, dk, dv) between the ring and its
reference; planted errors must be off by far more; dropout rows hold what the ring drew.
"""

from __future__ import annotations

__all__ = ["TOL", "check_dropout", "check_rows"]

#: float32: ring = all-gather = CP1 within this
TOL = 1e-5


def check_rows(rows: list[dict], dropout: bool = True) -> None:
    """Ring = all-gather = a2a = CP1 within 1e-5 (output, dq, dk, dv); each planted error off by far more; with
    ``dropout``, the ring's dropout (see ``check_dropout``) in ``sbhd`` and ``thd``."""
    for row in rows:
        if dropout:
            check_dropout(row)
        for case, errs in row.items():
            if not isinstance(errs, list) or case.startswith("dropout-"):
                continue
            worst = max(errs)
            where = f"rank {row['rank']} {case} (y, dq, dk, dv): {errs}"
            if "plant-merge" in case or ("plant-order" in case and "-causal " in case):
                assert worst > 1e-2, f"a planted error went unnoticed: {where}"
            elif "plant-order" in case:
                assert worst <= TOL, where  # without a mask every block is full: the order does not matter
            else:
                assert worst <= TOL, where


def check_dropout(row: dict) -> None:
    """Attention dropout inside the ring (``ring_dropout.py``): output and q / k / v gradients = the CP1 attention
    with the masks the ring drew placed at their global positions (1e-5); one mask per block; keep rate 1 - p
    (0.3 drawn, within 5 standard deviations); the same seed gives the same output, another seed another; the
    caller's generator state is untouched (drawn inside the tracker's fork)."""
    for fmt in ("sbhd", "thd"):
        d, where = f"dropout-{fmt}", f"rank {row['rank']} dropout {fmt}"
        errs = row[f"{d} ring-vs-cp1-same-masks"]
        assert max(errs) <= TOL, f"{where} (y, dq, dk, dv): {errs}"
        rate, n, masks, blocks = row[f"{d} keep-rate"]
        assert masks == blocks > 0, f"{where}: {masks} masks for {blocks} blocks"
        assert abs(rate - 0.7) < 5 * (0.21 / n) ** 0.5, f"{where}: keep rate {rate} over {n} draws"
        assert row[f"{d} same-seed-equal"] and row[f"{d} other-seed-differs"], where
        assert row[f"{d} caller-rng-kept"], f"{where}: the caller's generator moved"
