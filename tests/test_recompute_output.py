"""Full recompute frees the re-formed output of each checkpointed chunk before its backward
(megatron/recompute_output.py): 3 Megatron optimizer steps give the same losses, grad norms and
gradients bit for bit as with the hook removed, and the hook freed exactly one output per chunk
per micro-batch (none in the first forward, none without recompute). The hook serves Megatron's
checkpoint; these runs switch the streaming layer op off (``METP_STREAMING_LAYER=0``), which
otherwise takes full recompute of one layer per chunk (megatron/streaming.py)."""

import dataclasses

import torch

from megatron_metp.megatron import recompute_output as RO
from megatron_metp.megatron.training import Layout, init_parallel, setup
from tests.grads import run_result, train_grabbing
from tests.harness import run_ranks
from tests.test_tiles_megatron import SWIGLU

FULL = dict(recompute="full", recompute_method="uniform", recompute_num_layers=1)


def _run(rank, world, variants):
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_metp.megatron import cpu

    import os

    cpu.enable()
    os.environ["METP_STREAMING_LAYER"] = "0"
    init_parallel(Layout(metp=world), SWIGLU.seq_length)
    real = RO._free_output
    out = {}
    for name, opts, hooked in variants:
        freed = []

        def counting(module, args, output):
            hs = output[0]
            before = hs.numel() > 0 and hs.untyped_storage().nbytes()
            real(module, args, output)
            if hs.untyped_storage().nbytes() < before:
                freed.append(module.layer_number)

        RO._free_output = counting if hooked else (lambda *a: None)
        try:
            layout = dataclasses.replace(Layout(metp=world), **opts)
            torch.manual_seed(1234)
            mrandom.model_parallel_cuda_manual_seed(1234)
            state = setup(SWIGLU, layout, seed=1234)
            recs, grads = train_grabbing(SWIGLU, layout, 3, state)
        finally:
            RO._free_output = real
        out[name] = run_result(recs, grads, freed=freed)
    return out


def test_freed_outputs_leave_training_bit_identical():
    variants = [("kept", FULL, False), ("freed", FULL, True),
                ("freed-uniform2", dict(FULL, recompute_num_layers=2), True),
                ("no-recompute", {}, True)]
    for res in run_ranks(_run, 2, variants, timeout=300):
        a, b = res["kept"], res["freed"]
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])
        micro = len(b["freed"]) // (3 * SWIGLU.num_layers)
        assert micro >= 1 and len(b["freed"]) == 3 * micro * SWIGLU.num_layers, b["freed"]
        # uniform 2: one chunk of both layers, only its last layer's output is freed
        assert set(res["freed-uniform2"]["freed"]) == {SWIGLU.num_layers}
        assert res["no-recompute"]["freed"] == []
