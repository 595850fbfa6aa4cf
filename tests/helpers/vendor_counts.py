"""Run examples/pretrain_gpt.py, then report this rank's kernel calls: the adapter's own and the test device's.

For tests/test_vendor_example.py: the worked one-file adapter (examples/vendor_adapter.py) counts each of its
kernels' calls in ``CALLS``; the test device counts the calls of its own C++ kernels. At exit each rank prints
one stderr line, ``vendor_counts: {"adapter": ..., "calls": ..., "counters": ...}``, so a torchrun job's test can
see which kernels the portable Transformer Engine really ran.
"""

import atexit
import json
import runpy
import sys
from pathlib import Path


def _report() -> None:
    import portspeed
    import portspeed.testing.testdev.runtime as rt

    acc = portspeed.get_accelerator()
    calls = dict(getattr(sys.modules[type(acc).__module__], "CALLS", {}))
    print("vendor_counts: " + json.dumps({"adapter": acc.name, "calls": calls, "counters": rt.counters()}),
          file=sys.stderr, flush=True)


atexit.register(_report)
script = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
sys.argv = [str(script), *sys.argv[1:]]
sys.path.insert(0, str(script.parent))  # as `python examples/pretrain_gpt.py` would: its sibling modules import
runpy.run_path(str(script), run_name="__main__")
