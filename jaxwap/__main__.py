"""`python -m jaxwap calibrate`: the command line, also installed as `jaxwap`."""

import sys

from .calibrate import main

sys.exit(main())
