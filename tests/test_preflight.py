"""The launcher's preflight (megatron_metp.megatron_lm.preflight): a bad Megatron-LM job is
refused in one process, before any rank starts, with every problem listed; a good one passes.

The data are tiny Megatron indexed datasets written here in the documented .idx layout and
read back by megatron-core's own reader; the split arithmetic is compared with megatron-core's.
"""

import argparse
import os
import resource
import subprocess
import sys

import pytest
import torch

from megatron_metp.megatron_lm import indexed_data, preflight, resume

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a METP 2 job's model flags, as scripts/pretrain_gpt.sh passes them for the tiny CPU config
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "256",
         "--num-attention-heads", "4", "--seq-length", "64", "--attention-dropout", "0",
         "--no-persist-layer-norm", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "10", "--eval-iters", "2", "--eval-interval", "5",
         "--distributed-backend", "gloo", "--transformer-impl", "local",
         "--no-gradient-accumulation-fusion", "--lr", "3e-4"]


def _hf_tokenizer(folder, with_config=True):
    os.makedirs(folder)
    with open(os.path.join(folder, "tokenizer.json"), "w") as fh:
        fh.write("{}")
    if with_config:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
            fh.write("{}")
    return str(folder)


def _run(argv, world_size, cwd):
    """Run the preflight as the launcher does; its CPU seconds (user + sys) must stay within the
    issue's 10 s (1.8 s measured on an idle core here; the wall time on the shared 2-core
    machine follows its load, so the wall limit is looser)."""
    cmd = [sys.executable, "-m", "megatron_metp.megatron_lm.preflight", "--world-size",
           str(world_size), "--cpu", "--", *argv]
    env = {**os.environ, "PYTHONPATH": REPO}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s <= 10.0, f"the preflight used {cpu_s:.1f} CPU seconds"
    return proc


@pytest.fixture
def corpus(tmp_path):
    """222 documents (the corpus of the issue) and 10 documents, as Megatron prefixes."""
    indexed_data.write_indexed_dataset(str(tmp_path / "corpus"), [[1, 2, 3, 4]] * 222)
    indexed_data.write_indexed_dataset(str(tmp_path / "small"), [[5, 6, 7]] * 10)
    return tmp_path


def test_a_bad_job_gets_every_problem_at_once(corpus):
    tok = _hf_tokenizer(corpus / "tok", with_config=False)
    argv = [*MODEL, "--metp-parallel-size", "3", "--data-path", "corpus", "missing",
            "--split", "949,50,1", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", tok]
    proc = _run(argv, world_size=3, cwd=corpus)  # relative prefixes: from the working directory
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err and proc.stdout == ""
    for needle in (
            "--seq-length 64 is not divisible by 2×METP = 6",  # METP 3: sequence chunks
            "--num-attention-heads 4 (not divisible by TP x METP = 3)",
            "--ffn-hidden-size 256 (not divisible by TP x METP = 3)",
            # the corpus: 949,50,1 leaves the test split of 222 documents empty
            "--split 949,50,1 leaves the test split of corpus empty: it holds 222 documents "
            "(train 211, valid 11, test 0)", "--split 949,50,0",
            "--data-path: missing.bin and missing.idx not found",
            f"--tokenizer-model {tok}: the folder lacks tokenizer_config.json"):
        assert needle in err, (needle, err)
    assert "preflight: 6 problems in this job" in err


def test_a_good_job_passes_with_one_line(corpus):
    tok = _hf_tokenizer(corpus / "tok")
    argv = [*MODEL, "--metp-parallel-size", "2", "--data-path", "0.5", str(corpus / "corpus"),
            "0.5", str(corpus / "small"), "--split", "8,1,1",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok]
    proc = _run(argv, world_size=2, cwd=corpus)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("preflight: OK (2 ranks") and len(proc.stderr.splitlines()) == 1


#: runs argv[1:] as ``python -m megatron_metp.megatron_lm.preflight`` with torch unimportable
_NO_TORCH = """
import runpy, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported by the preflight: " + name)
sys.meta_path.insert(0, NoTorch())
sys.argv = ["preflight"] + sys.argv[1:]
runpy.run_module(sys.argv.pop(1), run_name="__main__")
"""


def _without_torch(module, *args, cwd):
    return subprocess.run([sys.executable, "-c", _NO_TORCH, module, *args], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, "PYTHONPATH": REPO},
                          timeout=120)


def test_the_preflight_starts_without_torch(corpus):
    """The launcher's preflight imports no torch (about 1.5 CPU-s of imports per launch saved;
    the ranks and torchrun import it anyway). Negative control: the same guard stops a module
    that does import torch."""
    tok = _hf_tokenizer(corpus / "tok")
    argv = [*MODEL, "--metp-parallel-size", "2", "--num-experts", "4", "--data-path",
            str(corpus / "corpus"), "--split", "8,1,1", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", tok]
    proc = _without_torch("megatron_metp.megatron_lm.preflight", "--world-size", "2", "--cpu",
                          "--", *argv, cwd=corpus)
    assert proc.returncode == 0 and proc.stderr.startswith("preflight: OK (2 ranks"), proc.stderr
    assert "warning" not in proc.stderr  # (a failed check is reported as a warning and skipped)
    proc = _without_torch("megatron_metp.ops.rope", cwd=corpus)
    assert proc.returncode == 1 and "torch imported by the preflight: torch" in proc.stderr


def test_index_files_are_megatrons_and_splits_cut_as_megatron_cuts(tmp_path):
    """The .idx layout written and read here is the one megatron-core reads, and the split
    ranges are megatron-core's (negative control: a file that is not an index)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [[7, 8, 9], [1], [2, 3], [65000, 4, 5, 6]]
    prefix = str(tmp_path / "d")
    indexed_data.write_indexed_dataset(prefix, docs)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(docs))] == docs
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    head = indexed_data.read_index_header(prefix + ".idx")
    assert (head.sequences, head.documents, head.dtype_code) == (4, 4, 8)
    for split in ("949,50,1", "969, 30, 1", "98,2", "1,0,1", "8,1,1", "0.9,0.05,0.05"):
        for n in (1, 3, 10, 222, 1001):
            matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
            want = [None if m is None else (int(round(m[0] * n)), int(round(m[1] * n)))
                    for m in matrix]
            assert indexed_data.split_ranges(indexed_data.parse_split(split), n) == want, \
                (split, n)
    with open(prefix + ".bin", "rb") as fh, open(tmp_path / "bad.idx", "wb") as out:
        out.write(fh.read())
    with pytest.raises(ValueError, match="not a Megatron-LM index file"):
        indexed_data.read_index_header(str(tmp_path / "bad.idx"))


def test_data_tokenizer_and_checkpoint_checks(corpus, tmp_path):
    def problems(*extra, world=2):
        return preflight.job_problems([*MODEL, "--metp-parallel-size", "2", *extra], world)

    ok_tok = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]
    assert problems("--mock-data", *ok_tok) == []
    assert problems("--mock-data", "--tokenizer-type", "NullTokenizer") == [
        "--tokenizer-type NullTokenizer needs --vocab-size (VOCAB_SIZE in "
        "scripts/pretrain_gpt.sh)"]
    small = str(corpus / "small")
    # 10 documents: 98,1,1 empties valid and test; 8,1,1 gives each one
    out = problems("--data-path", small, "--split", "98,1,1", *ok_tok)
    assert len(out) == 1 and "valid and test split" in out[0] and "--split 98,0,0" in out[0]
    assert "(train 10, valid 0, test 0)" in out[0]
    assert problems("--data-path", small, "--split", "8,1,1", *ok_tok) == []
    out = problems("--data-path", small, "--split", "0,1,1", *ok_tok)
    assert len(out) == 1 and "gives the train split no share" in out[0]
    out = problems("--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
                   "--vocab-file", str(tmp_path / "vocab.json"))
    assert len(out) == 2 and out[0].startswith(f"--vocab-file {tmp_path / 'vocab.json'}: no "
                                               f"such file")
    assert out[1].startswith("--tokenizer-type GPT2BPETokenizer needs --merge-file")
    # a hub name is not checked here; a missing local folder is
    assert problems("--mock-data", "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", "some-org/some-model") == []
    out = problems("--mock-data", "--tokenizer-type", "HuggingFaceTokenizer",
                   "--tokenizer-model", str(tmp_path / "nope"))
    assert len(out) == 1 and "no such folder" in out[0]
    # --load: the launcher's first run (--load = --save, empty) passes; a missing other one not
    ckpt = str(tmp_path / "ckpt")
    assert problems("--mock-data", *ok_tok, "--load", ckpt, "--save", ckpt) == []
    out = problems("--mock-data", *ok_tok, "--load", ckpt)
    assert len(out) == 1 and out[0].startswith(f"--load {ckpt}: no such directory")
    os.makedirs(ckpt)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("20")
    out = problems("--mock-data", *ok_tok, "--load", ckpt, "--save", ckpt)
    assert len(out) == 1 and "names iteration '20', whose directory is missing" in out[0]
    # a value Megatron's parser would refuse: named, without argparse's usage text
    assert problems("--mock-data", *ok_tok, "--seq-length", "x") == [
        "argument --seq-length: invalid int value: 'x'"]
    # batch arithmetic: 4 ranks, METP 2 -> DP 2, micro-batch 1: global batch 3 is refused
    out = problems("--mock-data", *ok_tok, "--global-batch-size", "3", world=4)
    assert len(out) == 1 and "--global-batch-size 3 is not a multiple of" in out[0]


def _saved_checkpoint(root, **saved):
    """A checkpoint directory whose iter_0000010/common.pt holds Megatron-LM's saved ``args``."""
    d = os.path.join(root, "iter_0000010")
    os.makedirs(d)
    torch.save({"args": argparse.Namespace(**saved)}, os.path.join(d, "common.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("10")
    return str(root)


@pytest.mark.parametrize("saved_dist", [True, False])
def test_an_optimizer_layout_mismatch_is_refused_naming_the_flag(tmp_path, saved_dist):
    """A checkpoint saved with the distributed optimizer, loaded by the plain one (or the
    reverse), is refused before any rank starts, naming --use-distributed-optimizer and the
    weights-only load; the same layout and --no-load-optim pass."""
    load = _saved_checkpoint(tmp_path / "ckpt", metp_parallel_size=2,
                             tensor_model_parallel_size=1,
                             use_distributed_optimizer=saved_dist)
    args = argparse.Namespace(load=load, metp_parallel_size=2,
                              use_distributed_optimizer=not saved_dist)
    out = resume.resume_layout_problems(args)
    assert len(out) == 1
    fix = "add --use-distributed-optimizer" if saved_dist else "drop --use-distributed-optimizer"
    assert fix in out[0] and "--no-load-optim --no-load-rng" in out[0]
    with pytest.raises(ValueError, match="cannot read"):
        resume.check_resume_layout(args)
    assert resume.resume_layout_problems(
        argparse.Namespace(load=load, metp_parallel_size=2,
                           use_distributed_optimizer=saved_dist)) == []
    assert resume.resume_layout_problems(
        argparse.Namespace(load=load, metp_parallel_size=2, no_load_optim=True,
                           use_distributed_optimizer=not saved_dist)) == []
    # a stock run on the same checkpoint: both mismatches at once
    both = resume.resume_layout_problems(
        argparse.Namespace(load=load, metp_parallel_size=1,
                           use_distributed_optimizer=not saved_dist))
    assert len(both) == 2 and "--metp-parallel-size 2" in both[0]
    # and the preflight lists it with the rest
    argv = [*MODEL, "--metp-parallel-size", "2", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "1024", "--load", load, "--save", load]
    if not saved_dist:
        argv.append("--use-distributed-optimizer")
    out = preflight.job_problems(argv, 2)
    assert any(fix in p for p in out), out


def test_inside_the_ranks_every_problem_is_refused_at_once():
    """validate_metp_args (the patched validate_args, for pretrain_gpt.py started directly) runs
    the preflight's METP checks: METP 3's sequence, heads and FFN problems in one refusal, with
    nothing mapped."""
    from megatron_metp import megatron_lm as hooks

    args = preflight.parse_megatron_args([*MODEL, "--metp-parallel-size", "3"], 3)
    with pytest.raises(ValueError) as err:
        hooks.validate_metp_args(args)
    for needle in ("--seq-length 64 is not divisible by 2×METP = 6", "--num-attention-heads 4",
                   "--ffn-hidden-size 256"):
        assert needle in str(err.value)
    assert args.context_parallel_size == 1
    ok = preflight.parse_megatron_args([*MODEL, "--metp-parallel-size", "2"], 2)
    assert hooks.validate_metp_args(ok).context_parallel_size == 2


def test_a_metp_ring_across_nodes_and_the_exit_timer_are_refused_before_any_rank(tmp_path,
                                                                                monkeypatch):
    """Under Slurm ($GPUS_PER_NODE exported by the Slurm scripts) a METP 2 job on 2 nodes of 1
    rank is refused naming the group, the nodes and the fix, unless accepted on purpose; 2
    ranks per node pass. --exit-duration-in-mins is refused with METP, naming what works."""
    argv = [*MODEL, "--metp-parallel-size", "2", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "1024"]
    env = {**os.environ, "PYTHONPATH": REPO, "GPUS_PER_NODE": "1"}
    cmd = [sys.executable, "-m", "megatron_metp.megatron_lm.preflight", "--world-size", "2",
           "--cpu", "--", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert ("--metp-parallel-size 2 with --tensor-model-parallel-size 1 on 1 ranks per node: "
            "the METP group of global ranks [0, 1] would span nodes 0, 1") in proc.stderr
    assert "Fix: keep TP x METP a divisor of the GPUs per node (1)" in proc.stderr
    assert "preflight: 1 problem in this job" in proc.stderr
    assert preflight.job_problems(argv, 4, cpu=True, ranks_per_node=2) == []
    monkeypatch.setenv("METP_ALLOW_CROSS_NODE_RING", "1")  # on purpose (the config's variable)
    assert preflight.job_problems(argv, 2, cpu=True, ranks_per_node=1) == []
    monkeypatch.delenv("METP_ALLOW_CROSS_NODE_RING")
    assert preflight.job_problems(argv, 2, cpu=True) == []  # one node
    timer = preflight.job_problems([*argv, "--exit-duration-in-mins", "30"], 2, cpu=True)
    assert len(timer) == 1 and timer[0].startswith(
        "--metp-parallel-size 2 cannot be used with: --exit-duration-in-mins 30 (untested with")
    assert "--exit-signal-handler" in timer[0] and "--exit-interval N" in timer[0]
    stock = [a if a != "--metp-parallel-size" else "--tensor-model-parallel-size" for a in argv]
    assert preflight.job_problems([*stock, "--exit-duration-in-mins", "30"], 2, cpu=True) == []


def test_the_launcher_refuses_a_checkout_patched_by_an_older_patch(tmp_path):
    """A checkout whose files carry an older METP patch (here: ``training.py`` calling
    ``wire_wide_expert_parallel`` but not ``wire_ddp``, which the overlapped parameter gather
    needs) is refused before any rank starts, naming the file and how to patch again; the same
    checkout with the current calls passes to the preflight (the negative control), and one with
    no patch at all is told to run the patch script."""
    from megatron_metp.megatron_lm.patch_markers import PATCHED_FILES

    d = tmp_path / "Megatron-LM"
    for rel, call in PATCHED_FILES.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(f"# stock\n{call}(args)\n" if rel != "megatron/training/training.py"
                             else "# stock\nwire_wide_expert_parallel(model)\n")

    def launch():
        env = dict(os.environ, MEGATRON_LM_DIR=str(d), METP_CPU="1")
        return subprocess.run(["bash", "scripts/pretrain_gpt.sh", "--config",
                               "configs/tiny-cpu-metp2.sh", "--preflight"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    old = launch()
    assert old.returncode == 1
    assert "megatron/training/training.py without the calls the current patches add" in \
        old.stderr and "scripts/apply_patches.sh" in old.stderr, old.stderr
    (d / "megatron/training/training.py").write_text("wire_ddp(model)\n")
    new = launch()
    assert new.returncode == 0 and "preflight: OK (2 ranks" in new.stderr, new.stderr
    for rel in PATCHED_FILES:
        (d / rel).write_text("# stock\n")
    stock = launch()
    assert stock.returncode == 1 and "is not patched for METP: run" in stock.stderr
