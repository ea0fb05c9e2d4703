"""``python -m msgpatterns ...`` runs the ``msgpatterns`` command."""

import sys

from msgpatterns.cli import main

sys.exit(main())
