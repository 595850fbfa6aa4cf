"""Run examples/pretrain_gpt.py after Megatron-Core is already imported (import-order test).

Megatron's modules are imported first, then the example runs, and its first line imports
portspeed.megatron_adaptor: the adaptor must still scope the translation onto the modules
already loaded and rebind the names they bound before the patches existed.
"""

import runpy
import sys
from pathlib import Path

import megatron.core.distributed  # noqa: F401
import megatron.core.models.gpt.gpt_model  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import megatron.core.pipeline_parallel.schedules  # noqa: F401
import megatron.core.tensor_parallel.random  # noqa: F401
import megatron.core.transformer.torch_norm  # noqa: F401

if "portspeed.megatron_adaptor" in sys.modules:
    raise SystemExit("late_import_pretrain: the adaptor was imported before Megatron; the test would prove nothing")

script = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
sys.argv = [str(script), *sys.argv[1:]]
sys.path.insert(0, str(script.parent))  # as `python examples/pretrain_gpt.py` would: its sibling modules import
runpy.run_path(str(script), run_name="__main__")
