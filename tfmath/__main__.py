"""``python -m tfmath`` runs the ``tfmath`` command."""

import sys

from tfmath.tools.cli import main

sys.exit(main())
