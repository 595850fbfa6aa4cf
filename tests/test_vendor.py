"""``portspeed.vendor``: the one module a vendor imports, the required members, adapters named by file or module,
and conformance's answer to an undeclared gap (the pure part; the runs are in test_vendor_example.py)."""

from __future__ import annotations

import ast
import inspect
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import portspeed.vendor as vendor
from portspeed import config
from portspeed.accelerator import preflight, registry
from portspeed.conformance import gaps
from portspeed.vendor import AdapterContractError, BackendGaps, PrivateUse1Accelerator

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "vendor_adapter.py"


# ------------------------------------------------------------------ the module
def test_the_docstring_lists_every_member_of_the_contract() -> None:
    """Each public member of Accelerator (and PrivateUse1Accelerator's auto_detect) is named in its section."""
    members = {n for cls in (vendor.Accelerator, PrivateUse1Accelerator) for n in vars(cls)
               if not n.startswith("_")}
    doc = vendor.__doc__
    missing = sorted(m for m in members if not re.search(rf"\b{m}\b", doc))
    assert not missing, f"portspeed.vendor's docstring does not name: {missing}"


def _signature_line(op: str) -> str:
    params, star = [], False
    for p in inspect.signature(vendor.KERNEL_OPS[op]).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        params.append(p.name)
    return f"{op}({', '.join(params)})"


@pytest.mark.parametrize("op", sorted(vendor.KERNEL_OPS))
def test_the_docstring_gives_each_kernel_its_contract_signature(op: str) -> None:
    """The kernel section's signatures are the contracts' own (kernel_ops), so the page cannot drift from them."""
    assert _signature_line(op) + " -> " in vendor.__doc__


def _portspeed_imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("portspeed"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("portspeed"))
    return found


ADAPTER_FILES = sorted((REPO / "adapters").glob("*.py")) + [REPO / "portspeed/testing/testdev/adapter.py", EXAMPLE]


@pytest.mark.parametrize("path", ADAPTER_FILES, ids=lambda p: p.name)
def test_adapters_import_only_the_vendor_module(path: Path) -> None:
    """The built-in adapters, the test device's and the worked example import portspeed only as portspeed.vendor
    (besides the test device's own package: its build and kernels, what a vendor's own package would be)."""
    got = _portspeed_imports(path.read_text())
    others = {m for m in got if m != "portspeed.vendor" and not m.startswith("portspeed.testing.testdev")}
    assert not others, f"{path.name} imports {sorted(others)}; adapters import portspeed.vendor only"


def test_the_guide_imports_only_the_vendor_module() -> None:
    """Every `from portspeed... import` in docs/writing-an-adapter.md's code is `from portspeed.vendor import`."""
    doc = (REPO / "docs" / "writing-an-adapter.md").read_text()
    imports = set(re.findall(r"^\s*from (portspeed[\w.]*) import", doc, re.M))
    assert imports == {"portspeed.vendor"}, imports


# ------------------------------------------------------------------ required members
def test_a_concrete_adapter_without_a_required_member_is_refused_when_defined() -> None:
    with pytest.raises(AdapterContractError, match=r"lacks the required member 'device_type'"):
        class NoDevice(PrivateUse1Accelerator):  # noqa: F841
            name = "nodevice"
    with pytest.raises(AdapterContractError, match=r"'backend'"):
        class NoBackend(vendor.Accelerator):  # noqa: F841 - the base needs a backend (no registered default)
            name = "nobackend"
            device_type = "cpu"


def test_an_abstract_base_is_exempt_and_its_subclasses_are_not() -> None:
    class AcmeBase(PrivateUse1Accelerator, abstract=True):
        vendor_package = "acme"

    class Acme(AcmeBase):  # the backend comes from the registration for the device type (PrivateUse1)
        name = "acme"
        device_type = "acme"

    assert vendor.REQUIRED_MEMBERS.keys() == {"name", "device_type", "backend"}
    with pytest.raises(AdapterContractError, match="'name'"):
        class Nameless(AcmeBase):  # noqa: F841
            device_type = "acme"
    with pytest.raises(AdapterContractError, match="lacks the required members 'name'"):  # selected: refused too
        registry.adapter_class("portspeed.accelerator.privateuse1:PrivateUse1Accelerator")
    from portspeed.accelerator import set_accelerator

    acc = Acme()
    acc.name = ""  # emptied after definition: refused when selected
    with pytest.raises(AdapterContractError, match="'name'"):
        set_accelerator(acc)


# ------------------------------------------------------------------ named by module or file
def test_file_and_module_forms_resolve_to_one_class_from_any_directory(tmp_path: Path, portspeed_env: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative file resolves against the working directory once, to the class every later lookup gets;
    the check makes it absolute in this process's settings (the environment is left as it is: `portspeed run`
    hands the absolute path to its workers), so a rank in another directory loads the same file."""
    monkeypatch.chdir(REPO)
    rel = "examples/vendor_adapter.py:AcmeAccelerator"
    cls = registry.adapter_class(rel)
    assert cls.name == "acme" and registry.adapter_class(f"{EXAMPLE}:AcmeAccelerator") is cls
    portspeed_env(PORTSPEED_ACCELERATOR=rel)
    assert preflight.check_settings().accelerator == f"{EXAMPLE}:AcmeAccelerator"
    assert config.settings().accelerator == f"{EXAMPLE}:AcmeAccelerator"
    assert os.environ["PORTSPEED_ACCELERATOR"] == rel  # not written back for this process to read again
    monkeypatch.chdir(tmp_path)  # a rank started elsewhere
    assert registry.adapter_class(config.settings().accelerator) is cls
    assert preflight.check_settings({"PORTSPEED_ACCELERATOR": "portspeed.adapters.cpu:CpuAccelerator"}).accelerator \
        == "portspeed.adapters.cpu:CpuAccelerator"


def test_a_named_adapter_class_is_loaded_once_per_process(tmp_path: Path, portspeed_env: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The preflight's check loads the class; every later lookup (the selection's) gets it without loading again."""
    (tmp_path / "acme_once.py").write_text(EXAMPLE.read_text())
    loads: list[str] = []
    real = registry._load
    monkeypatch.setattr(registry, "_load", lambda spec: loads.append(spec) or real(spec))
    monkeypatch.chdir(tmp_path)
    portspeed_env(PORTSPEED_ACCELERATOR="acme_once.py:AcmeAccelerator")
    cls = registry.adapter_class(preflight.check_settings().accelerator)
    assert registry.adapter_class("acme_once.py:AcmeAccelerator") is cls
    assert registry.adapter_class(config.settings().accelerator) is cls and len(loads) == 1, loads


def test_portspeed_run_hands_the_absolute_adapter_file_to_its_workers(tmp_path: Path, portspeed_env: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher is where the environment is written: its workers get the file's absolute path."""
    import torch.distributed.run as tdr

    from portspeed.cli import run as launch

    seen: list[str] = []
    monkeypatch.setattr(tdr, "run", lambda args: seen.append(os.environ["PORTSPEED_ACCELERATOR"]))
    monkeypatch.chdir(REPO)
    (tmp_path / "train.py").write_text("")
    portspeed_env(PORTSPEED_ACCELERATOR="examples/vendor_adapter.py:AcmeAccelerator")
    assert launch.main(["--adaptor", "none", str(tmp_path / "train.py")]) == 0
    assert seen == [f"{EXAMPLE}:AcmeAccelerator"]


# ------------------------------------------------------------------ what conformance says to write
@pytest.mark.parametrize("adapter", ["npu", "xpu", "mlu", "musa", "hpu", "standin", "testdev"])
def test_each_declaration_writes_itself_back_as_python(adapter: str) -> None:
    """``BackendGaps.source()`` is the Python an adapter holds: evaluated, it is the same declaration."""
    declared = registry.adapter_class(adapter).backend_gaps
    assert eval(declared.source(), {"BackendGaps": BackendGaps, "torch": torch, "dist": dist}) == declared


def _row(key: tuple, ok: bool, effect: str = "raises", flagged: bool = False) -> dict:
    return {"check": " ".join(str(k) for k in key), "ok": ok, "detail": "" if ok else "x", "key": list(key),
            "flagged": flagged, **({} if ok else {"effect": effect})}


def test_undeclared_gaps_become_the_fields_that_describe_them() -> None:
    """A dtype refused by every op, a dtype silently wrong for every op, an op refused alone, a collective refused
    for everything, a flat all_gather output; a broadcast is named as something no field describes."""
    rows = []
    for op in ("SUM", "MAX", "AVG"):
        rows += [_row(("reduce_scatter_tensor", op, "bfloat16"), False),
                 _row(("reduce_scatter_tensor", op, "float32"), True)]
        rows += [_row(("all_reduce", op, "float16"), False, "wrong"), _row(("all_reduce", op, "float32"), op != "MAX")]
    rows += [_row(("all_to_all", None, dt), False) for dt in ("float32", "bfloat16")]
    rows += [_row(("all_gather_into_tensor", gaps.SHAPE, "float32"), False),
             _row(("broadcast", None, "float32"), False)]
    findings, explained, why = gaps.suggest(rows, None)
    got = {(f.field, f.value) for f in findings}
    assert got == {("unsupported_dtypes", ("reduce_scatter_tensor", torch.bfloat16)),
                   ("wrong_dtypes", ("all_reduce", torch.float16)), ("unsupported_ops", dist.ReduceOp.MAX),
                   ("unsupported_collectives", "all_to_all"), ("chunk_shaped_all_gather", True)}, got
    assert "every op was silently wrong" in next(f.what for f in findings if f.field == "wrong_dtypes")
    assert why == {("broadcast", None, "float32"): "the router cannot rewrite broadcast: the library must do it right"}
    fits = gaps.declaration(None, findings)
    assert fits.field_source("unsupported_ops") == "unsupported_ops=[dist.ReduceOp.MAX]"
    assert fits.field_source("wrong_dtypes") == 'wrong_dtypes=[("all_reduce", torch.float16)]'


def test_a_declared_gap_is_not_suggested_again_and_one_that_can_go_is_dropped() -> None:
    declared = BackendGaps(unsupported_ops=[dist.ReduceOp.AVG, dist.ReduceOp.BXOR], chunk_shaped_all_gather=True)
    rows = [_row(("all_reduce", "AVG", "bfloat16"), False, flagged=True),
            _row(("all_reduce", "SUM", "bfloat16"), False),
            _row(("all_reduce", "AVG", "float32"), True, flagged=True),
            _row(("all_reduce", "SUM", "float32"), True)]
    findings, explained, _ = gaps.suggest(rows, declared)
    assert [(f.field, f.value) for f in findings] == [("unsupported_dtypes", ("all_reduce", torch.bfloat16))]
    fits = gaps.declaration(declared, findings, drop=[("unsupported_ops", dist.ReduceOp.BXOR)])
    assert fits.source() == ('BackendGaps(unsupported_ops=[dist.ReduceOp.AVG], unsupported_dtypes=[("all_reduce", '
                             'torch.bfloat16)], chunk_shaped_all_gather=True)')
