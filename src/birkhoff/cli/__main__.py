"""`python -m birkhoff.cli`: the same command line as `python -m birkhoff`."""

import sys

from birkhoff.cli import main

if __name__ == "__main__":
    sys.exit(main())
