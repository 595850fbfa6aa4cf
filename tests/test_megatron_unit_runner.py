"""`portspeed megatron-tests`: Megatron-LM's unit tests launched as its CI does, with the `tests` package translated.

The CI test needs no checkout: a package laid out like Megatron-LM's ``tests/unit_tests``
(in tmp_path) whose ``test_utilities.py`` does what Megatron's does first,
``torch.cuda.set_device(rank % torch.cuda.device_count())`` and
``init_process_group(backend='nccl')``, from the ``tests`` package. Through the runner
(2 ranks, CPU) it passes; launched through plain ``portspeed run -m pytest`` (the
adaptor imported, but ``tests`` not a framework module) the same file dies in
``device_count()`` -- the failure the runner exists to remove. The stock test runs one
small real file of the checkout in MEGATRON_LM_ROOT (skipped, with the reason, without one).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.launch import REPO, free_port, run_python
from portspeed.cli import megatron_tests

UTILITIES = '''
import os
import torch
import torch.distributed


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    @staticmethod
    def initialize_distributed():
        if not torch.distributed.is_initialized():
            torch.cuda.set_device(Utils.rank % torch.cuda.device_count())
            torch.distributed.init_process_group(backend="nccl", world_size=Utils.world_size, rank=Utils.rank)
'''

FAKE_TESTS = '''
import pytest
import torch
import torch.distributed

from tests.unit_tests.test_utilities import Utils


def test_collective_on_the_translated_device():
    Utils.initialize_distributed()
    assert torch.distributed.get_backend() == "nccl"          # the requested name, as Megatron expects
    t = torch.ones(4, device=torch.cuda.current_device()) * (torch.distributed.get_rank() + 1)
    torch.distributed.all_reduce(t)
    n = torch.distributed.get_world_size()
    assert t.tolist() == [n * (n + 1) / 2] * 4


def test_device_count_translated():
    assert torch.cuda.device_count() >= 1


@pytest.mark.skip(reason="a skip the runner must count")
def test_skipped():
    pass


@pytest.mark.experimental
def test_deselected_like_megatron_ci():
    raise AssertionError("experimental tests need Megatron's --experimental flag; the runner deselects them")
'''

#: a test file in a folder without __init__.py: pytest imports it under its bare name, not under ``tests.``
ROOTLESS = '''
import torch


def test_bare_module_is_translated_too():
    assert __name__ == "test_rootless"
    assert torch.cuda.device_count() >= 1
'''

CONFTEST = '''
def pytest_configure(config):
    for m in ("experimental", "flaky", "flaky_in_dev"):
        config.addinivalue_line("markers", f"{m}: as in Megatron-LM")
'''


@pytest.fixture()
def fake_checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    unit = root / "tests" / "unit_tests"
    unit.mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    (unit / "__init__.py").write_text("")
    (unit / "conftest.py").write_text(CONFTEST)
    (unit / "test_utilities.py").write_text(textwrap.dedent(UTILITIES))
    (unit / "test_fake.py").write_text(textwrap.dedent(FAKE_TESTS))
    (unit / "rootless").mkdir()
    (unit / "rootless" / "test_rootless.py").write_text(textwrap.dedent(ROOTLESS))
    return root


def _env() -> dict[str, str]:
    return {"PORTSPEED_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO / "tests")}


@pytest.mark.multiproc
def test_runner_translates_the_tests_package_and_counts(fake_checkout: Path, tmp_path: Path) -> None:
    out = tmp_path / "outcomes.json"
    res = run_python(["-m", "portspeed.cli", "megatron-tests", "--root", str(fake_checkout), "--nproc-per-node", "2",
                      "--timeout", "150", "--log-dir", str(tmp_path / "logs"), "--json", str(out), "tests/unit_tests"],
                     timeout=180, env=_env(), drop=["PORTSPEED_FRAMEWORK_MODULES"])
    res.check()
    [got] = json.loads(out.read_text())
    assert got["target"] == "tests/unit_tests" and got["returncode"] == 0 and not got["timed_out"]
    assert got["counts"] == {"passed": 3, "skipped": 1, "deselected": 1}, got
    assert got["files"]["tests/unit_tests/rootless/test_rootless.py"]["passed"] == 1, got["files"]
    # every rank ran the file (rank 1's log too), each with its own pytest summary
    rank1 = list((tmp_path / "logs").glob("**/1/stdout.log"))
    assert rank1 and megatron_tests.parse_counts(rank1[0].read_text()) == got["counts"]


@pytest.mark.multiproc
def test_without_the_runner_the_tests_package_sees_the_real_torch_cuda(fake_checkout: Path) -> None:
    """The control: the same file through plain `portspeed run -m pytest` fails in torch.cuda.device_count()."""
    res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                      "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/unit_tests/test_fake.py",
                      "-k", "collective"],
                     timeout=150, env={**_env(), "PYTHONPATH": f"{fake_checkout}{os.pathsep}{REPO / 'tests'}"},
                     drop=["PORTSPEED_FRAMEWORK_MODULES"], cwd=fake_checkout)
    assert res.returncode != 0
    assert "ZeroDivisionError" in res.stdout + res.stderr


def test_bad_inputs_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("MEGATRON_LM_ROOT", raising=False)
    assert megatron_tests.main(["test_x.py"]) == 2
    assert "set MEGATRON_LM_ROOT or pass --root" in capsys.readouterr().err
    assert megatron_tests.main(["--root", str(tmp_path), "test_x.py"]) == 2
    assert "is not a Megatron-LM checkout" in capsys.readouterr().err
    unit = tmp_path / "tests" / "unit_tests"
    unit.mkdir(parents=True)
    (unit / "test_utilities.py").write_text("")
    assert megatron_tests.main(["--root", str(tmp_path), "no_such_file.py"]) == 2
    assert "no_such_file.py" in capsys.readouterr().err
    (unit / "test_x.py").write_text("")
    assert megatron_tests.resolve_targets(tmp_path.resolve(), ["test_x.py::test_a", str(unit / "test_x.py")]) == [
        "tests/unit_tests/test_x.py::test_a", "tests/unit_tests/test_x.py"]


def test_child_env_scopes_tests_to_the_run(tmp_path: Path) -> None:
    env = megatron_tests.child_env(tmp_path, {"PORTSPEED_FRAMEWORK_MODULES": "mine", "PYTHONPATH": "/a"},
                                   modules=["test_bare"])
    assert env["PORTSPEED_FRAMEWORK_MODULES"] == "mine,tests,test_bare"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/a"]
    assert "tests" not in os.environ.get("PORTSPEED_FRAMEWORK_MODULES", "")


@pytest.mark.stock
@pytest.mark.megatron_unit
@pytest.mark.multiproc
def test_a_real_megatron_unit_test_file(tmp_path: Path) -> None:
    """tensor_parallel/test_mappings.py of the checkout (8 ranks, as the file assumes), all passing."""
    root = os.environ.get("MEGATRON_LM_ROOT")
    if not root:
        pytest.skip("needs a Megatron-LM checkout in MEGATRON_LM_ROOT (tests/unit_tests)")
    out = tmp_path / "outcomes.json"
    res = run_python(["-m", "portspeed.cli", "megatron-tests", "--root", root, "--nproc-per-node", "8",
                      "--timeout", "600", "--json", str(out), "tensor_parallel/test_mappings.py"],
                     timeout=660, env=_env(), drop=["PORTSPEED_FRAMEWORK_MODULES"])
    res.check()
    [got] = json.loads(out.read_text())
    assert got["counts"].get("passed", 0) >= 7 and not got["counts"].get("failed"), got


def test_the_cpu_adapters_stream_block_can_be_entered_again() -> None:
    """Megatron's DDP enters one ``stream_context`` twice per grad sync (test_param_and_grad_buffer.py's
    test_grad_sync with several distributed-optimizer instances); torch.cuda.StreamContext allows it."""
    from portspeed.adapters.cpu import CpuAccelerator

    acc = CpuAccelerator()
    block = acc.stream(acc.current_stream())
    for _ in range(2):
        with block as s:
            assert s is acc.current_stream()


def test_a_checkout_pinning_another_pytest_is_said_once(tmp_path: Path) -> None:
    """Megatron-LM pins pytest for its tests (8.3.5 at core_v0.16.1); a run under another pytest says so."""
    (tmp_path / "pyproject.toml").write_text('[project.optional-dependencies]\ntest = [\n    "pytest==8.3.5",\n]\n')
    note = megatron_tests.pytest_pin_note(tmp_path, installed="9.2.0")
    assert note is not None and "pytest==8.3.5" in note and "pytest 9.2.0" in note and "TestNonStrictLoad" in note
    assert megatron_tests.pytest_pin_note(tmp_path, installed="8.3.5") is None
    (tmp_path / "pyproject.toml").write_text('dev = ["pytest==9.1.1"]\n')  # core_v0.19.0's pin: no pytest-8 caveat
    note = megatron_tests.pytest_pin_note(tmp_path, installed="9.2.0")
    assert note is not None and "pytest==9.1.1" in note and "TestNonStrictLoad" not in note
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert megatron_tests.pytest_pin_note(tmp_path, installed="9.2.0") is None
    assert megatron_tests.pytest_pin_note(tmp_path / "absent", installed="9.2.0") is None
