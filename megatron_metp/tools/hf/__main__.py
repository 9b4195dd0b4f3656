"""``python -m megatron_metp.tools.hf import|export|flags``: :func:`.cli.main`."""

import sys

from .cli import main

sys.exit(main())
