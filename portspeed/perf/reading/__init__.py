"""The perf recording's reading: recordings read, the two-run comparison, the slow rank and slow link of one run.

Floor: parity (the foundation only); no torch, no device, no recording code, so `portspeed compare --perf` reads
recordings anywhere they can be read.

- ``recordings``     perf recordings read (``rank<R>.jsonl``), each collective matched across its group's ranks.
- ``compare``        `portspeed compare --perf REF RUN`: the part whose share of the step grew most, and its cause;
                     with one run, the slow rank, a slow link and the host fallbacks.
- ``slow_rank``      the rank that makes the others wait (one run).
- ``slow_links``     a group moving the same bytes far slower than another (one run).
- ``links``          the link bandwidth table (`portspeed conformance --suites bandwidth`): read, written, looked up.
- ``host_fallbacks`` the ops one recorded step ran on the host (CPU fallback, host rung), in one line.
- ``chrome``         a recording as a Chrome trace (``--chrome FILE``).
- ``plot``           the shares drawn (``--png FILE``; matplotlib optional).
"""
