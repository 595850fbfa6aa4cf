"""tests/data/trace_faults.py's planted faults, with recording set up by the script itself (`portspeed run --adaptor
none`): for tests/test_trace_unrecorded.py, the ranks whose recorder never starts.

PLANT_IMPORT names an adaptor this script imports before the faults run; PLANT_TRACE_OFF_RANK turns recording off
on that rank first (as a script that sets PORTSPEED_TRACE=0 for itself). The faults run as ``__main__`` from their
own file, so their call sites are trace_faults.py's.
"""
import importlib
import os
import runpy
from pathlib import Path

if os.environ.get("PLANT_TRACE_OFF_RANK") == os.environ["RANK"]:
    os.environ["PORTSPEED_TRACE"] = "0"
if os.environ.get("PLANT_IMPORT"):
    importlib.import_module(os.environ["PLANT_IMPORT"])
runpy.run_path(str(Path(__file__).with_name("trace_faults.py")), run_name="__main__")
