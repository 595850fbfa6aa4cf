"""One table of bad inputs: each refused with one message naming what was wrong, the right exit code, nothing half-done.

Rows cover PORTSPEED_* settings (at the adaptor's import and in `portspeed run` before any
worker starts), `portspeed run` command lines, files for `portspeed compare`, patch
declarations, and checkpoint directories (missing, truncated, foreign) for portspeed's
checkpoint reader, the example trainer and the example generator. "Nothing half-done":
no worker started (torchrun's launcher is never reached), no report file written, no patch
registered, no checkpoint directory created.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import pytest
import torch

from helpers.launch import REPO, run_python, run_snippet

from portspeed.accelerator import preflight
from portspeed.cli import run as launch
from portspeed.errors import (ConfigError, PatchConflictError, PatchDefinitionError,
                              PortspeedError, UnknownAcceleratorError, UnknownBackendError)
from portspeed.vendor import AdapterContractError
from portspeed.parity import checkpoints
from portspeed.parity import compare as compare_cli
from portspeed.patching.manager import PatchManager
from portspeed.patching.record import Patch

pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py
TIMEOUT = 180
VENDOR_EXAMPLE = REPO / "examples" / "vendor_adapter.py"  # the one-file adapter
LACKING_MEMBER = REPO / "tests" / "data" / "adapter_lacking_member.py"  # a one-file adapter without device_type

# ------------------------------------------------------------------ settings
#: (environment, exception type, words the one-line message must hold)
SETTINGS = [
    ({"PORTSPEED_ACCELERATOR": "tpu"}, UnknownAcceleratorError, ["PORTSPEED_ACCELERATOR='tpu'", "accepted: cpu"]),
    ({"PORTSPEED_ACCELERATOR": "cuda:0"}, ConfigError, ["PORTSPEED_ACCELERATOR='cuda:0'", "adapter name"]),
    # an adapter named by module or file (not installed): what is missing, named
    ({"PORTSPEED_ACCELERATOR": "missing_module:X"}, UnknownAcceleratorError,
     ["PORTSPEED_ACCELERATOR='missing_module:X'", "no module named 'missing_module'"]),
    ({"PORTSPEED_ACCELERATOR": f"{VENDOR_EXAMPLE}:NoSuchClass"}, UnknownAcceleratorError,
     ["has no 'NoSuchClass'", "the adapter classes it defines: AcmeAccelerator"]),
    ({"PORTSPEED_ACCELERATOR": "/no/such/dir/acme.py:Acme"}, UnknownAcceleratorError,
     ["the file '/no/such/dir/acme.py' does not exist"]),
    ({"PORTSPEED_ACCELERATOR": f"{LACKING_MEMBER}:NoDeviceType"}, AdapterContractError,
     ["NoDeviceType lacks the required member 'device_type'"]),
    ({"PORTSPEED_BACKEND": "fooccl"}, UnknownBackendError, ["PORTSPEED_BACKEND='fooccl'", "accepted:", "gloo"]),
    ({"PORTSPEED_BACKEND": "nccl,gloo"}, ConfigError, ["PORTSPEED_BACKEND='nccl,gloo'", "one name"]),
    ({"PORTSPEED_STRICT": "maybe"}, ConfigError, ["PORTSPEED_STRICT='maybe'", "1/0, true/false"]),
    ({"PORTSPEED_NAN_CHECK": "sometimes"}, ConfigError, ["PORTSPEED_NAN_CHECK='sometimes'", "1/0, true/false"]),
    ({"PORTSPEED_NAN_CHEK": "1"}, ConfigError, ["PORTSPEED_NAN_CHEK", "did you mean PORTSPEED_NAN_CHECK"]),
    ({"PORTSPEED_DISABLE": "ok.name, bad name"}, ConfigError, ["PORTSPEED_DISABLE", "'bad name'"]),
    ({"PORTSPEED_LOG_LEVEL": "LOUD"}, ConfigError, ["PORTSPEED_LOG_LEVEL='LOUD'", "DEBUG, INFO"]),
    ({"PORTSPEED_TIMEOUT": "-5"}, ConfigError, ["PORTSPEED_TIMEOUT='-5'", "positive number of seconds"]),
    ({"PORTSPEED_TIMEOUT": "soon"}, ConfigError, ["PORTSPEED_TIMEOUT='soon'", "positive number of seconds"]),
    ({"PORTSPEED_FRAMEWORK_MODULES": "torch"}, ConfigError, ["PORTSPEED_FRAMEWORK_MODULES", "['torch']"]),
    ({"PORTSPEED_FRAMEWORK_MODULES": "bad name!"}, ConfigError, ["PORTSPEED_FRAMEWORK_MODULES", "'bad name!'"]),
    ({"PORTSPEED_ACCELERATER": "cpu"}, ConfigError, ["PORTSPEED_ACCELERATER", "did you mean PORTSPEED_ACCELERATOR"]),
    ({"PORTSPEED_STIRCT": "1"}, ConfigError, ["PORTSPEED_STIRCT", "did you mean PORTSPEED_STRICT"]),
    ({"PORTSPEED_TE_KERNELS": "fast"}, ConfigError, ["PORTSPEED_TE_KERNELS='fast'", "'fast' is not an implementation",
                                                     "vendor, torch, reference"]),
    ({"PORTSPEED_TE_KERNELS": "softmax=torch"}, ConfigError, ["PORTSPEED_TE_KERNELS='softmax=torch'",
                                                              "'softmax' is not an operation", "rms_norm"]),
    ({"PORTSPEED_TE_KERNEL": "torch"}, ConfigError, ["PORTSPEED_TE_KERNEL", "did you mean PORTSPEED_TE_KERNELS"]),
    ({"PORTSPEED_TRACE": "-1"}, ConfigError, ["PORTSPEED_TRACE='-1'", "not a non-negative integer"]),
    ({"PORTSPEED_TRACE": "lots"}, ConfigError, ["PORTSPEED_TRACE='lots'", "not a non-negative integer"]),
    ({"PORTSPEED_TRACE": "²"}, ConfigError, ["PORTSPEED_TRACE='²'", "not a non-negative integer", "ASCII digits"]),
    ({"PORTSPEED_HANG_TIMEOUT": "soon"}, ConfigError, ["PORTSPEED_HANG_TIMEOUT='soon'", "positive number of seconds"]),
    ({"PORTSPEED_TRACE_DIR": "/etc/passwd/dumps"}, ConfigError, ["PORTSPEED_TRACE_DIR='/etc/passwd/dumps'",
                                                                 "not a writable folder"]),
    ({"PORTSPEED_TRACE_ON_EXIT": "maybe"}, ConfigError, ["PORTSPEED_TRACE_ON_EXIT='maybe'", "1/0, true/false"]),
    ({"PORTSPEED_PROBE_DIR": "/tmp", "PORTSPEED_PROBE_LEVEL": "deep"}, ConfigError,
     ["PORTSPEED_PROBE_LEVEL='deep' is not a probe level", "module", "op"]),
    ({"PORTSPEED_PROBE_DIR": "/tmp", "PORTSPEED_PROBE_ITERATIONS": "5:2"}, ConfigError,
     ["PORTSPEED_PROBE_ITERATIONS='5:2' is not a range of iterations", "A:B"]),
    ({"PORTSPEED_PROBE_DIR": "/tmp", "PORTSPEED_PROBE_RANKS": "zero"}, ConfigError,
     ["PORTSPEED_PROBE_RANKS='zero' is not a list of ranks"]),
    ({"PORTSPEED_PROBE_DIR": "/etc/passwd/probe"}, ConfigError, ["PORTSPEED_PROBE_DIR='/etc/passwd/probe'",
                                                                 "not a writable folder"]),
    ({"PORTSPEED_PROBE_NAN": "1"}, ConfigError, ["PORTSPEED_PROBE_NAN is set but PORTSPEED_PROBE_DIR is not"]),
    ({"PORTSPEED_PROBE_ITERATION": "1:2"}, ConfigError, ["did you mean PORTSPEED_PROBE_ITERATIONS"]),
]


def _ids(rows: list) -> list[str]:
    return [" ".join(f"{k}={v}" for k, v in r[0].items()) for r in rows]


@pytest.mark.parametrize("env,exc_type,words", SETTINGS, ids=_ids(SETTINGS))
def test_setting_refused_by_name_and_value(env: dict, exc_type: type, words: list[str]) -> None:
    """The import-time check (what `import portspeed.megatron_adaptor` runs) raises a portspeed error, one line."""
    with pytest.raises(exc_type) as got:
        preflight.check_settings(env)
    msg = str(got.value)
    assert isinstance(got.value, PortspeedError) and "\n" not in msg
    for w in words:
        assert w in msg, msg


@pytest.fixture()
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> list:
    """torchrun's launcher, replaced by a recorder: a refused command line must never reach it."""
    import torch.distributed.run as tdr

    calls: list = []
    monkeypatch.setattr(tdr, "run", lambda args: calls.append(args))
    return calls


@pytest.fixture()
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "train.py").write_text("raise SystemExit('the script ran')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _refused_by_run(argv: list[str], env: dict, mp: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, calls: list,
                    words: list[str]) -> None:
    for k, v in env.items():  # set, not read: reading is what `portspeed run` must do (and refuse)
        mp.setenv(k, v)
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("portspeed run: error: ") and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    assert calls == [], "a worker group was started for a refused command line"


@pytest.mark.parametrize("env,exc_type,words", SETTINGS, ids=_ids(SETTINGS))
def test_setting_refused_by_portspeed_run_before_spawning(env: dict, exc_type: type, words: list[str], script: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture, no_spawn: list) -> None:
    _refused_by_run(["--nproc-per-node", "2", "train.py"], env, monkeypatch, capsys, no_spawn, words)


#: command lines and device / layout checks `portspeed run` makes before it spawns: (argv, env, words)
RUN_LINES = [
    (["--nproc-per-node", "2", "train.py", "--tp", "4"], {}, ["world size 2", "tensor-parallel 4"]),
    (["--nproc-per-node", "2", "train.py", "--pp", "3"], {}, ["world size 2", "pipeline-parallel 3"]),
    (["--nnodes", "2", "--nproc-per-node", "2", "train.py", "--tensor-model-parallel-size=3"], {},
     ["world size 4", "tensor-parallel 3"]),
    (["--nproc-per-node", "1", "train.py"], {"PORTSPEED_ACCELERATOR": "npu"}, ["'torch-npu'", "install it"]),
    (["--nproc-per-node", "2", "missing.py"], {}, ["training script 'missing.py' not found"]),
    (["--adaptor", "bogus", "train.py"], {}, ["--adaptor 'bogus' is neither a known adaptor"]),
    (["--no-python", "train.py"], {}, ["--no-python runs TRAINING_SCRIPT as an executable"]),
    (["--hang-timeout", "0", "train.py"], {}, ["--hang-timeout '0' is not a positive number of seconds"]),
    (["--hang-timeout", "soon", "train.py"], {}, ["--hang-timeout 'soon' is not a positive number of seconds"]),
    (["--hang-timeout", "60", "train.py"], {"PORTSPEED_TRACE": "0"}, ["--hang-timeout needs the flight recorder",
                                                                       "PORTSPEED_TRACE='0'"]),
    (["--hang-timeout", "60", "train.py"], {"PORTSPEED_TRACE": "00"}, ["--hang-timeout needs the flight recorder",
                                                                        "PORTSPEED_TRACE='00' reads 0 entries"]),
    # a folder no one can make, root included (root passes the settings' permission check everywhere)
    (["--hang-timeout", "60", "train.py"], {"PORTSPEED_TRACE_DIR": "/proc/portspeed-dumps"},
     ["PORTSPEED_TRACE_DIR='/proc/portspeed-dumps' is not a writable folder"]),
]


@pytest.mark.parametrize("argv,env,words", RUN_LINES, ids=[" ".join(r[0]) for r in RUN_LINES])
def test_portspeed_run_refuses_before_spawning(argv: list[str], env: dict, words: list[str], script: Path,
                                               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                               no_spawn: list) -> None:
    _refused_by_run(argv, env, monkeypatch, capsys, no_spawn, words)


#: `portspeed run --probe` lines refused before any worker starts, the probe folder ("dump") never made
PROBE_LINES = [
    (["--probe", "dump", "--probe-level", "deep", "train.py"], ["--probe-level 'deep' is not a probe level"]),
    (["--probe", "dump", "--probe-iterations", "2-4", "train.py"],
     ["--probe-iterations '2-4' is not a range of iterations", "A:B"]),
    (["--probe", "dump", "--probe-iterations", "0:3", "train.py"], ["--probe-iterations '0:3' is not a range"]),
    (["--nproc-per-node", "2", "--probe", "dump", "--probe-ranks", "0,2", "train.py"],
     ["--probe-ranks '0,2': rank 2 is not in this job's ranks 0..1"]),
    (["--probe-nan", "train.py"], ["--probe-nan needs --probe DIR"]),
    (["--probe", "train.py/dump", "train.py"], ["--probe 'train.py/dump' is not a writable folder"]),
    # a folder no one can make, root included (root passes the permission check everywhere)
    (["--probe", "/proc/portspeed-probe", "train.py"], ["--probe '/proc/portspeed-probe' is not a writable folder"]),
]


@pytest.mark.parametrize("argv,words", PROBE_LINES, ids=[" ".join(r[0]) for r in PROBE_LINES])
def test_probe_line_refused_before_spawning(argv: list[str], words: list[str], script: Path,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                            no_spawn: list) -> None:
    _refused_by_run(argv, {}, monkeypatch, capsys, no_spawn, words)
    assert not (script / "dump").exists() and not Path("/proc/portspeed-probe").exists()


def test_probe_folder_holding_a_dump_is_refused_and_kept(script: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture, no_spawn: list) -> None:
    """An earlier run's dump is never overwritten: `portspeed run --probe DIR` names it and starts nothing."""
    old = script / "dump" / "step1" / "rank1" / "dump.json"
    old.parent.mkdir(parents=True)
    old.write_text('{"data": {}}')
    _refused_by_run(["--probe", "dump", "train.py"], {}, monkeypatch, capsys, no_spawn,
                    ["--probe 'dump' already holds a probe dump", "step1/rank1/dump.json", "remove it or choose"])
    assert old.read_text() == '{"data": {}}'


#: `portspeed conformance --adapter X` and `portspeed info --adapter X`: (X, words)
ADAPTER_OPTIONS = [
    ("missing_module:X", "no module named 'missing_module'"),
    (f"{VENDOR_EXAMPLE}:NoSuchClass", "has no 'NoSuchClass'"),
    ("no_such_file.py:Acme", "no_such_file.py' does not exist"),
    (f"{LACKING_MEMBER}:NoDeviceType", "lacks the required member 'device_type'"),
    ("cuda:0", "is not an adapter name, module:Class or path/to/file.py:Class"),
]


@pytest.mark.parametrize("command", ["conformance", "info"])
@pytest.mark.parametrize("value,words", ADAPTER_OPTIONS, ids=[v.rsplit("/", 1)[-1] for v, _ in ADAPTER_OPTIONS])
def test_adapter_option_refused_in_one_line(command: str, value: str, words: str, capsys: pytest.CaptureFixture,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--adapter` of `portspeed conformance` / `info`: exit 2, one line naming the option, the value and what is
    missing; nothing run, and PORTSPEED_ACCELERATOR left as it was."""
    from portspeed.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main([command, "--adapter", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--adapter {value!r}" in err and words in err, err
    assert "PORTSPEED_ACCELERATOR" not in os.environ


def test_unknown_accelerator_fails_the_adaptor_import_itself() -> None:
    """A real `import portspeed.megatron_adaptor`: the portspeed exception, no trigger left, nothing patched."""
    res = run_snippet('''
        import json, sys
        try:
            import portspeed.megatron_adaptor
        except Exception as exc:
            import portspeed
            print(json.dumps({"type": type(exc).__name__, "msg": str(exc),
                              "records": len(portspeed.manager().records()),
                              "triggers": [repr(f) for f in sys.meta_path if "activation trigger" in repr(f)],
                              "megatron": "megatron" in sys.modules}))
    ''', timeout=TIMEOUT, env={"PORTSPEED_ACCELERATOR": "tpu"})
    got = res.check().last_json()
    assert got["type"] == "UnknownAcceleratorError" and "PORTSPEED_ACCELERATOR='tpu'" in got["msg"]
    assert got["records"] == 0 and got["triggers"] == [] and got["megatron"] is False


#: PORTSPEED_FRAMEWORK_MODULES entries no finder locates (refused at the adaptor's import, naming them) and
#: entries that are accepted: (value, refused names or [] when accepted)
FRAMEWORK_MODULES = [
    ("no_such_pkg_rl", ["no_such_pkg_rl"]),
    ("json,jsn", ["jsn"]),
    ("json.no_such_sub", ["json.no_such_sub"]),
    ("portspeed.no_such_sub", ["portspeed.no_such_sub"]),
    ("__main__,json.decoder", []),
]


@pytest.mark.parametrize("value,refused", FRAMEWORK_MODULES, ids=[v for v, _ in FRAMEWORK_MODULES])
def test_framework_module_that_cannot_be_imported_is_refused(value: str, refused: list[str]) -> None:
    """Checked without importing anything new (a dotted name's parent is not run to find it)."""
    from portspeed import config

    names = [n for n in value.split(",")]
    if not refused:
        config.check_findable_modules("PORTSPEED_FRAMEWORK_MODULES", names, env={})
        return
    with pytest.raises(ConfigError) as got:
        config.check_findable_modules("PORTSPEED_FRAMEWORK_MODULES", names, env={})
    msg = str(got.value)
    assert "\n" not in msg and "PORTSPEED_FRAMEWORK_MODULES" in msg and repr(refused) in msg, msg
    config.check_findable_modules("PORTSPEED_FRAMEWORK_MODULES", names,
                                  env={config.LATE_MODULES_ENV: ",".join(refused)})


def test_framework_module_beside_the_script_counts_under_portspeed_run(tmp_path: Path) -> None:
    """`portspeed run`'s worker imports the adaptor before the script's folder is on sys.path: look there too."""
    from portspeed import config

    (tmp_path / "rl_helpers_beside.py").write_text("")
    with pytest.raises(ConfigError, match="rl_helpers_beside"):
        config.check_findable_modules("PORTSPEED_FRAMEWORK_MODULES", ["rl_helpers_beside"], env={})
    config.check_findable_modules("PORTSPEED_FRAMEWORK_MODULES", ["rl_helpers_beside"],
                                  env={"PORTSPEED_RUN_TARGET": f"path:{tmp_path / 'train.py'}"})


def test_unimportable_framework_module_fails_the_adaptor_import_itself() -> None:
    """A real `import portspeed.megatron_adaptor` with a misspelt module: ConfigError naming it, no trigger left."""
    res = run_snippet('''
        import json, sys
        try:
            import portspeed.megatron_adaptor
        except Exception as exc:
            print(json.dumps({"type": type(exc).__name__, "msg": str(exc),
                              "triggers": [repr(f) for f in sys.meta_path if "activation trigger" in repr(f)],
                              "imported": "my_rl_trainr" in sys.modules}))
    ''', timeout=TIMEOUT, env={"PORTSPEED_ACCELERATOR": "cpu", "PORTSPEED_FRAMEWORK_MODULES": "__main__,my_rl_trainr"})
    got = res.check().last_json()
    assert got["type"] == "ConfigError" and "['my_rl_trainr']" in got["msg"], got
    assert "PORTSPEED_FRAMEWORK_MODULES" in got["msg"] and got["triggers"] == [] and got["imported"] is False


@pytest.mark.testdev
def test_more_ranks_than_devices_is_refused_before_spawning(tmp_path: Path) -> None:
    """The test device with 1 device and --nproc-per-node 2: exit 2, one line, the script never ran."""
    (tmp_path / "train.py").write_text("open('ran', 'w').write('1')\n")
    res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "2", "train.py"], timeout=TIMEOUT,
                     cwd=tmp_path, env={"PORTSPEED_ACCELERATOR": "testdev", "PORTSPEED_TESTDEV_DEVICES": "1"})
    assert res.returncode == 2, res.stderr[-2000:]
    assert "2 ranks on this node need 2 devices, but the adapter sees 1 device(s)" in res.stderr
    assert not (tmp_path / "ran").exists()


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


def test_table_has_at_least_thirty_rows() -> None:
    tables = (SETTINGS, RUN_LINES, COMPARE, PATCHES, CHECKPOINTS, TRAINER_FLAGS, TRAINER_LOADS, FRAMEWORK_MODULES)
    rows = sum(map(len, tables)) + 3 + 2 * len(ADAPTER_OPTIONS)
    assert rows >= 30, rows
