"""``python -m megatron_metp.dry_run``: the entry point of :mod:`megatron_metp.tools.dry_run`."""

import sys

from .tools.dry_run import main

if __name__ == "__main__":
    sys.exit(main())
