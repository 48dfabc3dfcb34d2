"""``python -m kvcore.cli``: the ``kvcore`` command."""

import sys

from kvcore.cli import main

sys.exit(main())
