"""`portspeed info`: versions, adapters and the selection, backend gaps, patch-set gates."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import importlib_metadata
import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from fakes import fake_torch_npu  # noqa: E402
from helpers.launch import child_json  # noqa: E402

from portspeed import config  # noqa: E402

from portspeed.cli import info  # noqa: E402
from portspeed.patching.gate import GATE_STATUSES  # noqa: E402
from portspeed.accelerator import BUILTIN_ADAPTERS, get_accelerator  # noqa: E402
from portspeed.errors import ConfigError  # noqa: E402
from portspeed.patching.record import WRAP, Patch  # noqa: E402
from portspeed.versions import distribution_version  # noqa: E402


pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = info.main(list(argv))
    return rc, capsys.readouterr().out


def test_json_report_versions_come_from_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    """Versions are the installed distributions' versions; absent ones read 'not installed'."""
    rc, out = _run(capsys, "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] is True
    assert report["versions"]["torch"] == importlib_metadata.version("torch")
    for name in ("megatron-core", "deepspeed"):
        v = distribution_version(name)
        assert report["versions"][name] == (str(v) if v is not None else "not installed")


def test_absent_distribution_reads_not_installed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A framework that is not installed is reported as such, not as an error."""
    real = info.distribution_version
    monkeypatch.setattr(info, "distribution_version", lambda n: None if n == "deepspeed" else real(n))
    _, out = _run(capsys, "--json")
    assert json.loads(out)["versions"]["deepspeed"] == "not installed"


def test_adapters_and_selection(capsys: pytest.CaptureFixture[str]) -> None:
    """Every adapter is listed; exactly the selected one is marked, with the selection reason."""
    _, out = _run(capsys, "--json")
    report = json.loads(out)
    names = [a["name"] for a in report["adapters"]]
    assert names[: len(BUILTIN_ADAPTERS)] == list(BUILTIN_ADAPTERS)
    selected = [a for a in report["adapters"] if a["selected"]]
    acc = get_accelerator()
    assert [a["name"] for a in selected] == [acc.name]
    assert report["selected"]["name"] == acc.name and report["selected"]["reason"] == "auto-detected"
    cpu = next(a for a in report["adapters"] if a["name"] == "cpu")
    assert cpu["available"] is True and cpu["verified_on_hardware"] is True


def test_fake_vendor_shows_installed_available_selected(capsys: pytest.CaptureFixture[str]) -> None:
    """With (fake) torch_npu present, npu reads installed, available, and auto-detected."""
    with fake_torch_npu.installed():
        _, out = _run(capsys, "--json")
    report = json.loads(out)
    npu = next(a for a in report["adapters"] if a["name"] == "npu")
    assert npu["package_installed"] and npu["available"] and npu["selected"]
    assert report["selected"]["backend"] == "hccl" and report["selected"]["reason"] == "auto-detected"


def test_missing_vendor_package_is_reported_with_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PORTSPEED_ACCELERATOR=npu without torch_npu: the report says what to install and exits 1."""
    monkeypatch.setenv("PORTSPEED_ACCELERATOR", "npu")
    config.reload()
    rc, out = _run(capsys)
    assert rc == 1
    assert "SELECTION ERROR" in out and "torch-npu" in out
    npu_line = next(line for line in out.splitlines() if line.strip().startswith("npu "))
    assert " no " in npu_line  # not installed, not available


def test_invalid_settings_are_reported_with_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A garbage PORTSPEED_* value does not crash the report: it is shown, and the exit status is 1."""
    monkeypatch.setenv("PORTSPEED_TIMEOUT", "soon")
    with pytest.raises(ConfigError):
        config.reload()  # what a fresh `portspeed info` process meets on its first read
    rc, out = _run(capsys)
    assert rc == 1 and "SETTINGS ERROR" in out and "PORTSPEED_TIMEOUT" in out


def test_capability_gaps_are_the_backends(capsys: pytest.CaptureFixture[str]) -> None:
    """The gaps listed are those of the selected adapter's backend on this torch."""
    _, out = _run(capsys, "--json")
    caps = json.loads(out)["capabilities"]
    expected = get_accelerator().capabilities()
    assert caps["backend"] == expected.backend
    assert caps["gaps"] == json.loads(json.dumps(expected.describe(), default=str))


def test_patch_sets_cover_every_patch(capsys: pytest.CaptureFixture[str]) -> None:
    """Each patch set that exists is listed whole, each patch with a gate state."""
    _, out = _run(capsys, "--json")
    sets = {s["name"]: s for s in json.loads(out)["patch_sets"]}
    assert set(sets) == set(info.PATCH_SETS)
    from portspeed.patches.megatron import all_patches

    megatron = sets["megatron"]
    assert [p["name"] for p in megatron["patches"]] == [p.name for p in all_patches()]
    assert sum(megatron["counts"].values()) == len(all_patches())
    for s in sets.values():
        for p in s.get("patches", []):
            assert p["state"] in GATE_STATUSES  # the manager's own words: one gate()


def test_text_report_sections(capsys: pytest.CaptureFixture[str]) -> None:
    """The text report has the versions, every adapter, the backend and the patch sets."""
    rc, out = _run(capsys)
    assert rc == 0
    for needle in ("versions:", "torch", "megatron-core", "deepspeed", "adapters:", "patch sets:", "backend 'gloo'"):
        assert needle in out
    for name in BUILTIN_ADAPTERS:
        assert any(line.strip().startswith(name + " ") for line in out.splitlines()), name


def test_cli_dispatches_info(capsys: pytest.CaptureFixture[str]) -> None:
    """`portspeed info --json` goes through the dispatcher to info.main."""
    from portspeed import cli

    assert cli.main(["info", "--json"]) == 0
    assert "adapters" in json.loads(capsys.readouterr().out)


# ----------------------------------------------------------------------------- gates
def _patch(**kw: Any) -> Patch:
    base = dict(name="t.p", target="some_module:func", kind=WRAP, impl=lambda w, i, a, k: w(*a, **k), reason="test")
    return Patch(**{**base, **kw})


def test_info_and_manager_share_one_gate() -> None:
    """`portspeed info` and the manager answer with the same function, so a prediction is what happens."""
    from portspeed.patching import manager as manager_module

    assert info.gate is manager_module.gate


def test_gate_not_installed() -> None:
    """A patch for a distribution that is not installed is skipped, naming it (the manager's word)."""
    state, why = info.evaluate_gate(_patch(distribution="portspeed-no-such-dist", versions=">=1"),
                                    config.Settings(), get_accelerator())
    assert state == "skipped" and "'portspeed-no-such-dist' is not installed" in why


def test_gate_version_out_of_range() -> None:
    """A patch for other versions of an installed distribution is inactive (declared, not drift), naming both."""
    torch_v = distribution_version("torch")
    state, why = info.evaluate_gate(_patch(distribution="torch", versions="<1.0"), config.Settings(), get_accelerator())
    assert state == "inactive" and str(torch_v) in why and "<1.0" in why


def test_gate_in_range_applies() -> None:
    """A patch whose range holds the installed version would apply: pending until its module is imported."""
    state, _ = info.evaluate_gate(_patch(distribution="torch", versions=">=2"), config.Settings(), get_accelerator())
    assert state == "pending"


def test_gate_disabled_and_conditions() -> None:
    """PORTSPEED_DISABLE blocks; a false condition is inactive; a raising one failed."""
    acc = get_accelerator()
    assert info.evaluate_gate(_patch(), config.Settings(disable=("t.*",)), acc)[0] == "disabled"
    assert info.evaluate_gate(_patch(when=lambda a: a.name == "npu"), config.Settings(), acc)[0] == "inactive"

    def boom(a: Any) -> bool:
        raise RuntimeError("no")

    state, why = info.evaluate_gate(_patch(when=boom), config.Settings(), acc)
    assert state == "failed" and "RuntimeError" in why


def test_info_imports_no_framework() -> None:
    """`portspeed info` reads gates from metadata: Megatron and DeepSpeed stay unimported."""
    code = (
        "import sys, io, json, contextlib\n"
        "from portspeed.cli.info import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--json'])\n"
        "print(json.dumps(sorted(m for m in ('megatron', 'deepspeed') if m in sys.modules)))\n"
    )
    assert child_json(code, timeout=180) == []



# ----------------------------------------------------------------------------- a refused adapter
def _report() -> tuple[dict[str, Any], list[str], list[str]]:
    """The report, its text's lines and, among them, the adapters table (its heading and one row per adapter)."""
    report = info.collect()
    lines = info.render(report).splitlines()
    start = lines.index("adapters:") + 1
    return report, lines, lines[start:start + 1 + len(report["adapters"])]


def test_a_refused_entry_point_is_said_under_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       portspeed_env: Any) -> None:
    """An installed entry-point adapter whose module is missing: its row says "refused (below)" and its error
    follows the table, so no other row is padded to the error's width (the cpu row is the one it was)."""
    _, _, before = _report()
    dist = tmp_path / "zeta_adapter-0.1.dist-info"  # a real distribution's metadata, found on sys.path
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zeta-adapter\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[portspeed.adapters]\nzeta = zeta_missing_module:Zeta\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    portspeed_env()  # the selection and the entry-point scan forgotten
    report, lines, table = _report()
    assert table[-1].startswith("  zeta ") and table[-1].endswith("refused (below)"), table
    assert "ModuleNotFoundError" not in "\n".join(table), table
    cpu = [next(line for line in t if line.startswith("  cpu ")) for t in (before, table)]
    assert cpu[0] == cpu[1], cpu
    after = lines[lines.index(table[-1]) + 1]
    assert after == "  zeta: ERROR ModuleNotFoundError: No module named 'zeta_missing_module'", after
    assert report["ok"]  # auto-detection still selects an adapter


def test_a_refused_adapter_file_is_said_once_under_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            portspeed_env: Any) -> None:
    """PORTSPEED_ACCELERATOR names a file whose class lacks a member: the row stays narrow, and the error, which is
    the selection's too, is said once, as the SELECTION ERROR."""
    (tmp_path / "zeta.py").write_text("from portspeed.vendor import Accelerator\n\n"
                                      "class Zeta(Accelerator):\n    name = 'zeta'\n    backend = 'gloo'\n")
    monkeypatch.chdir(tmp_path)
    portspeed_env(PORTSPEED_ACCELERATOR="zeta.py:Zeta")
    report, lines, table = _report()
    assert not report["ok"] and table[-1].startswith("  zeta.py:Zeta ") and table[-1].endswith("refused (below)")
    assert "lacks the required member" not in "\n".join(table), table
    text = "\n".join(lines)
    assert text.count("lacks the required member 'device_type'") == 1, text
    assert "SELECTION ERROR: AdapterContractError: adapter 'zeta.py:Zeta': adapter class zeta.py:Zeta lacks" in text
