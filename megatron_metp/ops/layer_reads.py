"""Host reads of the streaming METP layer (:mod:`.layer`) when its input lives on the host.

With ``host=True`` (``--metp-offload-activations``) the layer input ``x`` ``[n·b, h]`` is read
back from the host for every pass that needs ``norm1(x)``; each pass costs a PCIe copy of
``n·b·h·e`` bytes against little compute (a projection of ``x`` to one head group's few
columns). To read ``x`` less, the backward's recompute of the attention forward keeps, per head
group ``g``, the projections the group's backward would otherwise form again from ``x``:

* the q projection (before the q norm and RoPE) of every query tile, ``[n·b, H·d]``, in the
  rows of the group's ``d(qkv)`` q stash (the same width; the backward reads a tile's rows back
  before it writes the tile's ``dq`` over them);
* the k/v projection (before the k norm and RoPE), ``[n·b, 2·G·d]``, in the rows of the group's
  ``d(qkv)`` k/v stash (read back whole before the ``d(kv)`` pass writes over it).

The backward then applies the norm and RoPE to them exactly as it did to a fresh projection over
the same row chunks, so the results are bit-identical, and no host memory is added (the
``d(qkv)`` stashes are created before the recompute instead of after the MLP backward; the O
stashes are alive over both, so the host peak is unchanged). The kept projections cross PCIe
twice (written by the recompute, read by the backward): ``(H + 2·G)·d/h`` of an ``x`` pass per
group (Llama-3-8B, METP 8: 768/4096 = 0.19).

Passes over ``x`` per layer backward (``p`` head groups; each pass reads every host tile of
``x`` once, :data:`~megatron_metp.runtime.host_stash.PREFETCH_DEPTH` chunks ahead)::

                                before          now
    recompute (K/V, then q)     2·p             2·p
    MLP backward (row tiles)    1               1
    attention backward          4·p             2·p      (the q tiles' dWq pass, the d(kv) pass)
    dx                          1               1
    total                       6·p + 2         4·p + 2  (p = 8: 50 -> 34)

:func:`host_reads` gives these counts (the forward reads nothing: ``x`` is still on the device
there); with ``host=False`` nothing is read from the host and nothing is kept.

Not done, because it would change the rounding (a GEMM's rows differ bit-wise with how the rows
are cut into chunks, so forming q with K/V, or K/V with a query tile, is not the same sum):
forming q in the K/V pass (``3·p + 2``) and folding the dWq pass into the ``d(kv)`` pass
(``2·p + 2``, one read of ``x`` per head group and phase).
"""

from __future__ import annotations

from typing import Dict


def host_reads(p: int, host: bool = True) -> Dict[str, int]:
    """Passes over the host-resident layer input ``x`` (each ``n·b·h·e`` bytes) per layer
    backward, by phase (see the module docstring); all ``0`` without ``host``."""
    k = 1 if host else 0
    return {"recompute": 2 * p * k, "mlp backward": k, "attention backward": 2 * p * k,
            "dx": k}


def kept_bytes(n: int, b: int, heads_dim: int, kv_dim: int, elem: int) -> int:
    """Bytes of one head group's kept projections (written to the host by the recompute and
    read back by the group's backward, once each): ``n·b·(H·d + 2·G·d)·e``."""
    return n * b * (heads_dim + 2 * kv_dim) * elem
