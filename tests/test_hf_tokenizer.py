"""``hf export`` writes the run's Hugging Face tokenizer beside the weights
(:mod:`megatron_metp.tools.hf.tokenizer_export`): the import's tokenizer comes back, so that
``AutoTokenizer`` and ``AutoModelForCausalLM`` load the export and score a sentence with the METP
model's loss on the same tokens; ``--tokenizer`` and the run's ``--tokenizer-model`` are
preferred in that order; a run whose tokenizer has no Hugging Face form says so and the weights
are still written; a tokenizer that does not fit the model is refused before anything is
written. The from-scratch run that trains with this tokenizer through Megatron-LM and exports it
is ``tests/test_hf_megatron_lm.py::test_from_scratch_llama_exports_without_hf_config``.

No network: the tokenizer is a byte-level BPE trained here with the ``tokenizers`` library on a
generated corpus, saved as ``tokenizer.json`` + a hand-written ``tokenizer_config.json``
(``PreTrainedTokenizerFast``, which transformers 4.x and 5.x both load; a folder saved by
transformers 5's ``save_pretrained`` names ``TokenizersBackend``, which 4.x cannot load).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from megatron_metp.tools import hf as H
from megatron_metp.tools.hf.config import HFConfigError, geometry_from_hf
from megatron_metp.tools.hf.tokenizer_export import plan_tokenizer
from tests.harness import run_ranks
from tests.test_hf import _import_on_a_rank, _metp_run

SENTENCE = "the quick brown fox jumps over the lazy dog, twice; then it sleeps."
#: vocabulary 1000 (3 special tokens, 256 bytes, 741 merges), ids of <pad>, <s>, </s>
VOCAB, PAD, BOS, EOS = 1000, 0, 1, 2


def _corpus(n: int = 4000, seed: int = 0):
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(600)]
    words += SENTENCE.replace(",", "").replace(";", "").replace(".", "").split()
    for _ in range(n):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "."


def make_tokenizer(folder: str) -> str:
    """A byte-level BPE tokenizer of ``VOCAB`` tokens saved as a Hugging Face tokenizer folder
    (``tokenizer.json``, ``tokenizer_config.json``); returns ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "pad_token": "<pad>", "clean_up_tokenization_spaces":
                   False, "model_max_length": 1 << 20}, f, indent=1)
    return folder


def reference_ids(folder: str, text: str = SENTENCE):
    """``text``'s ids by the ``tokenizers`` library itself (no transformers)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).encode(text).ids


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok") / "tokenizer"))


def test_the_tokenizer_loads_in_transformers_as_built(tok_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok_dir)
    ids = t(SENTENCE).input_ids
    assert (len(t), t.pad_token_id, t.bos_token_id, t.eos_token_id) == (VOCAB, PAD, BOS, EOS)
    assert ids == reference_ids(tok_dir) and len(ids) < len(SENTENCE) / 2  # merges are used
    assert t.decode(ids) == SENTENCE


def test_which_tokenizer_export_writes(tok_dir, tmp_path):
    """``--tokenizer``, then the run's ``--tokenizer-model``, then the import's folder; none:
    a line saying why, naming the run's tokenizer type."""
    other = make_tokenizer(str(tmp_path / "other"))
    hf_side = make_tokenizer(str(tmp_path / "hf"))
    run = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir)
    assert plan_tokenizer(run, hf_side, other, 1024, "X").source == other
    plan = plan_tokenizer(run, hf_side, None, 1024, "X")
    assert plan.source == tok_dir and plan.files == ["tokenizer.json", "tokenizer_config.json"]
    assert plan.line == (f"tokenizer: tokenizer.json, tokenizer_config.json from the run's "
                         f"--tokenizer-model {tok_dir}")
    null = dict(tokenizer_type="NullTokenizer", tokenizer_model=None)
    plan = plan_tokenizer(null, hf_side, None, 1024, "X")
    assert plan.source == hf_side
    assert "(the run's --tokenizer-type NullTokenizer has no" in plan.line
    plan = plan_tokenizer(null, str(tmp_path), None, 1024, "X")  # no tokenizer files there
    assert plan.source is None and plan.files == []
    assert plan.line.startswith("no tokenizer written: the run's --tokenizer-type NullTokenizer "
                                "has no Hugging Face tokenizer files; AutoTokenizer.from_pretrained"
                                "('X') will fail")
    hub = plan_tokenizer(dict(run, tokenizer_model="org/name"), None, None, 1024, "X")
    assert hub.source is None and "--tokenizer-model 'org/name' is not a folder here" in hub.line
    gpt2 = plan_tokenizer(dict(tokenizer_type="GPT2BPETokenizer"), None, None, 1024, "X")
    assert "--tokenizer-type GPT2BPETokenizer has no Hugging Face tokenizer files" in gpt2.line


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tok_dir, tmp_path):
    run = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir)
    with pytest.raises(HFConfigError, match=r"tokenizer.json: the tokenizer \(the run's "
                                            r"--tokenizer-model .*\) has token ids up to 999, "
                                            r"the model's vocabulary has 512 rows"):
        plan_tokenizer(run, None, None, 512, "X")
    with pytest.raises(HFConfigError, match="--tokenizer .*: not a Hugging Face tokenizer folder"):
        plan_tokenizer(run, None, str(tmp_path), 1024, "X")
    assert plan_tokenizer(run, None, None, VOCAB, "X").source == tok_dir  # fits exactly


#: a tiny Llama with the tokenizer's vocabulary; SEQ + 1 tokens of the sentence are scored
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False)
SEQ = 12


def test_an_import_exports_with_its_tokenizer_and_scores_a_sentence_alike(tok_dir, tmp_path):
    """A Hugging Face folder with its tokenizer is imported (the tokenizer is kept in
    ``CKPT/hf/``) and exported: ``AutoTokenizer`` and ``AutoModelForCausalLM`` load the export;
    transformers' loss on the sentence's tokens equals the METP model's (METP 2, from the
    checkpoint) within 1e-5; the tokens are the ``tokenizers`` library's own. Negative control:
    the same export with the tokenizer removed is refused by ``AutoTokenizer``."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hf_dir, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "out"))
    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(**TINY, dtype="float32")).save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tok_dir, name), os.path.join(hf_dir, name))
    geometry = run_ranks(_import_on_a_rank, 1, hf_dir, ckpt,
                         {"make_vocab_size_divisible_by": 1, "metp_parallel_size": 2})[0]
    lines = []
    H.export_hf(ckpt, out, log=lines.append)
    assert lines[-1] == (f"tokenizer: tokenizer.json, tokenizer_config.json from the Hugging "
                         f"Face folder {os.path.join(ckpt, 'hf')} (the checkpoint holds no "
                         f"saved Megatron-LM arguments)")
    assert {n: oct(os.stat(os.path.join(out, n)).st_mode & 0o777) for n in os.listdir(out)} == \
        {n: "0o644" for n in ("model.safetensors", "config.json", "generation_config.json",
                              "tokenizer.json", "tokenizer_config.json")}
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(SENTENCE).input_ids
    assert ids == reference_ids(tok_dir)
    assert len(ids) > SEQ
    batch = torch.tensor([ids[:SEQ + 1]])
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        ref = model(batch, labels=batch).loss.item()
    assert geometry["padded_vocab_size"] == VOCAB  # 1000 = 500 x METP 2: no padded rows
    _, metp = _metp_run(2, ckpt, geometry, batch)
    print(f"\nsentence of {len(ids)} tokens, first {SEQ + 1} scored: transformers {ref:.7f}, "
          f"METP 2 {metp:.7f} (rel. {abs(metp - ref) / ref:.1e})")
    assert abs(metp - ref) <= 1e-5 * ref
    os.remove(os.path.join(out, "tokenizer.json"))  # negative control
    os.remove(os.path.join(out, "tokenizer_config.json"))
    with pytest.raises(Exception):  # transformers' error differs by version (OSError,
        AutoTokenizer.from_pretrained(out)  # ImportError for want of sentencepiece / protobuf)


def test_an_export_without_a_tokenizer_says_so_and_writes_the_weights(tok_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "out"))
    LlamaForCausalLM(LlamaConfig(**TINY, dtype="float32")).save_pretrained(hf_dir)
    run_ranks(_import_on_a_rank, 1, hf_dir, ckpt, {"make_vocab_size_divisible_by": 1})
    lines = []
    H.export_hf(ckpt, out, log=lines.append)
    assert lines[-1].startswith("no tokenizer written: the checkpoint holds no saved Megatron-LM "
                                "arguments; AutoTokenizer.from_pretrained(")
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors"]
    again = str(tmp_path / "again")  # --tokenizer adds one
    assert H.main(["export", "--load", ckpt, "--out", again, "--tokenizer", tok_dir]) == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(again))
    small = str(tmp_path / "small")  # a tokenizer larger than the model: nothing written
    g = geometry_from_hf(json.load(open(os.path.join(hf_dir, "config.json"))))
    with open(os.path.join(tok_dir, "tokenizer.json")) as f:
        big = json.load(f)
    big["added_tokens"].append(dict(big["added_tokens"][0], id=g.vocab_size, content="<x>"))
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    (bigger / "tokenizer.json").write_text(json.dumps(big))
    (bigger / "tokenizer_config.json").write_text("{}")
    with pytest.raises(HFConfigError, match=f"token ids up to {g.vocab_size}, the model's "
                                            f"vocabulary has {g.vocab_size} rows"):
        H.export_hf(ckpt, small, tokenizer=str(bigger), log=lambda _m: None)
    assert not os.path.exists(small)
