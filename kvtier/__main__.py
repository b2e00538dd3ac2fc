"""``python -m kvtier``: the ``kvtier`` command line."""

import sys

from kvtier.cli import main

sys.exit(main())
