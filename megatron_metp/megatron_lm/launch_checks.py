"""The launcher's checks of the node and the release, each naming the fix, before any rank starts.

``scripts/pretrain_gpt.sh`` (and through it ``scripts/compare_tp.sh`` and the Slurm scripts) runs:

* ``python megatron_metp/megatron_lm/launch_checks.py port --nnodes N --node-rank R
  --master-addr A [--master-port P]`` (run as a file: no package import, no torch): prints the rendezvous port to use. ``P`` empty on one
  node: a port free here (another job on the node may hold the old default, 6000); on several
  nodes the documented default 6000 (every node must agree). On the node that hosts the
  rendezvous (``A`` is this machine) a port another process holds is refused, naming a free one,
  instead of torchrun's ``EADDRINUSE`` once the ranks have started.
* ``python megatron_metp/megatron_lm/launch_checks.py node [--cpu]``: prints which environment
  runs the ranks (the interpreter, its torch build read from ``torch/version.py`` without
  importing torch, the GPUs ``nvidia-smi -L`` lists) and refuses, naming the fix: GPU ranks
  (``METP_CPU`` unset) where this interpreter's torch sees no CUDA device (else the ranks fail
  a minute later on a missing ``triton``); and under Slurm, a torch built without CUDA on a node
  with NVIDIA GPUs (a CPU-only venv made on a login node, whose ranks would train on the CPU).

:func:`release_problems` is the preflight's check of flags the Megatron-LM checkout's own parser
does not have (YaRN on core_v0.16.1), so that they are refused whether they come from the
settings or after ``--``.
"""

from __future__ import annotations

import argparse
import ast
import errno
import glob
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["DEFAULT_MULTI_NODE_PORT", "free_port", "port_taken", "is_local", "choose_port",
           "visible_nvidia_gpus", "torch_build", "node_problems", "release_problems", "main"]

#: the rendezvous port of a multi-node job without MASTER_PORT (every node must agree on it)
DEFAULT_MULTI_NODE_PORT = 6000


# ------------------------------------------------------------------------------------ port

def free_port() -> int:
    """A TCP port nothing listens on here (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def port_taken(port: int) -> bool:
    """Whether another process listens on ``port`` here (binding it fails with EADDRINUSE), as
    torchrun's rendezvous store would find it. ``SO_REUSEADDR``, as the store sets it: the
    connections of a job that just ended on the port (TIME_WAIT, e.g. a requeued Slurm job's
    same port) do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def is_local(addr: str) -> bool:
    """Whether ``addr`` names this machine (loopback, its host name, or one of its addresses)."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    if addr in names or addr.split(".")[0] == socket.gethostname().split(".")[0]:
        return True
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return False
    if ip.startswith("127."):
        return True
    try:
        own = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        own = set()
    return ip in own


def choose_port(port: Optional[str], nnodes: int, node_rank: int,
                master_addr: str) -> Tuple[Optional[int], Optional[str]]:
    """``(port, None)`` to use, or ``(None, problem)`` naming the fix."""
    if port in (None, ""):
        if nnodes == 1:
            return free_port(), None
        chosen, given = DEFAULT_MULTI_NODE_PORT, f"MASTER_PORT (unset: {DEFAULT_MULTI_NODE_PORT}"
        given += ", the default of a multi-node job)"
    else:
        try:
            chosen = int(port)
        except ValueError:
            return None, f"MASTER_PORT={port} is not a port number; unset it (one node: a free " \
                         f"port is picked) or give a number from 1024 to 65535"
        if not 0 < chosen < 65536:
            return None, f"MASTER_PORT={port} is not a port number (1 to 65535)"
        given = f"MASTER_PORT={port}"
    if node_rank == 0 and is_local(master_addr) and port_taken(chosen):
        fix = "unset MASTER_PORT (one node: the launcher then picks a free port) or give a " \
            "free one" if nnodes == 1 else "set MASTER_PORT to a port free on every node"
        return None, (f"{given} is taken on {socket.gethostname()} by another process (another "
                      f"job's rendezvous?), so torchrun would fail with EADDRINUSE; {fix}, e.g. "
                      f"MASTER_PORT={free_port()} (free here now)")
    return chosen, None


# ------------------------------------------------------------------------------------ node

def visible_nvidia_gpus() -> List[str]:
    """The NVIDIA GPUs this node shows, whatever the Python environment can use: the ``GPU N:``
    lines of ``nvidia-smi -L`` when ``nvidia-smi`` is on ``PATH``, else ``/dev/nvidiaN``."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        return [ln.strip() for ln in out.splitlines() if ln.startswith("GPU ")]
    return sorted(p for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia"):].isdigit())


def torch_build() -> Optional[Dict[str, Optional[str]]]:
    """This interpreter's torch build (``__version__``, ``cuda``, ``hip``) read from its
    ``torch/version.py`` without importing torch (milliseconds, not seconds); None without
    torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    out: Dict[str, Optional[str]] = {"__version__": "?", "cuda": None, "hip": None}
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in out and \
                isinstance(node.value, ast.Constant):
            out[target.id] = node.value.value
    return out


def _hidden_by_env() -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` hides every GPU from the ranks."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1", "none", "NoDevFiles")


def node_problems(cpu: bool, slurm: bool, python: str) -> Tuple[str, List[str]]:
    """``(environment description, problems)`` of running the ranks here with ``python``."""
    build = torch_build()
    if build is None:
        return f"{python} (no torch)", [
            f"{python} has no torch: point PYTHON at the project's environment (make venv, "
            f"make venv-019) or install megatron-metp into this one"]
    version, gpu_build = build["__version__"], build["cuda"] or build["hip"]
    gpus = visible_nvidia_gpus() if build["cuda"] or not build["hip"] else \
        (["/dev/kfd"] if os.path.exists("/dev/kfd") else [])
    usable = 0 if not gpu_build or _hidden_by_env() else len(gpus)
    kind = f"CUDA {build['cuda']}" if build["cuda"] else f"ROCm {build['hip']}" if gpu_build \
        else "built without CUDA"
    env = f"{python} (torch {version}, {kind}" + (
        f", {usable} GPU{'s' if usable != 1 else ''} visible)" if gpu_build else ")")
    out: List[str] = []
    if slurm and not gpu_build and gpus:
        out.append(f"this Slurm node has {len(gpus)} NVIDIA GPU{'s' if len(gpus) > 1 else ''} "
                   f"but the ranks' environment {python} has torch {version}, built without "
                   f"CUDA (a CPU-only venv, e.g. one made on a login node), so the job would "
                   f"run on the CPU; point PYTHON at an environment with a CUDA build of torch "
                   f"on the shared file system, or run in the image (CONTAINER_IMAGE)")
    elif not cpu and usable == 0:
        why = "has a torch built without CUDA" if not gpu_build else \
            "sees no GPU (CUDA_VISIBLE_DEVICES hides them)" if _hidden_by_env() and gpus else \
            "sees no GPU on this node"
        out.append(f"GPU ranks (METP_CPU is not 1) but {python} {why} (torch {version}); set "
                   f"METP_CPU=1 to train on CPU ranks (gloo), or run on a GPU node with a "
                   f"CUDA build of torch (PYTHON)")
    return env, out


# --------------------------------------------------------------------------------- release

#: (flag, value or None for any) that Megatron-LM core_v0.19.0's parser has and core_v0.16.1's
#: has not, as YaRN needs them
_YARN_ONLY = ("--yarn-original-max-position-embeddings", "--yarn-beta-fast", "--yarn-beta-slow",
              "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int")


def _value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The last value given to ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``), or None."""
    got = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            got = argv[i + 1]
        elif a.startswith(flag + "="):
            got = a.split("=", 1)[1]
    return got


def release_problems(argv: Sequence[str], checkout: str = ".") -> List[str]:
    """Flags of ``argv`` that the Megatron-LM checkout ``checkout`` cannot parse because its
    release lacks them: ``--position-embedding-type yarn`` and the ``--yarn-*`` flags without
    core_v0.19.0's YaRN flags. Nothing when the checkout's ``arguments.py`` is not there."""
    path = os.path.join(checkout, "megatron", "training", "arguments.py")
    try:
        with open(path) as fh:
            if "--yarn-beta-fast" in fh.read():
                return []
    except OSError:
        return []
    used = [a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in _YARN_ONLY]
    if _value(argv, "--position-embedding-type") == "yarn":
        used.insert(0, "--position-embedding-type yarn")
    if not used:
        return []
    return [f"{', '.join(dict.fromkeys(used))}: YaRN needs Megatron-LM core_v0.19.0, and the "
            f"checkout {os.path.abspath(checkout)} has no --yarn-* flags (core_v0.16.1); point "
            f"MEGATRON_LM_DIR at a core_v0.19.0 checkout patched by scripts/apply_patches.sh "
            f"(its environment: make venv-019). Another position embedding (rope) would train a "
            f"different model, with positions a YaRN checkpoint was not trained on"]


# ------------------------------------------------------------------------------------ main

def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_metp.megatron_lm.launch_checks",
                                 description="The launcher's checks of this node (see the "
                                             "module's docstring).")
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("port", help="print the rendezvous port to use, or refuse a taken one")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", default="")
    n = sub.add_parser("node", help="print the ranks' environment, or refuse it")
    n.add_argument("--cpu", action="store_true", help="CPU ranks (METP_CPU=1)")
    opts = ap.parse_args(argv)
    if opts.what == "port":
        port, problem = choose_port(opts.master_port, opts.nnodes, opts.node_rank,
                                    opts.master_addr)
        if problem:
            print(f"pretrain_gpt.sh: error: {problem}; no rank was started", file=sys.stderr)
            return 1
        print(port)
        return 0
    env, problems = node_problems(opts.cpu, bool(os.environ.get("SLURM_JOB_ID")),
                                  sys.executable)
    for problem in problems:
        print(f"pretrain_gpt.sh: error: {problem}; no rank was started", file=sys.stderr)
    if problems:
        return 1
    print(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
