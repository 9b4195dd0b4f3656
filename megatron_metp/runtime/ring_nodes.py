"""Which METP rings a launch would lay across two nodes, from the layout alone (no torch, no
process group): the launcher's preflight refuses such a job before any rank starts
(:func:`cross_node_problems`); inside the ranks :mod:`.placement` checks the real host names.

Megatron's default rank order (``tp-cp-ep-dp-pp``, METP on the CP axis as its inner factor,
:mod:`megatron_metp.megatron.parallel`) makes each METP group ``METP`` ranks of stride ``TP``
inside a block of ``TP × METP`` consecutive global ranks; ranks are numbered node by node
(torchrun's ``--node_rank``), ``ranks_per_node`` per node. A group is on one node iff its block
is, which holds for every block iff ``TP × METP`` divides ``ranks_per_node``.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from . import overrides

__all__ = ["fix_text", "metp_groups_across_nodes", "cross_node_problems"]


def fix_text(ranks_per_node: int) -> str:
    """The fix both checks name for a METP ring across nodes."""
    return (f"Fix: keep TP x METP a divisor of the GPUs per node ({ranks_per_node}) with "
            f"Megatron's default rank order (tp-cp-ep-dp-pp), so that each METP ring is adjacent "
            f"ranks of one node, or lower --metp-parallel-size and put the rest of the sequence "
            f"on --context-parallel-size (its K/V ring may cross nodes).")


def metp_groups_across_nodes(world: int, tp: int, metp: int,
                             ranks_per_node: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """``[(global ranks of the METP group, the nodes they are on), ...]`` for every METP group
    of a ``world``-rank job that has ranks on two nodes (empty when none does)."""
    if metp <= 1 or ranks_per_node < 1 or world <= ranks_per_node or world % (tp * metp):
        return []
    out = []
    for start in range(0, world, tp * metp):
        for t in range(tp):
            ranks = tuple(start + t + j * tp for j in range(metp))
            nodes = tuple(sorted({r // ranks_per_node for r in ranks}))
            if len(nodes) > 1:
                out.append((ranks, nodes))
    return out


def cross_node_problems(world: int, tp: int, metp: int, ranks_per_node: int) -> List[str]:
    """The launcher's refusal of a layout whose METP rings cross nodes (one line naming the
    first such group, the count, and the fix), or ``[]``; ``METP_ALLOW_CROSS_NODE_RING=1``
    accepts the layout on purpose, as in the ranks."""
    bad = metp_groups_across_nodes(world, tp, metp, ranks_per_node)
    if not bad or overrides.flag("METP_ALLOW_CROSS_NODE_RING"):
        return []
    ranks, nodes = bad[0]
    more = f" (and {len(bad) - 1} more group(s))" if len(bad) > 1 else ""
    return [f"--metp-parallel-size {metp} with --tensor-model-parallel-size {tp} on "
            f"{ranks_per_node} ranks per node: the METP group of global ranks {list(ranks)} "
            f"would span nodes {', '.join(map(str, nodes))}{more}, and its weight ring would cross "
            f"the inter-node link every layer. {fix_text(ranks_per_node)} "
            f"(METP_ALLOW_CROSS_NODE_RING=1 accepts the layout on purpose.)"]

