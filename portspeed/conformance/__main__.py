"""``portspeed conformance``: run the kit against one device adapter and print one line per check."""

from __future__ import annotations

import argparse
import sys

from portspeed.conformance.report import Report

__all__ = ["main"]

SUITES = ("device", "kernels", "collectives", "training")
#: suites run only when named: bandwidth measures (minutes on a device) and writes the link table
OPTIONAL = ("bandwidth",)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="portspeed conformance", description=__doc__)
    p.add_argument("--adapter", required=True,
                   help="device adapter: a name (portspeed info lists them), e.g. npu, testdev; or module:Class, "
                   "or path/to/file.py:Class for an adapter that is not installed")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated subset of {', '.join(SUITES)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks for the collective checks (default 2)")
    p.add_argument("--declared-gaps", action="store_true",
                   help="collectives: first run every gap the adapter declares on the raw backend (patches off), to "
                   "say which declarations can go; off by default: on hardware a refused raw call may poison the "
                   "communicator")
    p.add_argument("--bandwidth", default=None, metavar="FILE",
                   help="--suites bandwidth (a suite run only when named): the link table to write (default "
                   "PORTSPEED_BANDWIDTH, else ~/.cache/portspeed/bandwidth.json); `portspeed compare --perf` reads it")
    p.add_argument("--bandwidth-bytes", default=None, metavar="LO:HI",
                   help="bandwidth: message sizes, x4 steps (default 1K:64M; 1K:1M where the device is the host)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(suites) - set(SUITES + OPTIONAL))
    if unknown or not suites:
        p.error(f"--suites {args.suites!r}: unknown {', '.join(unknown) or '(empty)'}; choose from "
                f"{', '.join(SUITES + OPTIONAL)}")
    if args.nproc < 2:
        p.error(f"--nproc {args.nproc}: collectives need at least 2 ranks")
    bandwidth = _bandwidth_options(p, args) if "bandwidth" in suites else None

    import os

    from portspeed import config
    from portspeed.accelerator import get_accelerator, preflight
    from portspeed.errors import PortspeedError

    try:  # the same check and the same resolution (a relative file made absolute) as PORTSPEED_ACCELERATOR's
        adapter = preflight.check_adapter_spec(args.adapter, "--adapter ")
        os.environ["PORTSPEED_ACCELERATOR"] = adapter  # every rank and trainer this kit starts selects it
        config.reload()
        acc = get_accelerator()
    except PortspeedError as exc:
        print(f"portspeed conformance: {exc}", file=sys.stderr)
        return 2
    report = Report(args.adapter, adapter_class=type(acc).__name__)
    if "device" in suites:
        from portspeed.conformance.device import run_device_checks

        run_device_checks(acc, report)
    if "kernels" in suites:
        from portspeed.conformance.ds_ops import run_ds_op_checks
        from portspeed.conformance.kernels import run_kernel_checks
        from portspeed.conformance.torch_ops import run_torch_op_checks

        run_torch_op_checks(acc, report)  # torch's own ops on the device, whether or not kernels are declared
        run_kernel_checks(acc, report)
        run_ds_op_checks(acc, report)
    if "collectives" in suites:
        from portspeed.conformance.collectives import run_collective_checks

        run_collective_checks(adapter, report, nproc=args.nproc, declared_gaps=args.declared_gaps)
    if "training" in suites:
        from portspeed.conformance.training import run_training_check

        run_training_check(adapter, report)
    if bandwidth is not None:
        from portspeed.conformance.bandwidth import run_bandwidth_checks

        run_bandwidth_checks(adapter, report, args.nproc, *bandwidth)
    print(report.render())
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(report.to_json())
    return 1 if report.failed else 0


def _bandwidth_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, tuple[int, int] | None]:
    """(the table's path, the message sizes or None for the default); a bad value exits 2 naming it."""
    from portspeed.conformance.bandwidth import parse_bytes
    from portspeed.errors import ConfigError
    from portspeed.perf.reading.links import default_path
    from portspeed.settings import BY_ENV

    try:
        path = BY_ENV["PORTSPEED_BANDWIDTH"].parse("--bandwidth", args.bandwidth) if args.bandwidth else default_path()
        limits = parse_bytes(args.bandwidth_bytes) if args.bandwidth_bytes is not None else None
    except (ConfigError, ValueError) as exc:
        p.error(str(exc))
    return path, limits


if __name__ == "__main__":
    sys.exit(main())
