"""``python -m tiermem.cli``: the ``tiermem`` command."""

import sys

from tiermem.cli.main import main

sys.exit(main())
