"""`python -m jaxwap COMMAND`: the command line (`jaxwap.cli`), also installed as `jaxwap`."""

import sys

from .cli import main

sys.exit(main())
