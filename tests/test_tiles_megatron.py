"""Token tiles inside Megatron: a 3-step run with Megatron's DDP and optimizer in tiles equals the
untiled run (losses, grad norms, every gradient after step 1: fp32 within 1e-6) at METP 2 and 3,
with full recompute, host offload and the vocabulary ring, with TP 2 × METP 2 and METP 2 × PP 2,
and on packed documents (and the offload without prefetch); the ring counters show that the rings
went round once per tile; a perturbed initial weight is caught by the same comparison.

Without recompute the tiles are the METP MLP's (``METP_MLP_TOKEN_TILE``). With full recompute of
one layer per chunk (TP 1) the layers run as the streaming layer op (megatron/streaming.py), tiled
by ``METP_LAYER_TOKEN_TILE`` (row passes and query tiles); its untiled reference is Megatron's own
checkpoint path over the separate, untiled ops (``METP_STREAMING_LAYER=0``)."""

import dataclasses
import os

import pytest
import torch

from megatron_metp.megatron.training import GPTSize, Layout, init_parallel, setup, train
from megatron_metp.ops import tiles as tiling
from tests.gpt_cases import SIZE
from tests.grads import run_result, train_grabbing, worst_difference
from tests.harness import run_ranks

STEPS = 3
SAME = 1e-6
SWIGLU = GPTSize(**{**SIZE.__dict__, "swiglu": True})
FULL = dict(recompute="full", recompute_method="uniform", recompute_num_layers=1)


def _runs(rank, world, size, base, variants):
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_metp.megatron import cpu

    cpu.enable()
    init_parallel(base, size.seq_length)
    out = {}
    for name, opts in variants:
        layout = dataclasses.replace(base, **opts.get("layout", {}))
        for key, value in opts.get("env", {}).items():
            os.environ[key] = value
        tile = opts.get("tile")
        if tile:
            os.environ[tiling.MLP_TOKEN_TILE_ENV] = str(tile)
        else:
            os.environ[tiling.MLP_TOKEN_TILE_ENV] = "0"
        torch.manual_seed(1234)
        mrandom.model_parallel_cuda_manual_seed(1234)
        state = setup(size, layout, seed=opts.get("seed", 1234))
        recs, grads = train_grabbing(size, layout, STEPS, state)
        for key in opts.get("env", {}):
            os.environ.pop(key, None)
        layers = state["model"].module.decoder.layers
        out[name] = run_result(
            recs, grads, streaming=any(getattr(m, "stream", False) for m in layers),
            ring=state["groups"].metp.stats.snapshot(),
            prefetched=getattr(state["model"].module.decoder, "_metp_offloader", None) and
            state["model"].module.decoder._metp_offloader.stats.prefetched_groups)
    os.environ.pop(tiling.MLP_TOKEN_TILE_ENV, None)
    return out


PAIRS = [("plain", {}), ("full", {"layout": FULL}),
         ("vocab-full-offload", {"layout": dict(FULL, vocab_parallel=True,
                                                offload_activations=True)})]
#: untiled reference: Megatron's checkpoint over the separate ops; tiled: the streaming layer
MODULAR = {"METP_STREAMING_LAYER": "0"}
LAYER_TILED = {"METP_LAYER_TOKEN_TILE": "5"}


def _pair(opts):
    """(untiled, tiled) variants of one layout."""
    if "layout" not in opts:
        return opts, dict(opts, tile=5)
    return dict(opts, env=MODULAR), dict(opts, tile=5, env=LAYER_TILED)


@pytest.mark.parametrize("p", [2, 3])
def test_tiled_training_equals_untiled(p):
    variants = []
    for name, opts in PAIRS:
        whole, tiled = _pair(opts)
        variants += [(name, whole), (name + "-tiled", tiled)]
    variants.append(("perturbed-tiled", {"seed": 1235, "tile": 5}))
    no_prefetch = dict(PAIRS[2][1], env=dict(MODULAR, METP_OFFLOAD_PREFETCH="0"))
    variants.append(("vocab-full-offload-noprefetch-tiled", dict(no_prefetch, tile=5)))
    per_rank = run_ranks(_runs, p, SWIGLU, Layout(metp=p), variants, timeout=300)
    for res in per_rank:
        for name, _ in PAIRS:
            assert worst_difference(res[name], res[name + "-tiled"]) <= SAME, name
            # the rings went round once per tile: more ring bytes than untiled
            assert res[name + "-tiled"]["ring"]["bytes_sent"] > res[name]["ring"]["bytes_sent"]
            # full recompute: the tiled run is the streaming layer, its reference is not
            assert res[name + "-tiled"]["streaming"] == (name != "plain") and \
                not res[name]["streaming"], name
        assert worst_difference(res["plain"], res["perturbed-tiled"]) > 1e-3
        # host offload without prefetch (METP_OFFLOAD_PREFETCH=0): the same training (the
        # tiny layers' tensors stay below the offload threshold; tests/test_offload_prefetch.py
        # checks the bring-back itself)
        nop = res["vocab-full-offload-noprefetch-tiled"]
        assert worst_difference(res["vocab-full-offload"], nop) <= SAME
        assert nop["prefetched"] == 0


def _train_packed_tiled(rank, world, layout, steps, tile):
    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import setup
    from megatron_metp.tools.demo import DemoConfig, packed_walk_batch

    os.environ.update(LAYER_TILED if tile else MODULAR)
    os.environ["METP_LAYER_TOKEN_TILE"] = str(tile)
    cpu.enable()
    size = DemoConfig(layers=2, hidden=32, seq=64).size()
    init_parallel(layout, size.seq_length)
    state = setup(size, layout)
    recs = train(size, layout, steps, state=state, batch_fn=packed_walk_batch)
    return [r.lm_loss for r in recs], state["groups"].metp.stats.snapshot()["bytes_sent"]


def test_packed_documents_in_tiles_train_as_untiled():
    """Packed documents (Megatron's EOD boundaries, per-token loss), the vocabulary ring and full
    recompute: 3 steps of the streaming layer in tiles of 7 rows give the losses of Megatron's
    checkpoint over the untiled ops."""
    layout = Layout(metp=2, vocab_parallel=True, micro_batch_size=2, global_batch_size=4,
                    lr=3e-3, packed_eod=127, **FULL)
    whole, sent_whole = run_ranks(_train_packed_tiled, 2, layout, 3, 0)[0]
    tiled, sent_tiled = run_ranks(_train_packed_tiled, 2, layout, 3, 7)[0]
    assert max(abs(a - b) / a for a, b in zip(whole, tiled)) <= SAME, (whole, tiled)
    assert sent_tiled > sent_whole


@pytest.mark.parametrize("base", [Layout(metp=2, tp=2), Layout(metp=2, pp=2)],
                         ids=["tp2xmetp2", "metp2xpp2"])
def test_tiled_training_equals_untiled_with_tp_and_pp(base):
    whole, tiled = _pair({"layout": FULL})
    variants = [("full", whole), ("full-tiled", tiled)]
    for res in run_ranks(_runs, 4, SWIGLU, base, variants, timeout=300):
        assert worst_difference(res["full"], res["full-tiled"]) <= SAME
        # TP > 1 inside a layer: Megatron's checkpoint over the tiled MLP; PP: the streaming layer
        assert res["full-tiled"]["streaming"] == (base.tp == 1)
        assert res["full-tiled"]["ring"]["bytes_sent"] > res["full"]["ring"]["bytes_sent"]
