"""Bad files and declarations: each refused with one message naming what was wrong, the right exit code.

The rest of the one table of bad inputs (tests/test_bad_inputs.py: settings and command lines): files for
`portspeed compare` (loss records, probe dumps), patch declarations, and checkpoint directories (missing, truncated,
foreign) for portspeed's checkpoint reader, the example trainer and the example generator. Nothing half-done: no
report file written, no patch registered, no checkpoint directory created.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.launch import REPO, run_python, run_snippet

from portspeed.errors import PatchConflictError, PatchDefinitionError
from portspeed.parity import checkpoints
from portspeed.parity import compare as compare_cli
from portspeed.patching.manager import PatchManager
from portspeed.patching.record import Patch

pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py
TIMEOUT = 180


# ------------------------------------------------------------------ portspeed compare
def _record(iters: list[int]) -> str:
    return json.dumps({"meta": {"layout": {"tp": 1}}, "iterations": [
        {"iteration": i, "lm_loss": 1.0 + i, "grad_norm": 1.0, "skipped": False} for i in iters]})


#: (files to write {name: text}, argv after the files, words)
COMPARE = [
    ({"a.json": _record([1, 2])}, ["a.json", "missing.json"], ["missing.json: no such file"]),
    ({"a.json": _record([1, 2]), "b.json": ""}, ["a.json", "b.json"], ["b.json: is empty"]),
    ({"a.json": _record([1, 2]), "b.json": '{"meta": {'}, ["a.json", "b.json"],
     ["b.json: looks like JSON but does not parse"]),
    ({"a.json": _record([1, 2]), "b.json": "{}"}, ["a.json", "b.json"], ["b.json: not a portspeed loss record"]),
    ({"a.json": _record([1, 2]), "b.log": "hello\n"}, ["a.json", "b.log"], ["b.log: no loss lines found"]),
    ({"a.json": _record([1, 2])}, ["a.json"], ["need at least two runs"]),
    ({"a.json": _record([1, 2]), "b.json": _record([1, 2])}, ["a.json", "b.json", "--atol", "-1"],
     ["--atol", "finite number >= 0"]),
]


@pytest.mark.parametrize("files,argv,words", COMPARE, ids=[" ".join(r[1]) for r in COMPARE])
def test_compare_refuses_bad_files(files: dict, argv: list[str], words: list[str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Exit 2 with the file named; the --json / --markdown reports are not written (not even half)."""
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert compare_cli.main([*argv, "--json", "r.json", "--markdown", "r.md"]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.md").exists()


# ------------------------------------------------------------------ portspeed compare --probe
def _probe_dump(root: Path, *, empty: bool = False, **over: object) -> None:
    """A small probe dump (docs/probe-format.md): one output per micro-batch on each rank, ``over`` in its meta."""
    from helpers.probe_dumps import RankDump, meta
    m = meta(**{k: v for k, v in over.items() if k in ("tp", "dp", "dp_order", "dropout", "global_batch_size")})
    m.update({k: v for k, v in over.items() if k in ("model", "releases", "version")})
    for rank in range(m["world"]):
        r = RankDump(m, rank=rank, tp=rank % m["layout"]["tp"], dp=rank // m["layout"]["tp"])
        for j in range(0 if empty else m["micro_batches"]):
            r.forward("decoder.layers.0.mlp", "MLP", [torch.ones(2, 3)], layer=0, mb=j)
        r.write(root)


_OTHER_MODEL = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 32,
                "vocab_size": 16, "num_moe_experts": None, "parameters": 1000}
#: (the run's dump: meta fields or None for no folder, words); the reference is one rank of the same model
PROBE = [
    (dict(model=_OTHER_MODEL), ["the dumps are of different models (num_layers 4 vs 2)"]),
    (dict(releases={"torch": "2.13.0", "megatron-core": "0.19.2"}),
     ["different megatron-core releases (0.16.1 vs 0.19.2)"]),
    (dict(version=2), ["probe format version 2, this portspeed reads version 1"]),
    (dict(empty=True), ["an empty dump (1 dump.json file(s), no entry)"]),
    (None, ["run: no such folder", "portspeed run --probe DIR"]),
    (dict(tp=2, dropout=True), ["dropout is on in the run", "different layouts cannot be compared"]),
    (dict(global_batch_size=8), ["different global batches (4 vs 8 samples)"]),
    (dict(dp=2, dp_order="cyclic", global_batch_size=4),
     ["nothing to compare",
      "the run's micro-batches cannot be matched (dp_order 'cyclic' with 2 data-parallel ranks)"]),
]


@pytest.mark.parametrize("run,words", PROBE, ids=[" ".join(f"{k}={v}" for k, v in (r or {"missing": 1}).items())[:40]
                                                  for r, _ in PROBE])
def test_compare_probe_refuses_dumps_it_cannot_compare(run: dict | None, words: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Exit 2, one line naming what differs; no --json report written."""
    monkeypatch.chdir(tmp_path)
    _probe_dump(tmp_path / "ref")
    if run is not None:
        _probe_dump(tmp_path / "run", **run)
    assert compare_cli.main(["--probe", "ref", "run", "--json", "r.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "r.json").exists()


# ------------------------------------------------------------------ patch declarations
def _noop(*a: object) -> None:
    return None


PATCHES = [
    (dict(name="bad name", target="json:dumps", kind="wrap", impl=_noop, reason="x"), "patch name 'bad name'"),
    (dict(name="p", target="json.dumps", kind="wrap", impl=_noop, reason="x"), "must be 'package.module:Attr.path'"),
    (dict(name="p", target="json:dumps", kind="swap", impl=_noop, reason="x"),
     "kind must be 'replace', 'wrap' or 'finder'"),
    (dict(name="p", target="json:dumps", kind="wrap", impl=42, reason="x"), "a wrap patch needs a callable"),
    (dict(name="p", target="json:dumps", kind="wrap", impl=_noop, reason=""), "give one sentence of why"),
]


@pytest.mark.parametrize("fields,words", PATCHES, ids=[w for _, w in PATCHES])
def test_bad_patch_declaration_is_refused(fields: dict, words: str) -> None:
    with pytest.raises(PatchDefinitionError, match="") as got:
        Patch(**fields)
    assert words in str(got.value)


def test_conflicting_batch_registers_nothing() -> None:
    """Two replacements of one target in one batch: refused, and the good patches of the batch are not kept."""
    mgr = PatchManager()
    good = Patch(name="t.good", target="json:loads", kind="replace", impl=_noop, reason="test")
    a = Patch(name="t.a", target="json:dumps", kind="replace", impl=_noop, reason="test")
    b = Patch(name="t.b", target="json:dumps", kind="replace", impl=_noop, reason="test")
    before = json.dumps
    with pytest.raises(PatchConflictError, match="json:dumps"):
        mgr.register([good, a, b])
    assert mgr.records() == [] and json.dumps is before


# ------------------------------------------------------------------ checkpoint directories
def _dcp(path: Path) -> Path:
    """A small torch_dist checkpoint (torch.distributed.checkpoint shards + Megatron's metadata.json)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, storage_writer=dcp.FileSystemWriter(str(path)),
             no_dist=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                                        '"common_backend": "torch", "common_backend_version": 1}')
    return path


def _truncate_shard(p: Path) -> Path:
    shard = next(p.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    return p


def _make(kind: str, root: Path) -> Path:
    p = root / "ck"
    if kind == "missing":
        return p
    if kind == "file":
        p.write_text("x")
        return p
    p.mkdir()
    if kind == "empty":
        return p
    if kind == "truncated-shard":
        return _truncate_shard(_dcp(p))
    if kind == "no-.metadata":
        (_dcp(p) / ".metadata").unlink()
        return p
    if kind == "truncated-.metadata":
        m = _dcp(p) / ".metadata"
        m.write_bytes(m.read_bytes()[:20])
        return p
    if kind == "half-written":
        (p / "__0_0.distcp").write_bytes(b"\0" * 64)
        return p
    if kind == "tracker-garbage":
        _dcp(p / "iter_0000002")
        (p / checkpoints.TRACKER).write_text("two\n")
        return p
    if kind == "tracker-dangling":
        (p / checkpoints.TRACKER).write_text("4\n")
        return p
    if kind == "deepspeed":
        (p / "latest").write_text("global_step5")
        (p / "global_step5").mkdir()
        return p
    if kind == "legacy-torch":
        (p / "mp_rank_00").mkdir()
        torch.save({"iteration": 1}, p / "mp_rank_00" / "model_optim_rng.pt")
        return p
    if kind == "zarr":
        _dcp(p)
        (p / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
        return p
    raise AssertionError(kind)


CHECKPOINTS = [
    ("missing", "does not exist"),
    ("file", "is a file, not a checkpoint directory"),
    ("empty", "is not a checkpoint: it has neither latest_checkpointed_iteration.txt nor metadata.json"),
    ("truncated-shard", "is truncated (100 of"),
    ("no-.metadata", "incomplete: no .metadata (the save did not finish)"),
    ("truncated-.metadata", "cannot be read"),
    ("half-written", "incomplete: shards but no metadata.json"),
    ("tracker-garbage", "holds 'two', not an iteration number"),
    ("tracker-dangling", "names iteration 4, but iter_0000004 is missing"),
    ("deepspeed", "is a DeepSpeed checkpoint"),
    ("legacy-torch", "legacy 'torch' format"),
    ("zarr", "is a 'zarr' dist checkpoint"),
]


@pytest.mark.parametrize("kind,words", CHECKPOINTS, ids=[k for k, _ in CHECKPOINTS])
def test_checkpoint_reader_refuses(kind: str, words: str, tmp_path: Path) -> None:
    path = _make(kind, tmp_path)
    listing = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(checkpoints.CheckpointError) as got:
        checkpoints.resolve(path)
    assert words in str(got.value) and "\n" not in str(got.value), str(got.value)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == listing, "the reader changed the directory"


def test_a_whole_checkpoint_resolves(tmp_path: Path) -> None:
    """The reader's accepting side (so the rows above fail for their own reason): a tracker and its iter dir."""
    root = tmp_path / "ck"
    _dcp(root / "iter_0000002")
    checkpoints.write_tracker(root, 2)
    assert checkpoints.resolve(root) == (root / "iter_0000002", 2)
    assert checkpoints.resolve(root / "iter_0000002") == (root / "iter_0000002", None)


#: the example trainer's own flags: (args, words)
TRAINER_FLAGS = [
    (["--fail-at", "1-3"], "--fail-at '1-3' must be RANK:ITER or RANK:ITER:save"),
    (["--fail-at", "5:2"], "rank 5 is not in 0..0"),
    (["--save-interval", "0"], "--save-interval 0 must be at least 1"),
    (["--tp", "3"], "world size 1 is not divisible by --tp 3"),
]
#: checkpoint rows the example trainer is given as --load
TRAINER_LOADS = [("missing", "does not exist"), ("truncated-shard", "is truncated"),
                 ("half-written", "shards but no metadata.json"), ("deepspeed", "is a DeepSpeed checkpoint")]


@pytest.mark.megatron
def test_example_trainer_refuses_bad_input(tmp_path: Path) -> None:
    """examples/pretrain_gpt.py: bad flags and bad --load directories exit 2 with one line, before any process
    group exists; --save is not created. One child imports the trainer once and parses each row's command line
    (the trainer's own parse_args, what its main() calls first); one row also runs as a real command."""
    save = tmp_path / "out"
    cases = [[*args, "--save", str(save)] for args, _ in TRAINER_FLAGS]
    for i, (kind, _) in enumerate(TRAINER_LOADS):
        (tmp_path / f"l{i}").mkdir()
        cases.append(["--load", str(_make(kind, tmp_path / f"l{i}")), "--save", str(save), "--iters", "1"])
    got = run_snippet(f'''
        import contextlib, io, json, sys
        sys.path.insert(0, {str(REPO / "examples")!r})
        import pretrain_gpt
        out = []
        for argv in {cases!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    pretrain_gpt.parse_args(argv)
                    code = 0
                except SystemExit as exc:
                    code = exc.code
            out.append([code, err.getvalue()])
        print(json.dumps(out))
    ''', timeout=TIMEOUT).check().last_json()
    words = [w for _, w in TRAINER_FLAGS] + [w for _, w in TRAINER_LOADS]
    for (code, err), w, argv in zip(got, words, cases):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: ") and w in lines[0], (argv, err)
    assert not save.exists()
    res = run_python([str(REPO / "examples" / "pretrain_gpt.py"), *cases[len(TRAINER_FLAGS)]], timeout=TIMEOUT)
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
