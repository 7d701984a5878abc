import sys

from kvpoold.cli import main

sys.exit(main())
