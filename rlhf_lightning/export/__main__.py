"""``python -m rlhf_lightning.export``: see :mod:`rlhf_lightning.export.cli`."""

import sys

from rlhf_lightning.export.cli import main

if __name__ == "__main__":
    sys.exit(main())
