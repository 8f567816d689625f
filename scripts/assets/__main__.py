"""`python -m scripts.assets fetch|list`: see the package's docstring."""

import sys

from scripts.assets import main

sys.exit(main())
