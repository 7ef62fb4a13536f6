"""``python -m pdserve ...`` is the ``pdserve`` command."""

from __future__ import annotations

import sys

from pdserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
