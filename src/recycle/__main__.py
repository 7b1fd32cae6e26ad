"""`python -m recycle` runs the CLI."""

import sys

from recycle.cli import main

sys.exit(main())
