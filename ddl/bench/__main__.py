"""``python -m ddl.bench``: the ``ddl-bench`` command (see :mod:`ddl.bench`)."""

import sys

from ddl.bench import main

if __name__ == "__main__":
    sys.exit(main())
