"""Deferred activation: an adaptor's import is cheap; its set-up runs before the framework's first module.

Each check runs in a fresh interpreter (activation changes the process: import finders,
patches, the translation). The framework here is a package written into a temporary
directory and named a framework module through PORTSPEED_FRAMEWORK_MODULES, so the
checks need neither Megatron nor DeepSpeed; one check uses megatron-core when installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.launch import child_json, run_snippet
from helpers.requires import require

# The framework package: its body records, while it runs, what it sees.
FRAMEWORK_INIT = '''
import sys, torch
import portspeed
from portspeed.translation import importer as translation
SEEN_AT_IMPORT = {
    "translation_enabled": translation.enabled(),
    "torch_is_view": torch is translation.torch_view(),
    "cuda_is_view": torch.cuda is translation.cuda_view(),
    "records": len(portspeed.manager().records()),
}
'''


TIMEOUT = 180  # seconds per child interpreter


def _framework(tmp_path: Path, **env: str) -> dict[str, str]:
    """Write the framework package into ``tmp_path``; the child's environment naming it (plus ``env``)."""
    pkg = tmp_path / "fw_pkg"
    if not pkg.exists():
        pkg.mkdir()
        (pkg / "__init__.py").write_text(FRAMEWORK_INIT)
        (pkg / "sub.py").write_text("import torch\n")
    return {"PYTHONPATH": str(tmp_path), "PORTSPEED_FRAMEWORK_MODULES": "fw_pkg", "PORTSPEED_ACCELERATOR": "cpu", **env}


def test_adaptor_import_sets_nothing_up(tmp_path: Path) -> None:
    """Importing the adaptor patches nothing, loads neither wrapt nor packaging, and leaves one finder waiting."""
    got = child_json('''
        import json, sys, torch, torch.distributed as dist
        before = dist.all_reduce
        import portspeed.megatron_adaptor, portspeed
        from portspeed.integrations import activation
        print(json.dumps({
            "waiting": activation.waiting(),
            "first_finder": repr(sys.meta_path[0]),
            "records": len(portspeed.manager().records()),
            "translation": "portspeed.translation.importer" in sys.modules,
            "heavy": sorted(m for m in ("wrapt", "packaging.specifiers", "portspeed.comm.router",
                                          "portspeed.comm.groups", "portspeed.comm.rewrites",
                                          "portspeed.accelerator.contract", "portspeed.accelerator.selection")
                            if m in sys.modules),
            "all_reduce_untouched": dist.all_reduce is before,
        }))
    ''', timeout=TIMEOUT, env=_framework(tmp_path))
    assert got["waiting"] == ["portspeed.megatron_adaptor"]
    assert "activation trigger for portspeed.megatron_adaptor" in got["first_finder"]
    assert got["records"] == 0 and got["translation"] is False and got["heavy"] == []
    assert got["all_reduce_untouched"] is True


def test_first_framework_import_sets_up_before_its_body_runs(tmp_path: Path) -> None:
    """The framework's own body already sees the view and the patches: set-up ran before it, not after."""
    got = child_json('''
        import json, sys, torch.distributed as dist
        import portspeed.megatron_adaptor, portspeed
        from portspeed.integrations import activation
        import fw_pkg.sub
        print(json.dumps({
            "seen": fw_pkg.SEEN_AT_IMPORT,
            "sub_torch_is_view": fw_pkg.sub.torch is sys.modules["portspeed.translation.importer"].torch_view(),
            "waiting": activation.waiting(),
            "triggers_left": [repr(f) for f in sys.meta_path if "activation trigger" in repr(f)],
            "all_reduce_routed": hasattr(dist.all_reduce, "__wrapped__"),
            "applied": sum(r["status"] == "applied" for r in portspeed.report()),
        }))
    ''', timeout=TIMEOUT, env=_framework(tmp_path))
    assert got["seen"]["translation_enabled"] and got["seen"]["torch_is_view"] and got["seen"]["cuda_is_view"]
    assert got["seen"]["records"] > 0, "patches were registered before the framework body ran"
    assert got["sub_torch_is_view"] is True
    assert got["waiting"] == [] and got["triggers_left"] == []
    assert got["all_reduce_routed"] is True and got["applied"] > 0


def test_adaptor_after_framework_sets_up_at_once(tmp_path: Path) -> None:
    """Framework imported first: the adaptor's import sets up at once and rebinds the framework's torch."""
    got = child_json('''
        import json, sys
        import fw_pkg
        import portspeed.megatron_adaptor
        from portspeed.integrations import activation
        from portspeed.translation import importer as translation
        print(json.dumps({"waiting": activation.waiting(), "enabled": translation.enabled(),
                          "torch_is_view": fw_pkg.torch is translation.torch_view(),
                          "seen_view_at_import": fw_pkg.SEEN_AT_IMPORT["torch_is_view"]}))
    ''', timeout=TIMEOUT, env=_framework(tmp_path))
    assert got == {"waiting": [], "enabled": True, "torch_is_view": True, "seen_view_at_import": False}


def test_report_sets_up_a_waiting_adaptor(tmp_path: Path) -> None:
    """portspeed.report() before the framework's import shows what its import will do, as before the deferral."""
    got = child_json('''
        import json, sys
        import portspeed.megatron_adaptor, portspeed
        from portspeed.integrations import activation
        status = {r["name"]: r["status"] for r in portspeed.report()}
        print(json.dumps({"waiting": activation.waiting(), "status": status,
                          "megatron_imported": "megatron" in sys.modules}))
    ''', timeout=TIMEOUT, env=_framework(tmp_path))
    assert got["waiting"] == [] and got["megatron_imported"] is False
    assert got["status"]["torch.distributed.all_reduce.route"] == "applied"
    assert any(s == "pending" for n, s in got["status"].items() if n.startswith("megatron."))


def test_explicit_activate_cancels_the_trigger(tmp_path: Path) -> None:
    """activate() called by the program sets up once; the framework's import then finds no trigger."""
    got = child_json('''
        import json, sys
        import portspeed.megatron_adaptor as ad, portspeed
        from portspeed.integrations import activation
        ad.activate()
        n = len(portspeed.manager().records())
        import fw_pkg
        print(json.dumps({"waiting": activation.waiting(), "same": n == len(portspeed.manager().records()),
                          "seen_view": fw_pkg.SEEN_AT_IMPORT["torch_is_view"],
                          "triggers": [repr(f) for f in sys.meta_path if "activation trigger" in repr(f)]}))
    ''', timeout=TIMEOUT, env=_framework(tmp_path))
    assert got == {"waiting": [], "same": True, "seen_view": True, "triggers": []}


def test_bad_environment_fails_at_the_adaptor_import(tmp_path: Path) -> None:
    """A malformed PORTSPEED_* value is reported by `import portspeed.megatron_adaptor` itself."""
    for var, value, words in (("PORTSPEED_STRICT", "maybe", "PORTSPEED_STRICT='maybe' is not a boolean"),
                              ("PORTSPEED_FRAMEWORK_MODULES", "bad name!", "PORTSPEED_FRAMEWORK_MODULES has invalid")):
        res = run_snippet("import portspeed.megatron_adaptor\nprint('imported')\n", timeout=TIMEOUT,
                          env=_framework(tmp_path, **{var: value}))
        assert res.returncode != 0 and "imported" not in res.stdout, (var, res.stdout)
        assert words in res.stderr, res.stderr[-2000:]


def test_the_integration_modules_import_without_checking_or_arming(tmp_path: Path) -> None:
    """Importing ``portspeed.integrations.megatron`` / ``.deepspeed`` only defines: no check, no trigger, no hook;
    the adaptor's import is what checks and arms."""
    got = child_json('''
        import json, sys
        import portspeed
        import portspeed.integrations.deepspeed, portspeed.integrations.megatron
        from portspeed.integrations import activation
        print(json.dumps({"waiting": activation.waiting(), "before_report": len(portspeed._before_report),
                          "triggers": [repr(f) for f in sys.meta_path if "activation trigger" in repr(f)]}))
    ''', timeout=TIMEOUT, env=_framework(tmp_path, PORTSPEED_STRICT="maybe"))
    assert got == {"waiting": [], "before_report": 0, "triggers": []}


def test_set_up_error_surfaces_at_the_framework_import(tmp_path: Path) -> None:
    """A known adapter whose vendor package is missing fails the framework's import (the device tier of the
    checks runs at activation; an unknown name is refused at the adaptor's import already); activate() retries it."""
    got = child_json('''
        import json, os
        import portspeed.megatron_adaptor as ad
        from portspeed import config
        from portspeed.integrations import activation
        try:
            import fw_pkg
        except Exception as exc:
            first = f"{type(exc).__name__}: {exc}"
        else:
            first = "no error"
        waiting_after = activation.waiting()
        os.environ["PORTSPEED_ACCELERATOR"] = "cpu"
        config.reload()
        from portspeed import accelerator
        accelerator.reset_accelerator()
        ad.activate()
        import fw_pkg
        from portspeed.translation import importer as translation
        print(json.dumps({"first": first, "waiting_after": waiting_after,
                          "then": fw_pkg.torch is translation.torch_view()}))
    ''', timeout=TIMEOUT, env=_framework(tmp_path, PORTSPEED_ACCELERATOR="npu"))
    assert got["first"].startswith("MissingVendorPackageError") and "'torch-npu'" in got["first"], got["first"]
    assert got["waiting_after"] == []
    assert got["then"] is True


def test_other_modules_import_normally_while_waiting(tmp_path: Path) -> None:
    """Until it fires, the trigger answers None for every other module (stdlib, torch, one named like the prefix)."""
    (tmp_path / "fw_pkg_other.py").write_text("VALUE = 7\n")
    got = child_json('''
        import json
        import portspeed.megatron_adaptor
        from portspeed.integrations import activation
        import fw_pkg_other, email.parser, torch.nn.functional
        print(json.dumps({"waiting": activation.waiting(), "value": fw_pkg_other.VALUE}))
    ''', timeout=TIMEOUT, env=_framework(tmp_path))
    assert got == {"waiting": ["portspeed.megatron_adaptor"], "value": 7}


def test_megatron_import_sets_up_the_megatron_adaptor(tmp_path: Path) -> None:
    """With megatron-core: `import megatron.core.parallel_state` fires the set-up; Megatron's modules see the view."""
    require("megatron.core", "pip install 'portspeed[megatron]'")
    got = child_json('''
        import json
        import portspeed.megatron_adaptor, portspeed
        from portspeed.integrations import activation
        waiting = activation.waiting()
        import megatron.core.parallel_state as ps
        from portspeed.translation import importer as translation
        status = {r["name"]: r["status"] for r in portspeed.report()}
        print(json.dumps({"before": waiting, "after": activation.waiting(),
                          "view": ps.torch is translation.torch_view(),
                          "nccl_options": status["megatron.core.parallel_state.nccl_options"]}))
    ''', timeout=TIMEOUT, env=_framework(tmp_path, PORTSPEED_FRAMEWORK_MODULES=""))
    assert got == {"before": ["portspeed.megatron_adaptor"], "after": [], "view": True, "nccl_options": "applied"}


def test_deepspeed_adaptor_waits_for_deepspeed(tmp_path: Path) -> None:
    """The DeepSpeed adaptor's set-up waits for `import deepspeed` and is independent of the Megatron one."""
    got = child_json('''
        import json, sys
        import portspeed.deepspeed_adaptor, portspeed.megatron_adaptor
        from portspeed.integrations import activation
        waiting = activation.waiting()
        import fw_pkg
        print(json.dumps({"before": waiting, "after": activation.waiting()}))
    ''', timeout=TIMEOUT, env=_framework(tmp_path))
    assert got["before"] == ["portspeed.deepspeed_adaptor", "portspeed.megatron_adaptor"]
    assert got["after"] == ["portspeed.deepspeed_adaptor"]


def test_a_framework_import_in_another_thread_waits_for_the_set_up(tmp_path: Path, monkeypatch) -> None:
    """Thread 1's import runs a slow set-up; thread 2's import of another framework module waits for it.

    (CPython runs finders under its import lock; this checks the behaviour, whatever provides it.)
    """
    import sys
    import threading

    from portspeed.integrations import activation

    for name in ("slowfw_one", "slowfw_two"):
        (tmp_path / f"{name}.py").write_text("from portspeed_test_state import STATE\nSEEN = dict(STATE)\n")
    (tmp_path / "portspeed_test_state.py").write_text("STATE = {'ready': False}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import portspeed_test_state

    started, release = threading.Event(), threading.Event()

    def slow_set_up() -> None:
        started.set()
        assert release.wait(30)
        portspeed_test_state.STATE["ready"] = True

    activation.defer("tests.slow_adaptor", lambda: ("slowfw_one", "slowfw_two"), slow_set_up)
    errors: list[BaseException] = []

    def imp(name: str) -> None:
        try:
            __import__(name)
        except BaseException as exc:  # reported below
            errors.append(exc)

    first = threading.Thread(target=imp, args=("slowfw_one",))
    second = threading.Thread(target=imp, args=("slowfw_two",))
    try:
        first.start()
        assert started.wait(30)
        second.start()
        second.join(0.5)
        assert second.is_alive(), "the second import went ahead while the set-up was still running"
        release.set()
        first.join(30)
        second.join(30)
        assert not errors, errors
        assert sys.modules["slowfw_one"].SEEN == {"ready": True}
        assert sys.modules["slowfw_two"].SEEN == {"ready": True}
        assert "tests.slow_adaptor" not in activation.waiting()
        assert not [f for f in sys.meta_path if "tests.slow_adaptor" in repr(f)]
    finally:
        release.set()
        activation.cancel("tests.slow_adaptor")
        for name in ("slowfw_one", "slowfw_two", "portspeed_test_state"):
            sys.modules.pop(name, None)
