"""`python -m birkhoff` (and `torchrun -m birkhoff`): the command line of birkhoff.cli."""

import sys

from birkhoff.cli import main

if __name__ == "__main__":
    sys.exit(main())
