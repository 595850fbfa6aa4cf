"""The probe's command line: `portspeed run --probe DIR`'s switches checked in the launcher (``options``, with
``recording_options``: what they share with ``--perf``'s) and `portspeed precheck DIR` (``precheck``).
Floor: the command line. This file imports nothing."""
