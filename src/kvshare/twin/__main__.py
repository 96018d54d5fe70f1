"""``python -m kvshare.twin``: a workload's capacity at its SLO in every world."""

import sys

from kvshare.twin.cli import main

sys.exit(main())
