"""Host reads of the streaming METP layer (:mod:`.layer`) when its input lives on the host.

With ``host=True`` (``--metp-offload-activations``) the layer input ``x`` ``[n·b, h]`` is read
back from the host for every pass that needs ``norm1(x)``; a pass costs a PCIe copy of
``n·b·h·e`` bytes, so a pass with little compute besides (a projection of ``x`` to one head
group's few K/V columns, the ``d(kv)`` weight gradients, ``dx``) is bound by the copy. The layer
therefore does each such piece of work inside a pass that reads ``x`` anyway and has the
attention's compute to hide the copy behind:

* **K/V of head group g + 1** are formed in group ``g``'s query-tile pass, from the same chunks
  of ``norm1(x)`` as ``g``'s queries (the recompute) or ``g``'s ``dWq`` (the backward): one
  more K/V pair on the device (:class:`~.layer_attention.KVForm`). The recompute's last group
  forms the backward's group 0 (held over the MLP backward); with kept attention (no
  recompute) the MLP backward's row pass forms it. Every K/V piece is one GEMM over the same
  rows wherever it is formed (:meth:`~.layer_attention.Rows.set_kv_cut`), so K/V are the same
  bit for bit in the forward, the recompute and the backward.
* **d(kv) of group g** (its ``dWk/dWv`` and its rows for ``dx``) is reduced in group
  ``g + 1``'s backward pass (held heads-first in group ``g``'s K/V buffers, which the next
  group's K/V are then formed into, chunk by chunk); the last group's in ``dx``'s pass.
* **q projections**: the recompute keeps each group's ``[n·b, H·d]`` q projection (before the
  q norm and RoPE) in the rows of the group's ``dq`` stash; the backward reads a tile's rows
  back (then writes the tile's ``dq`` over them) instead of reading ``x`` a second time. No host
  memory is added (the ``dq`` stashes exist from the recompute on instead of the backward on;
  the ``d(kv)`` stashes now only from the group's reduce on).

Passes over ``x`` per layer backward (``p`` head groups; each pass reads every host tile of
``x`` once, :data:`~megatron_metp.runtime.host_stash.PREFETCH_DEPTH` chunks ahead)::

                                before      then        now            kept attention
    recompute (K/V, q)          2·p         2·p         p + 1          0
    MLP backward (row tiles)    1           1           1              1  (+ group 0's K/V)
    attention backward          4·p         2·p         p              2·p  (q from x, dWq)
    dx (+ last group's d(kv))   1           1           1              1
    total                       6·p + 2     4·p + 2     2·p + 3        2·p + 2   (p = 8: 19, 18)

"then" is the previous layout (the recompute kept the k/v projections too, read back whole by
each group's backward, and ``d(kv)`` had a pass of its own). Only two of the passes are not
hidden by the attention's compute: the recompute's first K/V pass (the ring of group 0 needs
its K/V before the first query tile) and ``dx`` (it needs every group's ``d(kv)``, complete
after the last group's ring); :func:`host_reads` gives these counts (the forward reads nothing:
``x`` is still on the device there); with ``host=False`` nothing is read from the host.
"""

from __future__ import annotations

from typing import Dict


def host_reads(p: int, host: bool = True, kept: bool = False) -> Dict[str, int]:
    """Passes over the host-resident layer input ``x`` (each ``n·b·h·e`` bytes) per layer
    backward, by phase (see the module docstring); ``kept``: with kept attention (no
    recompute); all ``0`` without ``host``."""
    k = 1 if host else 0
    if kept:
        return {"recompute": 0, "mlp backward": k, "attention backward": 2 * p * k, "dx": k}
    return {"recompute": (p + 1) * k, "mlp backward": k, "attention backward": p * k, "dx": k}


def kept_bytes(n: int, b: int, heads_dim: int, elem: int) -> int:
    """Bytes of one head group's kept q projections (written to the host by the recompute and
    read back by the group's backward, once each): ``n·b·H·d·e``."""
    return n * b * heads_dim * elem
