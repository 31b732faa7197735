"""`python -m jaxwap COMMAND`: the command line (`jaxwap.cli.main`), also installed as `jaxwap`."""

import sys

from jaxwap.cli.main import main

sys.exit(main())
