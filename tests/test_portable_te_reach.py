"""The portable Transformer Engine's reach: who sees it, when, and that an installed TE always wins.

Each case runs in a child interpreter (the served import is process-wide state):

- Megatron's default (no ``--transformer-impl`` on the command line): the TE extension, the
  GPT layer specs and ``megatron.core.utils`` see ``transformer_engine`` (``HAVE_TE`` True,
  ``get_te_version()`` the version chosen for the release); every other Megatron module that
  probes for TE keeps ``HAVE_TE`` False; ``transformer_engine`` is not in ``sys.modules`` and
  not findable by other code; ``revert()`` takes the patch off.
- ``--transformer-impl local`` on the command line, or ``PORTSPEED_DISABLE`` naming the patch:
  nothing is served (the extension's ``HAVE_TE`` is False).
- A stand-in *distribution* named ``transformer_engine`` (a dist-info and a package in a
  temporary directory on ``PYTHONPATH``; no machine here can install NVIDIA's): the patch is
  inactive, ``portspeed info`` names the installed one, and Megatron reads the stand-in's version.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from helpers.launch import child_json
from helpers.requires import require

pytestmark = [pytest.mark.megatron]

PATCH = "megatron.core.transformer_engine.portable"

PROBE = textwrap.dedent(
    """
    import importlib, importlib.util, json, sys
    sys.argv = ["pretrain_gpt.py"] + ARGV
    import portspeed, portspeed.megatron_adaptor
    import megatron.core
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core import utils
    from portspeed.translation import importer as translation
    PROBED = ["megatron.core.extensions.transformer_engine", "megatron.core.models.gpt.gpt_layer_specs",
              "megatron.core.tensor_parallel.random", "megatron.core.tensor_parallel.layers",
              "megatron.core.transformer.transformer_block", "megatron.core.transformer.moe.moe_utils",
              "megatron.core.transformer.attention", "megatron.core.transformer.mlp", "megatron.core.fp8_utils"]
    out = {"have_te": {m: bool(getattr(importlib.import_module(m), "HAVE_TE", None)) for m in PROBED}}
    out["in_sys_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "transformer_engine")
    out["findable"] = importlib.util.find_spec("transformer_engine") is not None
    v = utils.get_te_version()
    out["te_version"] = None if v is None else str(v)
    out["status"] = portspeed.manager().status(PATCH)
    from portspeed.cli import info
    out["info"] = info.collect()["transformer_engine"]
    portspeed.manager().revert()
    out["after_revert"] = translation.served_import("transformer_engine", {"__name__": "megatron.core.utils"}, (), 0)
    print(json.dumps(out, default=str))
    """
)


def _probe(argv: list[str], env: dict[str, str] | None = None) -> dict:
    require("megatron.core", "pip install -e '.[megatron]'")
    code = f"ARGV = {argv!r}\nPATCH = {PATCH!r}\n" + PROBE
    return child_json(code, timeout=300, env={"PORTSPEED_ACCELERATOR": "cpu", **(env or {})})


def test_default_serves_only_the_te_modules() -> None:
    out = _probe(["--num-layers", "2"])
    seen = out["have_te"]
    assert seen["megatron.core.extensions.transformer_engine"] and seen["megatron.core.models.gpt.gpt_layer_specs"]
    others = {m: v for m, v in seen.items() if m not in ("megatron.core.extensions.transformer_engine",
                                                          "megatron.core.models.gpt.gpt_layer_specs")}
    assert not any(others.values()), f"modules outside the reach saw transformer_engine: {others}"
    assert out["te_version"] == "2.6.0"
    assert out["in_sys_modules"] == [] and out["findable"] is False
    assert out["status"] == "applied"
    assert out["info"].startswith("portspeed portable")
    assert out["after_revert"] is None, "revert() left the served import in place"


def test_disabled_serves_nothing() -> None:
    out = _probe([], {"PORTSPEED_DISABLE": PATCH})
    assert not any(out["have_te"].values()), out["have_te"]
    assert out["te_version"] is None
    assert out["status"] == "disabled"
    assert "disabled" in out["info"]


@pytest.mark.parametrize("argv, wanted", [
    ([], True), (["--transformer-impl", "transformer_engine"], True), (["--transformer-impl", "local"], False),
    (["--transformer-impl=local"], False), (["--transformer-impl", "inference_optimized"], True),
])
def test_requested_reads_the_command_line(argv: list[str], wanted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """--transformer-impl local on the command line: nothing is served (the stock local run checks the log too)."""
    from portspeed.portable_te import serve

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    assert serve.requested() is wanted
    got = serve.served_import("transformer_engine.pytorch", {"__name__": "megatron.core.utils"}, ("Linear",), 0)
    assert (got is not None) is wanted
    if wanted:
        assert got.__name__ == "transformer_engine.pytorch" and got.__portspeed_portable__ is True
    outside = serve.served_import("transformer_engine", {"__name__": "megatron.core.fp8_utils"}, (), 0)
    assert outside is None, "a module outside IMPORTERS was served"


def test_installed_transformer_engine_wins(tmp_path: Path) -> None:
    """A distribution named transformer_engine (a stand-in dist-info, not NVIDIA's): the portable one never activates.

    The stand-in has metadata only (a package that imports would make Megatron's fp8_utils, which
    imports ``transformer_engine.pytorch.tensor`` unguarded once ``transformer_engine`` imports, fail:
    the very flip the portable TE's narrow reach avoids), so Megatron sees no importable TE at all.
    """
    dist = tmp_path / "transformer_engine-9.9.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\nVersion: 9.9.0\n")
    out = _probe([], {"PYTHONPATH": str(tmp_path)})
    assert out["status"] == "inactive"
    assert out["info"].startswith("NVIDIA transformer_engine 9.9.0")
    assert not any(out["have_te"].values()) and out["te_version"] is None, out
