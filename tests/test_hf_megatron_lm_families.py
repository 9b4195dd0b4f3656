"""Megatron-LM's own ``pretrain_gpt.py`` (patched, at the session's release, METP 2 on CPU ranks,
fp32) loading a tiny ``transformers`` Qwen3, Qwen2.5, Mistral and Qwen3 with YaRN converted by
``megatron_metp.tools.hf import``: iteration 1 prints transformers' loss of the same mock batch
(``--qk-layernorm``, ``--kv-channels``, ``--add-qkv-bias``, ``--position-embedding-type yarn``
flags from the import's ``model.sh``). YaRN runs on core_v0.19.0; core_v0.16.1 refuses it
naming the release."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_metp.tools.hf.versions import installed_layout
from tests.harness import free_port, run_ranks
from tests.megatron_lm_release import RELEASE
from tests.test_hf import _import_on_a_rank
from tests.test_hf_megatron_lm import GBS, ROOT, SEQ, TINY, _mock_batches

#: family -> (config class, model class, fields beyond test_hf_megatron_lm.TINY)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),   # 4 heads of 32 at 64
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # Qwen3 with YaRN: original context 16, so most of the 64 positions lie past it
    # (--position-embedding-type yarn: Megatron-LM core_v0.19.0; core_v0.16.1 refuses it)
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
}


def _make(hf_dir, family):
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(31)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(
        **TINY, **extra, dtype="float32")).float()
    with torch.no_grad():  # random biases and q/k norms (transformers initialises them 0 / 1)
        for name, p in model.named_parameters():
            if name.endswith((".bias", "q_norm.weight", "k_norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
            elif "rope_scaling" in extra and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)  # sharper attention: the positions (YaRN's angles) matter more
    model.save_pretrained(hf_dir)
    return getattr(transformers, model_cls)


def _loss(model_cls, hf_dir, tokens, labels, mask, **config) -> float:
    model = model_cls.from_pretrained(hf_dir, dtype=torch.float32,
                                      attn_implementation="eager", **config).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                           labels.reshape(-1), reduction="none")
    return ((ce * mask.reshape(-1)).sum() / mask.sum()).item()


def check_iteration_1_loss(log: str, model_cls, hf_dir: str, label: str):
    """The run's one ``iteration 1/1`` lm loss equals transformers' on the same mock batch
    (Megatron prints 7 significant digits), and the next batch's loss differs (so the comparison
    depends on the batch). Returns ``(tokens, labels, mask, Megatron-LM's loss, transformers'
    loss)``."""
    losses = [float(x) for x in re.findall(r"iteration +1/ +1 \|.*?lm loss: ([0-9.E+-]+)", log)]
    assert len(losses) == 1, log[-4000:]
    tokens, labels, mask = _mock_batches(2 * GBS)
    ref = _loss(model_cls, hf_dir, tokens[:GBS], labels[:GBS], mask[:GBS])
    other = _loss(model_cls, hf_dir, tokens[GBS:], labels[GBS:], mask[GBS:])
    print(f"\n{label}: Megatron-LM METP=2 iteration 1 lm loss {losses[0]:.6E}, transformers "
          f"{ref:.7f} (rel. {abs(losses[0] - ref) / ref:.1e}); next batch {other:.7f}")
    assert abs(losses[0] - ref) <= 1e-5 * ref
    assert abs(other - ref) > 1e-4 * ref
    return tokens, labels, mask, losses[0], ref


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pretrain_gpt_prints_transformers_loss_at_iteration_1(patched_megatron_lm, tmp_path,
                                                              family):
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    model_cls = _make(hf_dir, family)
    run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {"metp_parallel_size": 2})
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "LC_ALL": "C.UTF-8", "PYTHON": sys.executable, "MEGATRON_LM_DIR": patched_megatron_lm,
           "METP_CPU": "1", "PRECISION": "fp32", "TRANSFORMER_IMPL": "local",
           "GPUS_PER_NODE": "2", "SEQ_LENGTH": str(SEQ), "GLOBAL_BATCH_SIZE": str(GBS),
           "TRAIN_ITERS": "1", "EVAL_ITERS": "1", "MASTER_PORT": str(free_port()),
           "CHECKPOINT_PATH": str(tmp_path / "run"), "SAVE_INTERVAL": "1000",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config",
                           os.path.join(ckpt, "model.sh")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    if family == "qwen3_yarn" and RELEASE.tag == "core_v0.16.1":
        assert proc.returncode != 0
        assert "--position-embedding-type yarn) needs Megatron-LM core_v0.19.0" in log and \
            "(core_v0.16.1)" in log, log[-4000:]
        return
    assert proc.returncode == 0, log[-12000:]
    assert f"successfully loaded checkpoint from {ckpt}" in log, log[-4000:]
    flags = {"qwen3": "--qk-layernorm", "qwen2": "--add-qkv-bias", "mistral": "--swiglu",
             "qwen3_yarn": "--qk-layernorm"}
    assert re.search(rf"{flags[family][2:].replace('-', '_')} \.+ True", log), log[-4000:]
    if family == "qwen3_yarn":
        assert re.search(r"position_embedding_type \.+ yarn", log), log[-4000:]
        assert "RoPE angles: exact" in log, log[-4000:]
    tokens, labels, mask, _, ref = check_iteration_1_loss(log, model_cls, hf_dir, family)
    if family == "qwen3_yarn":  # ... and on YaRN
        # YaRN off as the installed transformers spells it (5.x: rope_parameters)
        off = ({"rope_parameters": {"rope_type": "default", "rope_theta": TINY["rope_theta"]}}
               if installed_layout() == 5 else {"rope_scaling": None})
        plain = _loss(model_cls, hf_dir, tokens[:GBS], labels[:GBS], mask[:GBS], **off)
        print(f"without YaRN: {plain:.7f}")
        assert abs(plain - ref) > 1e-4 * ref
