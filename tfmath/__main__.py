"""``python -m tfmath`` runs the ``tfmath`` command."""

import sys

from tfmath.cli import main

sys.exit(main())
