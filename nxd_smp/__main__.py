"""``python -m nxd_smp ...``: see ``nxd_smp.cli``."""

import sys

from .cli import main

sys.exit(main())
