"""`python -m expertcache.server [MODEL_DIR] ...`: same as `expertcache serve`."""

import sys

from .cli import main

sys.exit(main())
