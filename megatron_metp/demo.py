"""``python -m megatron_metp.demo``: the entry point of :mod:`megatron_metp.tools.demo`."""

import sys

from .tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
