"""megatron-metp: memory-efficient tensor parallelism (METP) for Megatron-LM.

METP shards both the weights and the sequence of every transformer layer over a group of ``p``
ranks and passes weight shards and K/V blocks around a ring with send/recv.

The names below are imported on first use (``megatron_metp.METPGroup``), so that ``metp
--help`` and the planner's command line start without importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name → the module that defines it
_LAZY = {"METPGroup": ".runtime.groups", "RingStats": ".runtime.groups",
         "RingExchanger": ".runtime.ring", "RingError": ".runtime.ring",
         "RingTimeoutError": ".runtime.ring", "RingPeerError": ".runtime.ring"}

__all__ = ["METPGroup", "RingStats", "RingExchanger", "RingError", "RingTimeoutError",
           "RingPeerError", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
