"""The launcher says what to do before any rank starts (scripts/pretrain_gpt.sh, compare_tp.sh,
the Slurm scripts, megatron_metp.megatron_lm.launch_checks): the rendezvous port, the settings it
needs, relative paths, flags after ``--`` through the preflight, the ranks' Python environment,
and the planner's multi-node launch line. Each refusal has its negative control (the good
setting passes). Nothing trains: the printing and checking modes only, and a torchrun/srun that
only record their call.
"""

import os
import shlex
import socket
import subprocess
import sys

import pytest
import torch

from megatron_metp.megatron_lm import launch_checks
from megatron_metp.tools import plan as P
from tests.test_scripts import REPO, SLURM_ENV, _env, _fake_launch, _flags, _print_cmd, _run

TINY = "configs/tiny-cpu-metp2.sh"


def _launcher(*args, cwd=REPO, **env):
    return _run(["bash", os.path.join(REPO, "scripts", "pretrain_gpt.sh"), *args],
                env=_env(**env), cwd=cwd, check=False)


# ------------------------------------------------------------------------------ settings

def test_a_missing_or_malformed_setting_is_named_with_its_fix(tmp_path):
    config = tmp_path / "noseq.sh"
    config.write_text('source "%s/configs/models/tiny.sh"\n: "${METP_CPU:=1}"\n' % REPO)
    proc = _launcher("--config", str(config), "--print-cmd", MEGATRON_LM_DIR="/m")
    assert proc.returncode == 1 and "parameter null or not set" not in proc.stderr
    assert "not set: SEQ_LENGTH (neither the config" in proc.stderr, proc.stderr
    assert "SEQ_LENGTH=<value> scripts/pretrain_gpt.sh" in proc.stderr
    proc = _launcher("--config", str(config), "--print-cmd", MEGATRON_LM_DIR="/m",
                     SEQ_LENGTH="4k", HIDDEN_SIZE="1k", TP="2x")
    assert proc.returncode == 1, proc.stderr
    assert "not a whole number: HIDDEN_SIZE=1k SEQ_LENGTH=4k TP=2x" in proc.stderr
    _, argv = _print_cmd(str(config), SEQ_LENGTH=128)  # the negative control
    assert _flags(argv)["--seq-length"] == ["128"]
    # an interpreter that is not there: named before anything runs (--print-cmd only prints it)
    proc = _launcher("--config", TINY, "--preflight", MEGATRON_LM_DIR="/m", PYTHON="/no/python")
    assert proc.returncode == 1 and "PYTHON=/no/python not found: make venv" in proc.stderr
    launcher, _ = _print_cmd(TINY, PYTHON="/no/python")
    assert launcher[:3] == ["/no/python", "-m", "torch.distributed.run"]


# ------------------------------------------------------------------------------ port

def test_the_rendezvous_port_is_free_or_refused_naming_the_fix():
    with socket.socket() as held:  # another job's rendezvous on this node
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        proc = _launcher("--config", TINY, "--print-cmd", MEGATRON_LM_DIR="/m",
                         MASTER_PORT=taken)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert f"MASTER_PORT={taken} is taken on {socket.gethostname()}" in proc.stderr
        assert "unset MASTER_PORT (one node: the launcher then picks a free port)" in proc.stderr
        launcher, _ = _print_cmd(TINY)  # unset: a free port, not the taken one
        port = int(launcher[launcher.index("--master_port") + 1])
        assert port != taken and not launch_checks.port_taken(port)
        free = launch_checks.free_port()  # a free port given is used as it is
        launcher, _ = _print_cmd(TINY, MASTER_PORT=free)
        assert launcher[launcher.index("--master_port") + 1] == str(free)
        # several nodes agree on the documented default; only the rendezvous node checks it
        launcher, _ = _print_cmd(TINY, NNODES=2, NODE_RANK=1, MASTER_ADDR="node0")
        assert launcher[launcher.index("--master_port") + 1] == "6000"
        port, problem = launch_checks.choose_port(str(taken), 2, 0, "localhost")
        assert port is None and "set MASTER_PORT to a port free on every node" in problem


def test_a_port_left_by_a_finished_job_is_free_again():
    """A rendezvous store that has just closed (SO_REUSEADDR, as torch's store listens) leaves
    its connections in TIME_WAIT: the same port is free for the next (or requeued) job."""
    store = socket.socket()
    store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    store.bind(("127.0.0.1", 0))
    store.listen()
    port = store.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = store.accept()
    assert launch_checks.port_taken(port)  # while it listens
    store.close()
    accepted.close()  # the store's side closes first: its end waits in TIME_WAIT
    client.close()
    assert not launch_checks.port_taken(port)
    assert launch_checks.choose_port(str(port), 1, 0, "localhost") == (port, None)


# ------------------------------------------------------------------------------ paths

def test_relative_paths_are_taken_from_the_submit_folder(tmp_path):
    (tmp_path / "tok").mkdir()
    common = dict(CHECKPOINT_PATH="ckpt", DATA_PATH="0.5 data/a 0.5 /abs/b",
                  TOKENIZER_MODEL="tok", TENSORBOARD_DIR="./tb")
    proc = _launcher("--config", TINY, "--print-cmd", "--", "--load", "old", "--data-path",
                     "1.0", "d/x", "2", "d/y", "--tokenizer-model", "org/name", "--pretrained-checkpoint", "imported", cwd=tmp_path,
                     MEGATRON_LM_DIR="/m", **common)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout.splitlines()[-1])
    f = _flags(argv[argv.index("/m/pretrain_gpt.py") + 1:])
    here = str(tmp_path)
    assert f["--save"] == [f"{here}/ckpt"] and f["--tensorboard-dir"] == [f"{here}/tb"]
    assert f["--load"] == [f"{here}/old"]  # after '--' (the last --load wins)
    assert f["--data-path"] == ["1.0", f"{here}/d/x", "2", f"{here}/d/y"]
    assert f["--tokenizer-model"] == ["org/name"]  # a hub name stays one
    assert f["--pretrained-checkpoint"] == [f"{here}/imported"]
    assert argv[argv.index("--data-path") + 1:argv.index("--data-path") + 5] == \
        ["0.5", f"{here}/data/a", "0.5", "/abs/b"]
    assert argv[argv.index("--tokenizer-model") + 1] == f"{here}/tok"
    # under Slurm: the folder sbatch was run from; absolute paths are kept (the control)
    proc = _launcher("--config", TINY, "--print-cmd", cwd=tmp_path, MEGATRON_LM_DIR="/m",
                     SLURM_SUBMIT_DIR="/submit", CHECKPOINT_PATH="ckpt", VOCAB_FILE="/v.json",
                     MERGE_FILE="m.txt", DATA_PATH="/d/x", TOKENIZER_TYPE="GPT2BPETokenizer")
    argv = shlex.split(proc.stdout.splitlines()[-1])
    f = _flags(argv[argv.index("/m/pretrain_gpt.py") + 1:])
    assert f["--save"] == ["/submit/ckpt"] and f["--vocab-file"] == ["/v.json"]
    assert f["--merge-file"] == ["/submit/m.txt"] and f["--data-path"] == ["/d/x"]


# ------------------------------------------------------------------------------ release (YaRN)

def _checkout(tmp_path, yarn):
    tmp_path.mkdir(exist_ok=True)
    mlm, bin_dir = _fake_launch(tmp_path)
    with open(mlm / "megatron" / "training" / "arguments.py", "a") as fh:  # (patched by it)
        fh.write("p.add_argument('--yarn-beta-fast')\n" if yarn else "p.add_argument('--rope')\n")
    return mlm, bin_dir


def test_yarn_after_dashdash_is_refused_by_the_preflight_naming_the_release(tmp_path):
    """core_v0.16.1 (a checkout without --yarn-* flags): YaRN from the settings or after '--' is
    refused before any rank, suggesting core_v0.19.0 and not another position embedding."""
    mlm, bin_dir = _checkout(tmp_path, yarn=False)
    proc = _launcher("--preflight", "--", "--position-embedding-type", "yarn",
                     "--yarn-beta-fast", "32", MEGATRON_LM_DIR=mlm)
    assert proc.returncode == 1, proc.stderr
    assert "--position-embedding-type yarn, --yarn-beta-fast: YaRN needs Megatron-LM " \
           "core_v0.19.0" in proc.stderr
    proc_env = _launcher("--print-cmd", MEGATRON_LM_DIR=mlm, POSITION_EMBEDDING_TYPE="yarn")
    for p in (proc, proc_env):
        assert "core_v0.19.0 checkout patched by scripts/apply_patches.sh" in p.stderr
        assert "=rope" not in p.stderr and "would train a different model" in p.stderr
    # the controls: the same flags on a checkout that has them; no YaRN on the old one
    assert launch_checks.release_problems(["--position-embedding-type", "yarn"],
                                          str(_checkout(tmp_path / "new", yarn=True)[0])) == []
    assert launch_checks.release_problems(["--position-embedding-type", "rope"], str(mlm)) == []
    assert launch_checks.release_problems(["--position-embedding-type=yarn"], str(mlm))


# ------------------------------------------------------------------------------ environment

def test_gpu_ranks_without_a_gpu_are_refused_naming_metp_cpu(tmp_path):
    mlm, bin_dir = _fake_launch(tmp_path)
    env = dict(MEGATRON_LM_DIR=mlm, TORCHRUN=bin_dir / "torchrun", PREFLIGHT=0)
    proc = _launcher("--config", TINY, METP_CPU=0, **env)
    if torch.cuda.is_available():  # a GPU machine: GPU ranks are what it runs
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1 and "set METP_CPU=1 to train on CPU ranks" in proc.stderr
        assert f"GPU ranks (METP_CPU is not 1) but {sys.executable}" in proc.stderr
        assert not (tmp_path / "torchrun.called").exists()
    proc = _launcher("--config", TINY, METP_CPU=1, **env)  # the control
    assert proc.returncode == 0, proc.stderr
    assert f"2 CPU ranks, config tiny-cpu-metp2.sh, {sys.executable} (torch " in proc.stderr
    assert (tmp_path / "torchrun.called").exists()


def test_slurm_refuses_a_cpu_only_environment_on_gpu_nodes_and_names_it(tmp_path):
    """Under Slurm (no container) the batch host checks the ranks' environment before srun: a
    torch built without CUDA where nvidia-smi lists GPUs is refused (whatever METP_CPU says);
    on a node without GPUs the same job goes on, naming the environment."""
    mlm, bin_dir = _fake_launch(tmp_path)
    path = f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    base = dict(SLURM_ENV, METP_HOSTNAMES="localhost n2", MEGATRON_LM_DIR=mlm, PATH=path,
                LOG_DIR=tmp_path / "logs", GPUS_PER_NODE=2, PREFLIGHT=0)
    run = ["bash", os.path.join(REPO, "scripts", "slurm", "pretrain_gpt.sbatch")]
    proc = _run(run, env=_env(**base))  # the control: nvidia-smi lists no GPU
    assert f"node 0 of 2 ({socket.gethostname()}): {sys.executable} (torch {torch.__version__}" \
        in proc.stderr, proc.stderr
    assert (tmp_path / "srun.called").exists()
    (tmp_path / "srun.called").unlink()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n'
                                        'echo "GPU 1: NVIDIA H200 (UUID: GPU-1)"\n')
    proc = _run(run, env=_env(**base), check=False)
    if torch.version.cuda is None:
        assert proc.returncode == 1 and not (tmp_path / "srun.called").exists()
        assert f"this Slurm node has 2 NVIDIA GPUs but the ranks' environment " \
               f"{sys.executable} has torch {torch.__version__}, built without CUDA" in proc.stderr
        assert "CONTAINER_IMAGE" in proc.stderr and "nothing was started" in proc.stderr
    else:  # a CUDA build of torch: the GPUs are what it uses
        assert proc.returncode == 0 and (tmp_path / "srun.called").exists()


# ------------------------------------------------------------------------------ compare_tp.sh

def test_compare_tp_checks_both_runs_settings_before_the_first(tmp_path):
    out = tmp_path / "cmp"
    proc = _run(["bash", "scripts/compare_tp.sh", "--config", "tiny-cpu-metp2.sh", "--out",
                 str(out)], env=_env(MEGATRON_LM_DIR="/m", SEQ_LENGTH="4k"), check=False)
    assert proc.returncode == 1 and "not a whole number: SEQ_LENGTH=4k" in proc.stderr
    assert "refused the settings of tiny-cpu-metp2.sh" in proc.stderr
    assert not (out / "metp.log").exists()  # nothing ran


# ------------------------------------------------------------------------------ planner

def test_the_planners_multi_node_launch_line_is_the_slurm_script():
    """32 GPUs (4 nodes): ``sbatch --nodes=4 scripts/slurm/pretrain_gpt.sbatch`` with the settings;
    run through the script (--print-only, as inside the allocation) every node's command has the
    planner's flags. One node (the control): scripts/pretrain_gpt.sh."""
    model = P.PRESETS["gpt-1.3b"].with_seq(1 << 20)
    job = P.Job(metp=8, cp=4, vocab_parallel=True, recompute="full")
    line = P.launch_line(model, job, "metp")
    words = shlex.split(line)
    assert words[-3:] == ["sbatch", "--nodes=4", "scripts/slurm/pretrain_gpt.sbatch"], line
    env = dict(w.split("=", 1) for w in words[:-3])
    assert "NNODES" not in env and env["CONFIG"] == "configs/models/gpt-1.3b.sh"
    proc = _run(["bash", "scripts/slurm/pretrain_gpt.sbatch", "--print-only"],
                env=_env(**{**SLURM_ENV, "SLURM_NNODES": 4}, **env, METP_HOSTNAMES="a b c d",
                         MEGATRON_LM_DIR="/m", TRANSFORMER_IMPL="transformer_engine"))
    torchruns = [shlex.split(ln) for ln in proc.stdout.splitlines() if "--nproc_per_node" in ln]
    assert len(torchruns) == 4
    want = _flags(P.megatron_flags(model, job, "metp"))
    for node, cmd in enumerate(torchruns):
        assert cmd[cmd.index("--nnodes") + 1] == "4" and cmd[cmd.index("--node_rank") + 1] == \
            str(node) and cmd[cmd.index("--nproc_per_node") + 1] == "8"
        got = _flags(cmd[cmd.index("/m/pretrain_gpt.py") + 1:])
        for flag, values in want.items():
            assert got.get(flag) == values, flag
    one = P.launch_line(model, P.Job(metp=8, vocab_parallel=True, recompute="full"), "metp")
    assert one.endswith("scripts/pretrain_gpt.sh --config configs/models/gpt-1.3b.sh")
    assert "sbatch" not in one
