"""``metp_attention(..., recompute_core=True)``, the op behind Megatron's selective ``core_attn``
recompute with METP layers (megatron/selective.py): the forward keeps neither the head groups'
outputs nor their log-sum-exps, the backward re-runs each block's K/V ring forward. Its output
and every gradient are bit-identical to the op without it (fp32, CPU) over the paths the re-run
takes: head blocks of one and of ``p`` groups (the deferred merge), GQA, packed documents, RoPE;
the saved bytes drop by exactly O and the LSE; the negative control (an LSE re-formed wrong)
changes the gradients."""

import pytest
import torch
import torch.distributed as dist

from megatron_metp import METPGroup
from megatron_metp.ops import attention as attention_op
from megatron_metp.ops import metp_attention
from megatron_metp.ops.documents import shard_documents
from tests.harness import run_ranks
from tests.megatron_ref import full_attention_params
from tests.test_attention import _shard

S, B, D = 16, 1, 4

CASES = [  # (A, G, cu_seqlens, head_block, rope)
    (4, 4, None, 1, True),
    (8, 4, None, 2, True),             # GQA; one block of every head group: deferred merge
    (4, 4, (0, 3, 9, 16), 1, True),    # packed documents, positions restart per document
    (8, 4, (0, 5, 16), 2, False),
]


def _run(rank, p, recompute, perturb=False):
    if perturb:  # the negative control: the re-run's LSE off by 1e-3 (O left as it was)
        real = attention_op.ring_attention_forward

        def wrong(*args, **kwargs):
            out, lse = real(*args, **kwargs)
            return out, (lse + 1e-3 if kwargs.get("kv_packed") is None else lse)

        attention_op.ring_attention_forward = wrong
    res = []
    for A, G, cu, kb, rope in CASES:
        full = full_attention_params(S, B, A * D, A, G, D, rope=rope, seed=A + kb)
        params = {k: None if v is None else v.clone().requires_grad_()
                  for k, v in _shard(full, rank, p, A, G, D).items()}
        layout = "dual_chunk"
        x = shard_documents(full["x"], cu or (0, S), rank, p, layout=layout).requires_grad_()
        grp = METPGroup.from_process_group(dist.group.WORLD, name="sel")
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = metp_attention(x, params["qkv_weight"], params["proj_weight"], group=grp,
                               num_heads=A, num_query_groups=G, layout=layout,
                               rotary_pos_emb=full["rotary_pos_emb"],
                               qkv_bias=params["qkv_bias"], proj_bias=params["proj_bias"],
                               kernel="torch_flash", cu_seqlens=cu, head_block=kb,
                               recompute_core=recompute)
        y.backward(shard_documents(full["gy"], cu or (0, S), rank, p, layout=layout))
        res.append({"y": y.detach(), "dx": x.grad, "saved": saved[0],
                    "steps": grp.stats.snapshot()["steps"],
                    **{"d" + k: v.grad for k, v in params.items() if v is not None}})
    return res


def _both(rank, p):
    return {"kept": _run(rank, p, False), "recomputed": _run(rank, p, True),
            "perturbed": _run(rank, p, True, perturb=True)}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_both, 2)


def test_recompute_core_is_bit_identical_and_keeps_no_output_or_lse(runs):
    n = S // 2  # METP 2
    for res in runs:
        for i, (A, G, cu, kb, rope) in enumerate(CASES):
            kept, rec = res["kept"][i], res["recomputed"][i]
            assert set(kept) == set(rec)
            for k in kept:
                if k not in ("saved", "steps"):
                    assert torch.equal(kept[k], rec[k]), (CASES[i], k)
            # O [n, b, A·d] and the LSE [b, A, n], fp32
            assert kept["saved"] - rec["saved"] == 4 * (n * B * A * D + B * A * n), CASES[i]
            assert rec["steps"] > kept["steps"], CASES[i]  # the K/V ring forward ran again


def test_a_wrong_re_formed_lse_changes_the_gradients(runs):
    for res in runs:
        for i, case in enumerate(CASES):
            kept, bad = res["kept"][i], res["perturbed"][i]
            assert torch.equal(kept["y"], bad["y"]), case  # the forward is untouched
            assert not torch.equal(kept["dx"], bad["dx"]), case
