"""megatron-metp: memory-efficient tensor parallelism (METP) for Megatron-LM.

METP shards both the weights and the sequence of every transformer layer over a group of ``p``
ranks and passes weight shards and K/V blocks around a ring with send/recv.
"""

from .runtime.groups import METPGroup, RingStats
from .runtime.ring import RingError, RingExchanger, RingPeerError, RingTimeoutError

__version__ = "0.1.0"

__all__ = ["METPGroup", "RingStats", "RingExchanger", "RingError", "RingTimeoutError",
           "RingPeerError", "__version__"]
