"""Run examples/pretrain_gpt.py, then report this rank's kernel calls: the adapter's own and the test device's.

For tests/test_vendor_example.py: the worked one-file adapter (examples/vendor_adapter.py) counts each of its
kernels' calls in ``CALLS``; the test device counts the calls of its own C++ kernels. At exit each rank writes
``{"adapter": ..., "calls": ..., "counters": ...}`` to ``$VENDOR_COUNTS_DIR/rank<RANK>.json``, so a torchrun job's
test can see which kernels the portable Transformer Engine really ran. (A file per rank, not a stderr line: two
ranks' lines on one shared pipe can interleave.)
"""

import atexit
import json
import os
import runpy
import sys
from pathlib import Path


def _report() -> None:
    import portspeed
    import portspeed.testing.testdev.runtime as rt

    acc = portspeed.get_accelerator()
    calls = dict(getattr(sys.modules[type(acc).__module__], "CALLS", {}))
    out = Path(os.environ["VENDOR_COUNTS_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps({"adapter": acc.name, "calls": calls, "counters": rt.counters()}))


if not os.environ.get("VENDOR_COUNTS_DIR"):
    sys.exit("vendor_counts.py: set VENDOR_COUNTS_DIR to a folder for each rank's rank<RANK>.json")
atexit.register(_report)
script = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
sys.argv = [str(script), *sys.argv[1:]]
sys.path.insert(0, str(script.parent))  # as `python examples/pretrain_gpt.py` would: its sibling modules import
runpy.run_path(str(script), run_name="__main__")
