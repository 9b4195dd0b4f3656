"""``python -m megatron_metp.compare``: the entry point of :mod:`megatron_metp.tools.compare`."""

import sys

from .tools.compare import main

if __name__ == "__main__":
    sys.exit(main())
