"""`python -m cluster.cli`: the same as `v41`."""

import sys

from cluster.cli import main

sys.exit(main())
