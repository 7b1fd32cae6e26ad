"""`python -m recycle` runs the CLI."""

import sys

from recycle.cli import main

# The guard matters: spawned worker processes import the parent's __main__ module as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
