"""`python -m specrelay.bench`: the same program as `specrelay bench`."""

import sys

from .cli import main

sys.exit(main())
