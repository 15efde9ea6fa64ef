"""`python -m eyas` is the same as the `eyas` command."""

import sys

from eyas.cli.main import main

sys.exit(main())
