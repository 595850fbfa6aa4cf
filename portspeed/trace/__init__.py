"""The flight recorder and `why-hung`: each rank's last collectives and point-to-point calls, recorded, dumped when
a job hangs or dies, and read back to name why.

Floors (``tests/test_layers.py``; docs/architecture.md), each importing only those below it:

- recording (this package's modules; floor ``trace``, below ``portspeed.comm``, which imports ``torch_recorder``
  and ``staging`` when it makes groups): the foundation only.
  ``files`` the folder's file names and settings (no torch); ``fields`` an entry's vocabulary;
  ``flight_recorder`` the per-rank ring buffer in torch's dump format, the write-through file; ``triggers``
  when a rank dumps; ``wrappers`` / ``funcol`` the recording wrappers the torch.distributed patch installs;
  ``torch_recorder`` torch's own recorder beside it; ``staging`` a CCL's inner staging groups labelled.
- reading (``dumps``; the parity floor: the foundation only, and no torch): the dumps read, portspeed's,
  torch's and the write-through files, as one entry format.
- command line (``cli``): ``cli.why_hung`` (`portspeed why-hung DIR`), ``cli.hang_watch``
  (`portspeed run --hang-timeout S`: the launcher's watchdog).

This file imports nothing: `portspeed why-hung` reads dumps without loading the recorder or torch.
"""
