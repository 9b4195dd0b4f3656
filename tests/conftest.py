import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tests.harness import preload_megatron  # noqa: E402

torch.set_num_threads(1)
preload_megatron()
