"""``python -m kvcore.bench``: ``kvcore bench``."""

import sys

from kvcore.bench import main

sys.exit(main())
