"""The CPU stand-in for a CUDA stream, shared by shim (i) of :mod:`.cpu` (``current_stream``) and
shim (j) of :mod:`.moe_cpu` (the MoE dispatcher's device-to-host stream): CPU work is already
ordered, so waiting on an event or a stream, or synchronising, has nothing to wait for.
"""

from __future__ import annotations


class CpuStream:
    """``torch.cuda.current_stream()`` on CPU: every wait returns at once."""

    def wait_event(self, event=None) -> None:
        pass

    def wait_stream(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass
