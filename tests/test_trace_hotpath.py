"""The recorder's hot path (issue 25): what it looks up instead of rebuilding must equal what rebuilding gives.

``Recorder.issue`` keeps first-seen caches (dtype and device names, (shape, dtype, device) -> sizes and
their repr, caller frames by (code, instruction) -> frame dict and repr, per-group reprs) and builds the
write-through line from them. These checks hold it to the plain definitions: the line must be the
repr of the ``WRITE_THROUGH_FIELDS`` tuple of the entry (``trace_fields.write_through_line``, what
``why-hung`` reads), the frames must be the caller's, and a cache row whose code object is not the
caller's must not be used. In-process, no process group (the recorder names the group "?").
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
import torch

from portspeed.trace import fields as trace_fields
from portspeed.trace import flight_recorder as trace


@pytest.fixture
def rec(tmp_path: Path):
    r = trace.Recorder(8, str(tmp_path))
    path = tmp_path / "through.txt"
    r._wt_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    r.path = path  # type: ignore[attr-defined]
    yield r
    os.close(r._wt_fd)


def _issue(r: trace.Recorder, name: str, args: tuple, kwargs: dict | None = None) -> dict:
    """Issue as the recording frame does (issue reads the frame above its caller), then mark it done."""
    e = r.issue(name, args, kwargs or {})
    r.done(e, None)
    return e


def _lines(r: trace.Recorder) -> list[str]:
    return r.path.read_text().splitlines()  # type: ignore[attr-defined]


def test_write_through_line_is_the_repr_of_the_entry_fields(rec: trace.Recorder) -> None:
    t, h = torch.ones(3, 2), torch.zeros(5, dtype=torch.bfloat16)
    calls = [("all_reduce", (t,), {}), ("all_reduce", (t,), {}), ("all_reduce", (h,), {}),
             ("all_reduce", (), {"tensor": t}), ("all_gather", ([t, t], t), {}), ("barrier", (), {}),
             ("all_to_all", ([t, h], [t, h]), {}), ("send", (t, 1), {}), ("irecv", (h, 0), {}),
             ("gather", (t, None, 0), {}), ("reduce_scatter_tensor", (t, h), {})]
    entries = [_issue(rec, *c) for c in calls]
    written = _lines(rec)
    assert written == [trace_fields.write_through_line(e) for e in entries]  # the line's definition, on the entries
    first = dict(zip(trace.WRITE_THROUGH_FIELDS, ast.literal_eval(written[0]), strict=True))
    assert first["input_sizes"] == [[3, 2]] and first["input_dtypes"] == ["Float"] and first["pg_name"] == "?"
    assert entries[2]["input_dtypes"] == ["BFloat16"] and entries[2]["input_sizes"] == [[5]]
    assert entries[4]["output_sizes"] == [[3, 2], [3, 2]] and entries[4]["input_sizes"] == [[3, 2]]
    assert [e["collective_seq_id"] for e in entries] == [1, 2, 3, 4, 5, 6, 7, 7, 7, 8, 9]
    assert [e["p2p_seq_id"] for e in entries][-4:] == [1, 2, 2, 2]
    assert entries[7]["profiling_name"].startswith("gloo:send ") and entries[7]["ps_peer"] == 1
    assert all(e["state"] == "completed" and e["ps_device"] == "cpu" for e in entries if e["ps_op"] != "barrier")


def test_frames_are_the_callers_and_a_foreign_cache_row_is_not_used(rec: trace.Recorder) -> None:
    t = torch.ones(2)

    def site_a() -> dict:
        return _issue(rec, "all_reduce", (t,))

    def site_b() -> dict:
        return _issue(rec, "all_reduce", (t,))

    a = site_a()
    b = site_b()
    here = sys._getframe(0).f_code
    assert [f["name"] for f in a["frames"][:2]] == ["site_a", here.co_name]
    assert b["frames"][0]["name"] == "site_b" and b["frames"][1]["line"] == a["frames"][1]["line"] + 1
    assert a["frames"][0]["line"] == site_a.__code__.co_firstlineno + 1
    # the row of site_a's call, now claimed by another code object (an id reused after the first was freed)
    key = next(k for k, v in trace_fields._SITES.items() if v[0] is site_a.__code__)
    stale = {"name": "stale", "filename": "stale", "line": -1}
    trace_fields._SITES[key] = (site_b.__code__, stale, "'stale', 'stale', -1")
    again = site_a()
    assert again["frames"][0] == a["frames"][0] and "stale" not in _lines(rec)[-1]


def test_shapes_and_dtypes_seen_again_are_not_mixed_up(rec: trace.Recorder) -> None:
    seen = []
    for shape, dtype in [((4,), torch.float32), ((4,), torch.float16), ((2, 2), torch.float32), ((4,), torch.float32)]:
        e = _issue(rec, "all_reduce", (torch.ones(shape, dtype=dtype),))
        seen.append((e["input_sizes"], e["input_dtypes"], e["output_sizes"]))
    assert seen == [([[4]], ["Float"], [[4]]), ([[4]], ["Half"], [[4]]), ([[2, 2]], ["Float"], [[2, 2]]),
                    ([[4]], ["Float"], [[4]])]
    assert [ast.literal_eval(x)[6:8] for x in _lines(rec)] == [(s, d) for s, d, _ in seen]
