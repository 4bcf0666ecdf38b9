"""``python -m tfmath`` runs the ``tfmath`` command."""

import sys

from tfmath.cli import main

# Guarded: benchmarks start helper processes, which import the main module again.
if __name__ == "__main__":
    sys.exit(main())
