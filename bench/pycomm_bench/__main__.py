"""``python -m pycomm_bench ...``: the same as the ``pycomm-bench`` script."""

import sys

from .cli import main

sys.exit(main())
