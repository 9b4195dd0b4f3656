"""One METP model, built in one place (issue 40): ``metp measure``, the dry run (Megatron-LM's
own ``pretrain_gpt.py`` model provider through the METP hooks, under a fake process group) and
Megatron-LM training (tests/test_megatron_lm_train.py, the tiny config) build the same module tree
and parameter shapes, compared by ``megatron_metp.megatron.build.model_tree``'s digest. Negative
controls: a setting changed on one side (the vocabulary ring, linear biases, the MoE layer
frequency) gives another tree."""

from dataclasses import replace

from tests import model_trees
from megatron_metp.tools import plan as P

#: a 1/32-wide Llama-3-8B twin of configs/llama3-8b-6m-metp8.sh (METP 2 instead of 8): its flags
#: (vocabulary ring, full recompute as the streaming layer, host offload, GQA, SwiGLU, RMSNorm,
#: untied, no biases) with the sizes below
TWIN_ENV = dict(NUM_LAYERS=1, HIDDEN_SIZE=256, FFN_HIDDEN_SIZE=512, NUM_ATTENTION_HEADS=4,
                NUM_QUERY_GROUPS=2, VOCAB_SIZE=512, SEQ_LENGTH=2048, METP=2, GPUS_PER_NODE=2,
                # the config keeps the attention output of its first 4 layers: of the one here
                EXTRA_ARGS="--metp-keep-attention-output 1")
TWIN_JOB = P.Job(tp=1, metp=2, vocab_parallel=True, recompute="full", recompute_method="uniform",
                 recompute_num_layers=1, offload=True)


def test_the_6m_twin_measured_is_the_model_the_dry_run_builds(patched_megatron_lm):
    report = model_trees.of_dry_run(patched_megatron_lm, "llama3-8b-6m-metp8.sh", **TWIN_ENV)
    twin = P.Model(hidden=256, layers=1, heads=4, ffn=512, vocab=report["padded_vocab_size"],
                   seq=2048, query_groups=2, swiglu=True, tied=False, normalization="RMSNorm",
                   name="6m-twin")
    assert model_trees.of_measure(twin, TWIN_JOB) == report["model_tree"]
    # negative control: without the vocabulary ring measure builds another model
    assert model_trees.of_measure(twin, replace(TWIN_JOB, vocab_parallel=False)) != \
        report["model_tree"]


def test_the_tiny_moe_config_measured_is_the_model_the_dry_run_builds(patched_megatron_lm):
    report = model_trees.of_dry_run(patched_megatron_lm, "tiny-cpu-metp2-moe.sh")
    tiny_moe = P.Model(hidden=64, layers=2, heads=4, ffn=256, vocab=report["padded_vocab_size"],
                       seq=256, bias=True, experts=4, topk=2, moe_ffn=128, moe_layer_freq=2,
                       name="tiny-moe")
    assert model_trees.of_measure(tiny_moe, P.Job(tp=1, metp=2)) == report["model_tree"]
    # negative control: every layer MoE is another model
    assert model_trees.of_measure(replace(tiny_moe, moe_layer_freq=1), P.Job(tp=1, metp=2)) != \
        report["model_tree"]
