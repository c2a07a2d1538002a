"""``python -m gdn_layout``: the same command line as ``gdn-layout``."""

import sys

from .cli import main

sys.exit(main())
