"""One table of bad inputs: each refused with one message naming what was wrong, the right exit code, nothing half-done.

Rows cover PORTSPEED_* settings (at the adaptor's import and in `portspeed run` before any
worker starts) and `portspeed run` command lines; files for `portspeed compare`, patch
declarations and checkpoint directories are in tests/test_bad_files.py. "Nothing half-done":
no worker started (torchrun's launcher is never reached), no report file written, no patch
registered.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.launch import REPO, run_python, run_snippet

from portspeed.accelerator import preflight
from portspeed.cli import run as launch
from portspeed.errors import ConfigError, PortspeedError, UnknownAcceleratorError, UnknownBackendError
from portspeed.vendor import AdapterContractError

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
    config.note_entry_script(str(tmp_path / "train.py"))  # what the worker says before it imports the adaptor
    try:
        config.check_findable_modules("PORTSPEED_FRAMEWORK_MODULES", ["rl_helpers_beside"], env={})
    finally:
        config.note_entry_script(None)


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


def test_table_has_at_least_thirty_rows() -> None:
    """The one table of bad inputs, this file's and tests/test_bad_files.py's, has at least thirty rows."""
    from test_bad_files import CHECKPOINTS, COMPARE, PATCHES, TRAINER_FLAGS, TRAINER_LOADS

    tables = (SETTINGS, RUN_LINES, COMPARE, PATCHES, CHECKPOINTS, TRAINER_FLAGS, TRAINER_LOADS, FRAMEWORK_MODULES)
    rows = sum(map(len, tables)) + 3 + 2 * len(ADAPTER_OPTIONS)
    assert rows >= 30, rows
