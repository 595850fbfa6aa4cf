"""``portspeed conformance``: run the kit against one adapter and print one line per check."""

from __future__ import annotations

import argparse
import sys

from portspeed.conformance.report import Report

__all__ = ["main"]

SUITES = ("device", "kernels", "collectives", "training")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="portspeed conformance", description=__doc__)
    p.add_argument("--adapter", required=True, help="adapter name (portspeed info lists them), e.g. npu, testdev")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated subset of {', '.join(SUITES)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks for the collective checks (default 2)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown or not suites:
        p.error(f"--suites {args.suites!r}: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(SUITES)}")
    if args.nproc < 2:
        p.error(f"--nproc {args.nproc}: collectives need at least 2 ranks")

    import os

    os.environ["PORTSPEED_ACCELERATOR"] = args.adapter
    from portspeed import config
    from portspeed.accelerator import adapter_class, get_accelerator
    from portspeed.errors import PortspeedError

    config.reload()
    try:
        adapter_class(args.adapter)  # an unknown name fails here, listing the known ones
        acc = get_accelerator()
    except PortspeedError as exc:
        print(f"portspeed conformance: {exc}", file=sys.stderr)
        return 2
    report = Report(args.adapter)
    if "device" in suites:
        from portspeed.conformance.device import run_device_checks

        run_device_checks(acc, report)
    if "kernels" in suites:
        from portspeed.conformance.kernels import run_kernel_checks

        run_kernel_checks(acc, report)
    if "collectives" in suites:
        from portspeed.conformance.collectives import run_collective_checks

        run_collective_checks(args.adapter, report, nproc=args.nproc)
    if "training" in suites:
        from portspeed.conformance.training import run_training_check

        run_training_check(args.adapter, report)
    print(report.render())
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(report.to_json())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
