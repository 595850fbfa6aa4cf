"""A stock-shaped script launched from its Megatron-LM checkout's root: only the checkout's own modules join the scope.

Megatron-LM's ``examples/`` scripts run ``cd Megatron-LM && torchrun pretrain_gpt.py``. torch
gives ``torch.classes`` and ``torch.ops`` the relative ``__file__`` values ``_classes.py`` and
``_ops.py``; resolved against that folder they looked like checkout modules, and
``pretrain()`` died with "framework prefix 'torch.classes' is not an importable module name"
(issue 22). Reproduced here without Megatron-LM: a tiny fake checkout whose ``megatron``
package declares core 0.18.2 (the release from which the patch applies), a script that
imports the adaptor first, and modules whose ``__file__`` is relative or whose name the scope
refuses, run in a subprocess from the checkout's own folder.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from helpers.launch import run_python  # noqa: E402

_SCRIPT = '''
import portspeed.megatron_adaptor  # noqa: F401  (first, as the stock script is edited to do)
import importlib.util
import sys
import types

import torch

import gpt_builders  # noqa: F401  (a checkout module: must join the scope)

# torch's own case, made explicit so the test holds whatever a later torch sets:
# a torch.* name with a relative __file__ that resolves into the launch folder
shadow = types.ModuleType("torch._portspeed_relative_case")
shadow.__file__ = "_relative_case.py"
sys.modules[shadow.__name__] = shadow
# an acceptable name with a relative __file__: where it lives is unknown, so it is not taken
loose = types.ModuleType("relative_helper")
loose.__file__ = "relative_helper.py"
sys.modules[loose.__name__] = loose
# a real file at the checkout's top, loaded under a name no import statement could use
spec = importlib.util.spec_from_file_location("my-tool", "my-tool.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
sys.modules["my-tool"] = tool

from megatron.training.training import pretrain

pretrain()
'''

_PRETRAIN = '''
import json
import sys


def pretrain(*args, **kwargs):
    """Reports what the scope holds when the real pretrain() would start."""
    from portspeed.translation import scope

    main = sys.modules["__main__"]
    print(json.dumps({"extra": list(scope.extra_prefixes),
                      "main_sees_view": bool(getattr(main.torch, "__portspeed_view__", False)),
                      "torch_relative": {n: m.__file__ for n, m in sys.modules.items()
                                         if n.startswith("torch") and isinstance(getattr(m, "__file__", None), str)
                                         and not m.__file__.startswith("/")}}))
'''


def _fake_checkout(root: Path) -> Path:
    """A folder laid out like a Megatron-LM checkout, as far as training_script.py looks."""
    files = {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/package_info.py": 'MAJOR = 0\nMINOR = 18\nPATCH = 2\nPRE_RELEASE = ""\n',
        "megatron/training/__init__.py": "",
        "megatron/training/training.py": _PRETRAIN,
        "gpt_builders.py": "BUILT = True\n",
        "my-tool.py": "TOOL = True\n",
        "_relative_case.py": "",
        "relative_helper.py": "",
        "pretrain_gpt.py": _SCRIPT,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_stock_script_launched_from_the_checkout_root(tmp_path: Path) -> None:
    """Launched from the checkout's folder: __main__ and gpt_builders join, no relative-file or refused name does."""
    checkout = _fake_checkout(tmp_path / "Megatron-LM")
    res = run_python(["pretrain_gpt.py"], timeout=240, cwd=checkout, drop=["PORTSPEED_*", "PYTHONPATH"],
                     env={"PORTSPEED_ACCELERATOR": "cpu"})
    got = res.check().last_json()
    assert set(got["extra"]) - {"__mp_main__"} == {"__main__", "gpt_builders"}, got
    assert got["main_sees_view"] is True, got
    # the case is really there: torch's own relative __file__ modules, beside the one the script adds
    assert "torch._portspeed_relative_case" in got["torch_relative"], got
