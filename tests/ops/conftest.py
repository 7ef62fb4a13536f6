"""Sets up Triton's interpreter on CPU-only machines before any kernel module is imported."""

from __future__ import annotations

import kernel_env  # noqa: F401  (imported for its side effect: TRITON_INTERPRET and a patch)
