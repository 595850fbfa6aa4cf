"""The perf recording's command line: ``portspeed run --perf DIR`` and its switches (``options``)."""
