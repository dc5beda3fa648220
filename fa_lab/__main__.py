"""``python -m fa_lab``: the ``fa-lab`` command line."""

import sys

from fa_lab.cli import main

sys.exit(main())
