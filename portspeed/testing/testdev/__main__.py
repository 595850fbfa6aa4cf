"""``python -m portspeed.testing.testdev build [--verbose]``: build the test device's extension."""

import sys

from portspeed.testing.testdev.build import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["build"]:
        print("usage: python -m portspeed.testing.testdev build [--verbose]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
