"""`python -m mlagen_compiler.cli ...`: the `mlagen` command without its console script."""

import sys

from . import main

sys.exit(main())
