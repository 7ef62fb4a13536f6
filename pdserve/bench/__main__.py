"""``python -m pdserve.bench serve|compare|plot ...``."""

from __future__ import annotations

import sys

from pdserve.bench.cli import main

sys.exit(main())
