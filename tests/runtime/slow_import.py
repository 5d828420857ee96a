"""A module that takes seconds to import (a large model loaded at import time)."""

from __future__ import annotations

import time

time.sleep(4.0)


def answer() -> int:
    return 42
