"""``python -m kvpool.serve ARGS`` is ``kvpool serve ARGS``."""

import sys

from .cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
