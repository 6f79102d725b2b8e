"""``python -m pycomm plan ...``: the same as the ``pycomm`` command."""

import sys

from pycomm.plan import main

if __name__ == "__main__":
    sys.exit(main())
