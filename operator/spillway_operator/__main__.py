"""``python -m spillway_operator``: same as ``spillway operator run``."""

import sys

from spillway_operator.main import main

sys.exit(main())
