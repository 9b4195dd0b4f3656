import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def _preload_megatron():
    """Import megatron-core once in the pytest process: every forked test rank inherits it
    (about 3 s per rank otherwise). Importing patches nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.transformer.attention  # noqa: F401


_preload_megatron()
