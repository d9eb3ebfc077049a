"""``python -m edgerl.launch``: the ``edgerl`` command, as its console script runs it."""

import sys

from edgerl.launch.entry import main

sys.exit(main())
