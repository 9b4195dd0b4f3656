"""``python -m megatron_metp.cli``: the entry point of :mod:`megatron_metp.tools.cli`."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
