"""``python -m portspeed.cli``: the ``portspeed`` command."""

import sys

from portspeed.cli.main import main

sys.exit(main())
