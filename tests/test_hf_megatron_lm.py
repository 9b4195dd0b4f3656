"""End to end through Megatron-LM itself: a tiny ``transformers`` Llama converted by
``megatron_metp.tools.hf import`` is loaded by the patched ``pretrain_gpt.py`` at METP = 2 on CPU
ranks (``scripts/pretrain_gpt.sh`` with ``METP_CPU=1`` and the ``model.sh`` the import wrote),
whose first iteration's loss equals transformers' loss on the same mock batch; the checkpoint
that run saves exports back to a model transformers loads.

Megatron-LM: the session's ``patched_megatron_lm`` clone (``tests/conftest.py``: the
``megatron_lm_checkout`` at the session's release, patched by ``scripts/apply_patches.sh``), shared
with the other Megatron-LM tests.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.versions import canonical
from tests.harness import free_port, run_ranks
from tests.test_hf import _import_on_a_rank, _safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, GBS = 64, 2
#: vocabulary 1024: a multiple of 128 x METP 2, so Megatron pads nothing and its loss is
#: transformers' loss
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rope_theta=20000.0, rms_norm_eps=1e-5,
            max_position_embeddings=256, tie_word_embeddings=False)


def _launch(config: str, megatron_lm_dir: str, **env_vars: str) -> str:
    """``scripts/pretrain_gpt.sh --config CONFIG`` on CPU ranks with a minimal environment plus
    ``env_vars`` (a fresh ``MASTER_PORT``); asserts it exits 0 and returns its output."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "LC_ALL": "C.UTF-8", "PYTHON": sys.executable, "MEGATRON_LM_DIR": megatron_lm_dir,
           "SEQ_LENGTH": str(SEQ), "GLOBAL_BATCH_SIZE": str(GBS), "EVAL_ITERS": "1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **env_vars}
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config", config], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def _mock_batches(n: int, vocab: int = TINY["vocab_size"], split: int = 0, eod: int = None,
                  pad: int = -1):
    """The first ``n`` samples of the training (``split`` 0; 1: validation) set of Megatron's
    mock GPT data for this run (NullTokenizer of ``vocab - 1`` tokens + end-of-document, or a
    tokenizer of ``vocab`` tokens with end-of-document id ``eod`` and padding id ``pad``; seed
    1234, split 1,1,1), as ``pretrain_gpt.py`` builds them (2 iterations, one of evaluation):
    ``(tokens, labels, loss_mask)`` each ``[n, SEQ]``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    V = vocab
    tok = SimpleNamespace(vocab_size=V, eod=V - 1 if eod is None else eod, pad=pad, bos=None,
                          unique_identifiers={"class": "NullTokenizer"})
    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend=None,
                           blend_per_split=None, split="1,1,1", path_to_cache=None,
                           tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, create_attention_mask=False,
                           context_parallel_size=2, data_parallel_size=1)
    built = BlendedMegatronDatasetBuilder(MockGPTDataset, [2 * GBS, GBS, GBS],
                                          lambda: True, cfg).build()
    items = [built[split][i] for i in range(n)]
    return tuple(torch.stack([torch.as_tensor(it[k]) for it in items])
                 for k in ("tokens", "labels", "loss_mask"))


def _transformers_loss(hf_dir, tokens, labels, mask) -> float:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(tokens).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                           labels.reshape(-1), reduction="none")
    return ((ce * mask.reshape(-1)).sum() / mask.sum()).item()


def test_pretrain_gpt_loads_the_import_and_trains_from_it(patched_megatron_lm, tmp_path):
    """docs/huggingface.md's walk-through end to end, with its environment (plain optimizer on
    CPU ranks, ``CHECKPOINT_PATH`` + the import as ``--pretrained-checkpoint``): import, train 2
    of 3 iterations, stopped after 2 (``--exit-interval 2``, as a job killed at its time limit;
    iteration 1's loss is transformers' on the same batch), export with and without
    ``--hf-config``, then the same launch again: it resumes from the run's own iteration-2
    checkpoint (not the import) and trains iteration 3 only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir, ckpt, run = (str(tmp_path / n) for n in ("hf", "ckpt", "run"))
    torch.manual_seed(21)
    LlamaForCausalLM(LlamaConfig(**TINY, dtype="float32")).save_pretrained(hf_dir)
    run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {"metp_parallel_size": 2})
    # the walk-through's environment (docs/huggingface.md step 4)
    env = dict(METP_CPU="1", PRECISION="fp32", TRANSFORMER_IMPL="local", GPUS_PER_NODE="2",
               TRAIN_ITERS="3", SAVE_INTERVAL="3", DISTRIBUTED_OPTIMIZER="0", CHECKPOINT_PATH=run)
    model_sh = os.path.join(ckpt, "model.sh")
    log = _launch(model_sh, patched_megatron_lm, **env, EXTRA_ARGS="--exit-interval 2")
    assert f"successfully loaded checkpoint from {ckpt}" in log, log[-4000:]
    losses = [float(x) for x in re.findall(r"iteration +\d+/ +3 \|.*?lm loss: ([0-9.E+-]+)", log)]
    assert len(losses) == 2, log[-4000:]  # stopped by --exit-interval 2 (iteration 2 saved)
    tokens, labels, mask = _mock_batches(2 * GBS)
    ref = _transformers_loss(hf_dir, tokens[:GBS], labels[:GBS], mask[:GBS])
    other = _transformers_loss(hf_dir, tokens[GBS:], labels[GBS:], mask[GBS:])
    print(f"\nMegatron-LM METP=2 iteration 1: lm loss {losses[0]:.6E}, transformers on the same "
          f"batch {ref:.7f} (rel. {abs(losses[0] - ref) / ref:.1e}); next batch {other:.7f}")
    assert abs(losses[0] - ref) <= 1e-5 * ref  # Megatron prints 7 significant digits
    assert abs(other - ref) > 1e-4 * ref  # the comparison depends on the batch it rebuilt

    exported = str(tmp_path / "exported")
    H.export_hf(run, exported, hf_config=os.path.join(ckpt, "hf"), log=lambda _msg: None)
    src, out = _safetensors(hf_dir), _safetensors(exported)
    assert sorted(src) == sorted(out)
    assert all(src[k].shape == out[k].shape for k in src)
    changed = [k for k in src if not torch.equal(src[k], out[k])]
    assert len(changed) == len(src), sorted(set(src) - set(changed))  # two Adam steps moved all
    trained = _transformers_loss(exported, tokens[:GBS], labels[:GBS], mask[:GBS])
    print(f"exported after 2 steps: transformers loss on batch 1 {trained:.7f}")
    assert trained < ref  # transformers runs the trained weights: batch 1 was learned from
    # without --hf-config: config.json from the run's saved Megatron-LM arguments, same model
    auto = str(tmp_path / "auto")
    H.export_hf(run, auto, log=lambda _msg: None)
    again = _safetensors(auto)
    assert sorted(again) == sorted(out) and all(torch.equal(again[k], out[k]) for k in out)
    with open(os.path.join(auto, "config.json")) as f:
        written = canonical(json.load(f))  # either transformers' layout (hf.versions)
    assert {k: written[k] for k in TINY} == TINY and written["model_type"] == "llama"

    # the walk-through's next launch: the same command resumes the run
    log = _launch(model_sh, patched_megatron_lm, **env)
    assert f"successfully loaded checkpoint from {run}" in log, log[-4000:]
    assert f"successfully loaded checkpoint from {ckpt}" not in log, log[-4000:]
    resumed = re.findall(r"iteration +(\d+)/ +3 \|.*?lm loss: ([0-9.E+-]+)", log)
    assert [int(i) for i, _ in resumed] == [3], log[-4000:]  # iterations 1-2 not run again
    assert math.isfinite(float(resumed[0][1]))


def test_from_scratch_llama_exports_without_hf_config(patched_megatron_lm, tmp_path):
    """configs/tiny-cpu-llama-metp2.sh trained from scratch (METP 2, 2 iterations; the learning
    rate warms up from 0, so iteration 1 leaves Megatron's random init as it is and saves it)
    with a Hugging Face tokenizer (``TOKENIZER_TYPE=HuggingFaceTokenizer``, a 1000-token BPE built
    here: tests/test_hf_tokenizer.py), exported by ``hf export`` with no ``--hf-config``
    (config.json from the saved args, the tokenizer from the run's ``--tokenizer-model``):
    transformers' loss of the iteration-1 export on the first batch equals the loss Megatron-LM
    printed for it; the iteration-2 export (trained) has learned the second batch;
    ``AutoTokenizer`` and ``AutoModelForCausalLM`` load the export, give a sentence the tokens of
    the ``tokenizers`` library and score them with the METP model's loss (METP 2, from the run's
    checkpoint); every exported file is mode 0644 under a 077 umask. (The validation split is
    not used: core_v0.19.0 builds mock validation samples this test does not rebuild.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_metp.tools.hf.config import geometry_from_hf
    from tests.test_hf import _metp_run
    from tests.test_hf_tokenizer import EOS, PAD, SENTENCE, make_tokenizer, reference_ids

    run = str(tmp_path / "run")
    tok_dir = make_tokenizer(str(tmp_path / "tokenizer"))
    log = _launch("configs/tiny-cpu-llama-metp2.sh", patched_megatron_lm, TRAIN_ITERS="2",
                  LR_WARMUP_ITERS="1", SAVE_INTERVAL="1", CHECKPOINT_PATH=run,
                  TOKENIZER_TYPE="HuggingFaceTokenizer", TOKENIZER_MODEL=tok_dir)
    # (Megatron prints the learning rate of the next iteration: 3e-4 after the one warm-up step)
    first = re.findall(r"iteration +1/ +2 \|.*?lm loss: ([0-9.E+-]+)", log)
    assert len(first) == 1, log[-4000:]
    exported = {}
    for it in (1, 2):
        out = exported[it] = str(tmp_path / f"hf{it}")
        umask = os.umask(0o077)
        try:
            assert H.main(["export", "--load", run, "--out", out, "--iteration", str(it)]) == 0
        finally:
            os.umask(umask)
        modes = {n: oct(os.stat(os.path.join(out, n)).st_mode & 0o777) for n in os.listdir(out)}
        assert modes == {n: "0o644" for n in ("model.safetensors", "config.json",
                                              "tokenizer.json", "tokenizer_config.json")}, modes
    with open(os.path.join(exported[1], "config.json")) as f:
        cfg = canonical(json.load(f))
    # configs/models/tiny-llama.sh; vocabulary 1000 padded to 1024 (128 x 2)
    assert {k: cfg[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps",
                                "tie_word_embeddings", "max_position_embeddings")} == dict(
        model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=SEQ)
    tokens, labels, mask = _mock_batches(2 * GBS, vocab=1000, eod=EOS, pad=PAD)
    b1, b2 = (slice(0, GBS), slice(GBS, 2 * GBS))
    ref = _transformers_loss(exported[1], tokens[b1], labels[b1], mask[b1])
    other = _transformers_loss(exported[1], tokens[b2], labels[b2], mask[b2])
    trained = _transformers_loss(exported[2], tokens[b2], labels[b2], mask[b2])
    megatron = float(first[0])
    print(f"\nfrom scratch, METP 2: Megatron-LM iteration 1 lm loss {megatron:.6E}, transformers "
          f"on the exported init {ref:.7f} (rel. {abs(megatron - ref) / ref:.1e}); batch 2: "
          f"{other:.7f} before, {trained:.7f} after the step on it")
    assert abs(megatron - ref) <= 1e-5 * ref  # Megatron prints 7 significant digits
    assert abs(other - ref) > 1e-4 * ref  # the comparison depends on the batch it rebuilt
    assert trained < other  # the iteration-2 export holds the trained weights

    ids = AutoTokenizer.from_pretrained(exported[2])(SENTENCE).input_ids
    assert ids == reference_ids(tok_dir)
    sentence = torch.tensor([ids[:13]])  # 12 positions: divisible by 2 x METP 2
    model = AutoModelForCausalLM.from_pretrained(exported[2], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        hf_loss = model(sentence, labels=sentence).loss.item()
    g = geometry_from_hf(cfg, make_vocab_size_divisible_by=1, metp_parallel_size=2)
    _, metp_loss = _metp_run(2, run, g.to_json(), sentence)  # the run's latest: iteration 2
    print(f"the sentence's first 13 tokens: transformers {hf_loss:.7f}, METP 2 from the run's "
          f"checkpoint {metp_loss:.7f} (rel. {abs(metp_loss - hf_loss) / hf_loss:.1e})")
    assert abs(metp_loss - hf_loss) <= 1e-5 * hf_loss
