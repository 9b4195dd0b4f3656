"""What autograd keeps for backward, op by op, when the same forward runs on CPU and on CUDA.

A CPU measurement (``FakeTensorMode`` + ``MemTracker`` on a CPU-only torch) follows the CPU
kernels, and CPU kernels do not always save what the CUDA ones save: ``F.rms_norm`` is recorded
op by op on CPU (fp32 copies) but is one fused kernel on CUDA; ``native_layer_norm`` keeps its
mean/rstd in the input dtype on CPU and in fp32 on CUDA; CPU dropout keeps a mask in the input
dtype, CUDA a bool mask; and so on. This script measures each difference.

For every case one forward runs under ``FakeTensorMode`` (nothing is allocated) with a
``saved_tensors_hooks`` pair that records each tensor autograd saves (shape, dtype, and whether it
shares storage with an input, with the output, or is a new storage), and a dispatch mode that
follows every storage the forward allocates (for the forward peak and the temporaries).

* **CPU**: fake tensors on ``cpu``; the same case also runs on real CPU tensors (the probe shapes
  are tiny) as a check that the fake run records what eager CPU records.
* **CUDA**: fake tensors on ``cuda`` in a subprocess. A CPU-only torch aborts the process as soon
  as autograd records a node for a ``cuda`` tensor (it asks the device guard for the current
  stream and no CUDA guard is registered). The probe therefore compiles a 3-line C++ shim that
  registers c10's no-op ``FakeGuardImpl`` for CUDA (g++ and torch's headers; cached), and loads it
  with ``ctypes``. Two more shims make the CPU-only build pick what a CUDA build picks:

  - ``_fused_rms_norm`` has a CUDA kernel in a CUDA build, so its autograd formula is used there;
    a CPU-only build has none and falls back to the composite, op by op. The probe registers a
    placeholder CUDA kernel (never run: the fake mode answers first), so the dispatcher takes the
    autograd formula exactly as a CUDA build does (``--raw`` shows the unshimmed behaviour).
  - ``F.scaled_dot_product_attention`` chooses its CUDA backend with code that only a CUDA build
    contains (on a CPU-only build it falls back to MATH). The probe runs each CUDA backend op
    directly; the choice for ``F.scaled_dot_product_attention`` is torch's priority order
    (``torch._C._get_sdp_priority_order()``, flash first) and flash's eligibility (fp16/bf16,
    head dim <= 256, sm80+): source ``probe+rule``.

  The cuda worker runs the cases one after another and reports each before it starts the next;
  a case that kills the process is reported as crashed and the worker restarts on the remaining
  cases, so every case is isolated from the others' aborts.

Shapes: the probe uses tiny, pairwise distinct sizes (s=22, b=3, h=80, heads=5, d=16, f=56,
V=202) so that every dimension of every recorded tensor maps back to a symbol; bytes are then
evaluated at the target sizes (default s=4096, b=1, h=4096, heads=32, d=128, f=4h, V=131072) and
divided by the target's tokens (s·b). Tensors without a token dimension (weights, RNG state) are
"fixed" and left out of bytes/token.

    python benchmarks/saved_tensors.py [--json FILE] [--only SUBSTR] [--raw] [--target k=v,...]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import weakref

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "@@SAVED@@"
START = "@@START@@"

PROBE = dict(s=22, b=3, h=80, heads=5, d=16, f=56, V=202)
TARGET = dict(s=4096, b=1, h=4096, heads=32, d=128, f=16384, V=131072)

ITEMSIZE = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.float64": 8,
            "torch.bool": 1, "torch.int64": 8, "torch.uint64": 8, "torch.int32": 4,
            "torch.uint8": 1, "torch.int8": 1}
SHORT = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
         "torch.float64": "fp64", "torch.bool": "bool", "torch.int64": "i64",
         "torch.uint64": "u64", "torch.int32": "i32", "torch.uint8": "u8"}


# --------------------------------------------------------------------------- symbolic sizes

def _candidates(dims):
    """(expression, value) pairs for dimension sizes, simplest first."""
    out = [(k, v) for k, v in dims.items()]
    for (k1, v1), (k2, v2) in itertools.combinations(dims.items(), 2):
        out.append((f"{k1}·{k2}", v1 * v2))
    out += [(f"2{k}", 2 * v) for k, v in dims.items() if k in ("s", "f", "h")]
    out += [(f"{k}/2", v // 2) for k, v in dims.items() if k in ("d", "h", "f") and v % 2 == 0]
    for (k1, v1), (k2, v2), (k3, v3) in itertools.combinations(dims.items(), 3):
        out.append((f"{k1}·{k2}·{k3}", v1 * v2 * v3))
    out.append(("pad32(s)", -(-dims["s"] // 32) * 32))
    return out


def _eval(expr, dims):
    if expr.isdigit():
        return int(expr)
    if expr == "pad32(s)":
        return -(-dims["s"] // 32) * 32
    if expr.endswith("/2"):
        return dims[expr[:-2]] // 2
    if expr[0] == "2" and expr[1:] in dims:
        return 2 * dims[expr[1:]]
    v = 1
    for k in expr.split("·"):
        v *= dims[k]
    return v


def symbolize(shape, dims=PROBE):
    table = {}
    for e, v in _candidates(dims):
        table.setdefault(v, e)
    return [str(n) if n in (0, 1, 2) else table.get(n, str(n)) for n in shape]


def nbytes_at(sym, dtype, dims):
    n = ITEMSIZE.get(dtype, 4)
    for e in sym:
        n *= _eval(e, dims)
    return n


def _symbols(expr):
    e = expr.replace("pad32(s)", "s").removesuffix("/2")
    e = e[1:] if e[:1] == "2" and e[1:] in PROBE else e
    return [] if e.isdigit() else e.split("·")


def per_token(sym):
    """Whether a tensor of symbolic shape ``sym`` grows with the tokens (has an s or b dim)."""
    return any(k in ("s", "b") for e in sym for k in _symbols(e))


# --------------------------------------------------------------------------- CUDA shims

GUARD_SRC = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""


def build_cuda_guard():
    """Path of a shared library that registers a no-op CUDA device guard (built once, cached)."""
    import torch

    tdir = os.path.dirname(torch.__file__)
    key = hashlib.sha1((torch.__version__ + tdir + GUARD_SRC).encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"metp_cuda_fake_guard_{key}.so")
    if os.path.exists(path):
        return path
    src = path[:-3] + ".cpp"
    with open(src, "w") as f:
        f.write(GUARD_SRC)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O0", "-shared", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", os.path.join(tdir, "include"), src,
           "-o", path + ".tmp", "-L", os.path.join(tdir, "lib"), "-lc10",
           f"-Wl,-rpath,{os.path.join(tdir, 'lib')}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    os.replace(path + ".tmp", path)
    return path


_LIBS = []


def install_cuda_shims(raw=False):
    import torch

    ctypes.CDLL(build_cuda_guard(), mode=ctypes.RTLD_GLOBAL)
    if raw:
        return
    # A CUDA build has a CUDA kernel for _fused_rms_norm, so AutogradCUDA takes its derivative
    # formula; give the CPU-only build a placeholder so the dispatcher resolves the same way.
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA"):
        lib = torch.library.Library("aten", "IMPL")

        def _never(*a, **k):  # the fake mode answers before the backend key is reached
            raise RuntimeError("placeholder CUDA kernel of _fused_rms_norm ran")

        lib.impl("_fused_rms_norm", _never, "CUDA")
        _LIBS.append(lib)


# --------------------------------------------------------------------------- recorders

def _skey(t):
    return t.untyped_storage()._cdata


class Tracker:
    """Follows storages created during the forward: allocation/free events and their sizes."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.namespace != "prim":
                    tracker.ops.append(str(func.overloadpacket.__name__))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        tracker.see(t)
                return out

        self.mode = _Mode()
        self.ops, self.events, self.refs, self.info, self.known = [], [], {}, {}, set()

    def known_storage(self, t):
        self.known.add(_skey(t))

    def see(self, t):
        k = _skey(t)
        if k in self.known:
            return
        if k not in self.refs:  # a new storage (a freed one's address may come back)
            self.refs[k] = 0
            nb = t.untyped_storage().nbytes()
            full = t.numel() * t.element_size() == nb
            self.info[k] = (list(t.shape) if full else [nb // t.element_size()], str(t.dtype))
            self.events.append(("alloc", self.info[k]))
        self.refs[k] += 1
        weakref.finalize(t, self._drop, k)

    def _drop(self, k):
        self.refs[k] -= 1
        if self.refs[k] == 0:
            del self.refs[k]
            self.events.append(("free", self.info[k]))

    def profile(self, dims):
        """(peak bytes during the forward, bytes live at its end) at sizes ``dims``."""
        live = peak = 0
        for ev, (shape, dtype) in self.events:
            n = nbytes_at(symbolize(shape), dtype, dims)
            live += n if ev == "alloc" else -n
            peak = max(peak, live)
        return peak, live


def run_case(case, dev, fake=True):
    """One forward of ``case`` on ``dev``; returns the record (dict)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    saved = []
    with mode:
        inputs = CASES[case](dev, PROBE)
        run = inputs.pop("__run__")
        tr = Tracker()
        for t in inputs.values():
            if isinstance(t, torch.Tensor):
                tr.known_storage(t)

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tr.mode:
            out = run(**inputs)
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        gc.collect()
        in_keys = {_skey(t): n for n, t in inputs.items() if isinstance(t, torch.Tensor)}
        out_keys = {_skey(t) for t in outs}
        grad_fn = None
        for t in outs:
            if t.grad_fn is not None:
                grad_fn = t.grad_fn.name()
                break
        rec_saved, seen = [], {}
        for t in saved:
            k = _skey(t)
            if k in in_keys:
                rel = f"input {in_keys[k]}" + ("" if t.shape == inputs[in_keys[k]].shape
                                               else " (view)")
            elif k in out_keys:
                rel = "output"
            else:
                rel = "new"
            if k in tr.info:
                sshape, sdtype = tr.info[k]
            elif k in in_keys:
                sshape, sdtype = list(inputs[in_keys[k]].shape), str(inputs[in_keys[k]].dtype)
            else:
                sshape, sdtype = list(t.shape), str(t.dtype)
            rec_saved.append(dict(shape=list(t.shape), sym=symbolize(t.shape), dtype=str(t.dtype),
                                  rel=rel, storage=k, first=k not in seen,
                                  same_as=seen.get(k),
                                  storage_sym=symbolize(sshape), storage_dtype=sdtype))
            seen.setdefault(k, len(rec_saved))
        rec = dict(case=case, device=dev, fake=fake, grad_fn=grad_fn,
                   outputs=[dict(sym=symbolize(t.shape), dtype=str(t.dtype)) for t in outs],
                   saved=rec_saved, ops=list(dict.fromkeys(tr.ops)))
        peak, end = tr.profile(TARGET_DIMS)
        rec["fwd_peak_target"], rec["fwd_end_target"] = peak, end
    for r in rec["saved"]:
        r.pop("storage")
    return rec


TARGET_DIMS = dict(TARGET)


def summarize(rec, dims):
    """bytes/token at ``dims`` of what is saved: all distinct storages, and new ones only."""
    tokens = dims["s"] * dims["b"]
    tot = new = fixed = 0
    for r in rec["saved"]:
        if not r["first"]:
            continue
        n = nbytes_at(r["storage_sym"], r["storage_dtype"], dims)
        if not per_token(r["storage_sym"]):
            fixed += n
            continue
        tot += n
        if r["rel"] == "new":
            new += n
    temp = rec["fwd_peak_target"] - rec["fwd_end_target"]
    return dict(saved_per_token=tot / tokens, new_per_token=new / tokens, fixed_bytes=fixed,
                temp_per_token=max(temp, 0) / tokens)


# --------------------------------------------------------------------------- cases
# Each case: fn(dev, dims) -> dict of named inputs plus "__run__": a callable of those inputs.

CASES = {}
GROUP = {}
ONLY_ON = {}     # case -> "cpu" or "cuda" when it exists on one device only
NOTE = {}


def case(name, group, only=None, note=None):
    def deco(fn):
        CASES[name], GROUP[name] = fn, group
        if only:
            ONLY_ON[name] = only
        if note:
            NOTE[name] = note
        return fn
    return deco


def _t(shape, dev, dtype="bf16", grad=True):
    import torch

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return torch.randn(*shape, dtype=dt, device=dev).requires_grad_(grad)


def _megatron():
    """Megatron imports need a (fake) world and its parallel state; once per process."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
        try:
            import megatron_metp.megatron.cpu as mcpu

            mcpu.enable()
        except Exception:  # noqa: BLE001 - only torch.cuda.current_device matters here
            torch.cuda.current_device = lambda: torch.device("cpu")
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                     create_gloo_process_groups=False)


# norms ---------------------------------------------------------------------------------------

@case("F.rms_norm bf16 (bf16 weight)", "norm")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"], D["b"], D["h"]), dev), weight=_t((D["h"],), dev),
                __run__=lambda x, weight: F.rms_norm(x, (x.shape[-1],), weight, 1e-5))


@case("torch.nn.RMSNorm bf16", "norm")
def _(dev, D):
    import torch

    m = torch.nn.RMSNorm(D["h"], eps=1e-5, device=dev, dtype=torch.bfloat16)
    return dict(x=_t((D["s"], D["b"], D["h"]), dev), weight=m.weight,
                __run__=lambda x, weight: m(x))


@case("F.layer_norm bf16 (bf16 weight, bias)", "norm")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"], D["b"], D["h"]), dev), weight=_t((D["h"],), dev),
                bias=_t((D["h"],), dev),
                __run__=lambda x, weight, bias: F.layer_norm(x, (x.shape[-1],), weight, bias,
                                                             1e-5))


@case("F.layer_norm bf16 input, fp32 weight/bias (mixed)", "norm")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"], D["b"], D["h"]), dev), weight=_t((D["h"],), dev, "fp32"),
                bias=_t((D["h"],), dev, "fp32"),
                __run__=lambda x, weight, bias: F.layer_norm(x, (x.shape[-1],), weight, bias,
                                                             1e-5))


@case("torch.nn.LayerNorm bf16", "norm")
def _(dev, D):
    import torch

    m = torch.nn.LayerNorm(D["h"], eps=1e-5, device=dev, dtype=torch.bfloat16)
    return dict(x=_t((D["s"], D["b"], D["h"]), dev), weight=m.weight, bias=m.bias,
                __run__=lambda x, weight, bias: m(x))


# RoPE ----------------------------------------------------------------------------------------

def _freqs(dev, D):
    import torch

    return torch.randn(D["s"], 1, 1, D["d"], dtype=torch.float32, device=dev)


@case("Megatron RoPE unfused (_apply_rotary_pos_emb_bshd)", "rope")
def _(dev, D):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return dict(t=_t((D["s"], D["b"], D["heads"], D["d"]), dev), freqs=_freqs(dev, D),
                __run__=lambda t, freqs: _apply_rotary_pos_emb_bshd(t, freqs))


@case("megatron_metp.ops.rope.apply_rope", "rope")
def _(dev, D):
    sys.path.insert(0, REPO)
    from megatron_metp.ops.rope import apply_rope

    return dict(t=_t((D["s"], D["b"], D["heads"], D["d"]), dev), freqs=_freqs(dev, D),
                __run__=lambda t, freqs: apply_rope(t, freqs))


# softmax -------------------------------------------------------------------------------------

def _scores(dev, D, dtype="bf16"):
    return _t((D["b"], D["heads"], D["s"], D["s"]), dev, dtype)


@case("F.softmax bf16 (scores)", "softmax")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_scores(dev, D), __run__=lambda x: F.softmax(x, dim=-1))


@case("F.softmax fp32 (scores)", "softmax")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_scores(dev, D, "fp32"), __run__=lambda x: F.softmax(x, dim=-1))


def _fsms(dev, D, fp32):
    import torch
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    sm = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True,
                               attn_mask_type=AttnMaskType.causal,
                               scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
                               softmax_in_fp32=fp32, scale=None)
    s = D["s"]
    mask = torch.ones(s, s, dtype=torch.bool, device=dev).triu(1).view(1, 1, s, s)
    # a non-leaf input, as in DotProductAttention (the mask is applied in place)
    return dict(x=_scores(dev, D) * 1, mask=mask, __run__=lambda x, mask: sm(x, mask))


@case("Megatron FusedScaleMaskSoftmax torch path, softmax_in_fp32=True", "softmax")
def _(dev, D):
    return _fsms(dev, D, True)


@case("Megatron FusedScaleMaskSoftmax torch path, softmax_in_fp32=False", "softmax")
def _(dev, D):
    return _fsms(dev, D, False)


# attention -----------------------------------------------------------------------------------

def _qkv(dev, D):
    shape = (D["b"], D["heads"], D["s"], D["d"])
    return dict(q=_t(shape, dev), k=_t(shape, dev), v=_t(shape, dev))


@case("F.scaled_dot_product_attention causal bf16", "sdpa", only="cpu",
      note="CPU: _scaled_dot_product_flash_attention_for_cpu; on CUDA the same call runs the "
           "flash row below (probe+rule)")
def _(dev, D):
    import torch.nn.functional as F

    return dict(**_qkv(dev, D),
                __run__=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))


@case("aten._scaled_dot_product_flash_attention (CUDA flash) causal bf16", "sdpa", only="cuda",
      note="what F.scaled_dot_product_attention runs on CUDA for bf16/fp16, d<=256, sm80+")
def _(dev, D):
    import torch

    return dict(**_qkv(dev, D), __run__=lambda q, k, v: torch.ops.aten
                ._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0])


@case("F.scaled_dot_product_attention causal bf16 dropout 0.1", "sdpa", only="cpu",
      note="on CUDA the flash kernel takes dropout itself (next row)")
def _(dev, D):
    import torch.nn.functional as F

    return dict(**_qkv(dev, D), __run__=lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.1, is_causal=True))


@case("aten._scaled_dot_product_flash_attention (CUDA flash) causal bf16 dropout 0.1", "sdpa",
      only="cuda")
def _(dev, D):
    import torch

    return dict(**_qkv(dev, D), __run__=lambda q, k, v: torch.ops.aten
                ._scaled_dot_product_flash_attention(q, k, v, 0.1, True)[0])


@case("aten._scaled_dot_product_efficient_attention causal bf16", "sdpa", only="cuda")
def _(dev, D):
    import torch

    return dict(**_qkv(dev, D), __run__=lambda q, k, v: torch.ops.aten
                ._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0])


@case("aten._scaled_dot_product_cudnn_attention causal bf16", "sdpa", only="cuda")
def _(dev, D):
    import torch

    return dict(**_qkv(dev, D), __run__=lambda q, k, v: torch.ops.aten
                ._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[0])


@case("megatron_metp torch_flash kernel forward (out, lse)", "sdpa",
      note="no autograd inside (METP's Function saves out and lse itself); forward outputs only")
def _(dev, D):
    import torch

    sys.path.insert(0, REPO)
    from megatron_metp.ops.attention_kernels import TorchFlashKernel

    def run(q, k, v):
        with torch.no_grad():
            return TorchFlashKernel.forward(q, k, v, True, D["d"] ** -0.5)

    return dict(**_qkv(dev, D), __run__=run)


# activations ---------------------------------------------------------------------------------

@case("F.silu bf16", "activation")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"], D["b"], D["f"]), dev), __run__=lambda x: F.silu(x))


@case("F.gelu exact bf16", "activation")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"], D["b"], D["f"]), dev), __run__=lambda x: F.gelu(x))


@case("F.gelu tanh bf16", "activation")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"], D["b"], D["f"]), dev),
                __run__=lambda x: F.gelu(x, approximate="tanh"))


@case("SwiGLU (chunk, silu(a)*b) bf16", "activation")
def _(dev, D):
    import torch
    import torch.nn.functional as F

    def run(x):
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * b

    return dict(x=_t((D["s"], D["b"], 2 * D["f"]), dev), __run__=run)


# cross-entropy -------------------------------------------------------------------------------

def _targets(dev, D, shape):
    import torch

    return torch.randint(0, D["V"], shape, device=dev)


@case("F.cross_entropy bf16 logits", "cross_entropy")
def _(dev, D):
    import torch.nn.functional as F

    return dict(logits=_t((D["s"] * D["b"], D["V"]), dev),
                target=_targets(dev, D, (D["s"] * D["b"],)),
                __run__=lambda logits, target: F.cross_entropy(logits, target))


@case("F.cross_entropy fp32 logits", "cross_entropy")
def _(dev, D):
    import torch.nn.functional as F

    return dict(logits=_t((D["s"] * D["b"], D["V"]), dev, "fp32"),
                target=_targets(dev, D, (D["s"] * D["b"],)),
                __run__=lambda logits, target: F.cross_entropy(logits, target))


@case("Megatron vocab_parallel_cross_entropy bf16 logits (TP=1)", "cross_entropy")
def _(dev, D):
    _megatron()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return dict(logits=_t((D["s"], D["b"], D["V"]), dev),
                target=_targets(dev, D, (D["s"], D["b"])),
                __run__=lambda logits, target: vocab_parallel_cross_entropy(logits, target))


# dropout / embedding -------------------------------------------------------------------------

@case("F.dropout bf16 p=0.1 (training)", "dropout")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"], D["b"], D["h"]), dev),
                __run__=lambda x: F.dropout(x, 0.1, training=True))


@case("aten.native_dropout bf16 p=0.1", "dropout")
def _(dev, D):
    import torch

    return dict(x=_t((D["s"], D["b"], D["h"]), dev),
                __run__=lambda x: torch.ops.aten.native_dropout(x, 0.1, True))


@case("F.dropout bf16 p=0.1 on attention probs (b,heads,s,s)", "dropout")
def _(dev, D):
    import torch.nn.functional as F

    return dict(p=_scores(dev, D) * 1, __run__=lambda p: F.dropout(p, 0.1, training=True))


@case("F.embedding bf16 weight", "embedding")
def _(dev, D):
    import torch.nn.functional as F

    return dict(weight=_t((D["V"], D["h"]), dev), idx=_targets(dev, D, (D["s"], D["b"])),
                __run__=lambda weight, idx: F.embedding(idx, weight))


# matmul --------------------------------------------------------------------------------------

@case("F.linear bf16 (mm)", "matmul")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"], D["b"], D["h"]), dev), w=_t((D["f"], D["h"]), dev),
                __run__=lambda x, w: F.linear(x, w))


@case("F.linear bf16 + bias (addmm)", "matmul")
def _(dev, D):
    import torch.nn.functional as F

    return dict(x=_t((D["s"] * D["b"], D["h"]), dev), w=_t((D["f"], D["h"]), dev),
                bias=_t((D["f"],), dev), __run__=lambda x, w, bias: F.linear(x, w, bias))


@case("torch.baddbmm bf16 (Megatron QK^T, beta=0)", "matmul")
def _(dev, D):
    import torch

    bh, s, d = D["b"] * D["heads"], D["s"], D["d"]
    buf = torch.empty(bh, s, s, dtype=torch.bfloat16, device=dev)
    return dict(q=_t((bh, s, d), dev), k=_t((bh, s, d), dev), buf=buf,
                __run__=lambda q, k, buf: torch.baddbmm(buf, q, k.transpose(1, 2), beta=0.0,
                                                        alpha=d ** -0.5))


@case("torch.bmm bf16 (Megatron probs·V)", "matmul")
def _(dev, D):
    bh, s, d = D["b"] * D["heads"], D["s"], D["d"]
    return dict(p=_t((bh, s, s), dev), v=_t((bh, s, d), dev), __run__=lambda p, v: p.bmm(v))


@case("torch.mm bf16 out_dtype=fp32", "matmul",
      note="no derivative formula: autograd fails in backward; not usable for training")
def _(dev, D):
    import torch

    return dict(x=_t((D["s"] * D["b"], D["h"]), dev), w=_t((D["h"], D["f"]), dev),
                __run__=lambda x, w: torch.mm(x, w, out_dtype=torch.float32))


# --------------------------------------------------------------------------- worker

def worker(dev, names, raw, check_real):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    if dev == "cuda":
        install_cuda_shims(raw)
    for name in names:
        print(START + name, flush=True)
        t0 = time.perf_counter()
        real = None
        try:
            rec = run_case(name, dev, fake=True)
            if dev == "cpu" and check_real:
                try:
                    real = run_case(name, dev, fake=False)
                except Exception as e:  # noqa: BLE001 - eager CPU may lack a kernel
                    rec["real_error"] = f"{type(e).__name__}: {e}"[:200]
                    real = None
            if real is not None:
                sig = lambda r: [(s["sym"], s["dtype"], s["rel"]) for s in r["saved"]]  # noqa
                rec["real_matches_fake"] = sig(real) == sig(rec) and \
                    [o["dtype"] for o in real["outputs"]] == [o["dtype"] for o in rec["outputs"]]
                if not rec["real_matches_fake"]:
                    rec["real"] = real
        except Exception as e:  # noqa: BLE001 - report and go on
            rec = dict(case=name, device=dev, error=f"{type(e).__name__}: {e}".splitlines()[0],
                       trace=traceback.format_exc(limit=3))
        rec["raw"] = raw
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        print(TAG + json.dumps(rec), flush=True)


def _last_line(text):
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def run_worker(dev, names, raw=False, check_real=True, timeout=300):
    """Runs ``names`` on ``dev`` in subprocesses; a case that kills its process is reported as
    crashed and a fresh process takes the remaining ones."""
    results, todo = {}, list(names)
    while todo:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", dev, "--cases",
               json.dumps(todo)] + (["--raw"] if raw else []) + ([] if check_real else
                                                                 ["--no-real"])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = "timeout", -1
        current = None
        for line in out.splitlines():
            if line.startswith(START):
                current = line[len(START):]
            elif line.startswith(TAG):
                rec = json.loads(line[len(TAG):])
                results[rec["case"]] = rec
                current = None
        todo = [n for n in todo if n not in results]
        if current is not None:
            what = [ln.strip() for ln in err.splitlines() if "what()" in ln or "Error" in ln]
            results[current] = dict(case=current, device=dev, raw=raw, crashed=True, rc=rc,
                                    error=(what[0] if what else _last_line(err)))
            todo.remove(current)
        elif todo:  # died before starting anything
            for n in todo:
                results[n] = dict(case=n, device=dev, raw=raw, crashed=True, rc=rc,
                                  error=_last_line(err))
            todo = []
    return results


# --------------------------------------------------------------------------- report

def _fmt_list(saved):
    parts = []
    for i, s in enumerate(saved, 1):
        dt = SHORT.get(s["dtype"], s["dtype"])
        rel = {"new": "", "output": " =out"}.get(s["rel"], " =" + s["rel"].replace("input ", ""))
        same = "" if s.get("same_as") is None or s["rel"] != "new" else f" ≡#{s['same_as']}"
        parts.append(f"#{i} ({','.join(s['sym'])}) {dt}{rel}{same}")
    return "; ".join(parts) if parts else "nothing"


def fmt_saved(rec):
    if rec is None:
        return "—"
    if rec.get("error"):
        msg = " ".join(rec["error"].split()).replace("|", "/")[:80]
        return ("crashed: " if rec.get("crashed") else "error: ") + msg
    text = _fmt_list(rec["saved"])
    if rec.get("real_error"):
        text = f"fake: {text} — eager CPU: {rec['real_error'][:60]}"
    if rec.get("real"):  # eager CPU recorded something else than the fake CPU run
        text = f"fake: {text} — **eager CPU: {_fmt_list(rec['real']['saved'])}**"
    return text


def fmt_out(rec):
    if rec is None or rec.get("error"):
        return ""
    return ", ".join(f"({','.join(o['sym'])}) {SHORT.get(o['dtype'], o['dtype'])}"
                     for o in rec["outputs"])


def fmt_bytes(rec, dims):
    if rec is None or rec.get("error"):
        return "—"
    if rec.get("real"):
        fake, eager = fmt_bytes(dict(rec, real=None), dims), fmt_bytes(rec["real"], dims)
        return f"fake {fake} / **eager {eager}**"
    s = summarize(rec, dims)

    def b(x):
        return f"{x:.0f}" if x == int(x) else f"{x:.1f}"

    fixed = f"; fixed {s['fixed_bytes']} B" if s["fixed_bytes"] else ""
    return (f"{b(s['saved_per_token'])} (new {b(s['new_per_token'])}; fwd temp "
            f"{b(s['temp_per_token'])}{fixed})")


def differs(a, b):
    """"yes", "fixed only" (only token-independent saved tensors differ) or "no"."""
    if a is None or b is None or a.get("error") or b.get("error"):
        return None

    def sig(r, tok):
        return ([(s["sym"], s["dtype"], s["rel"]) for s in r["saved"]
                 if per_token(s["sym"]) == tok],
                [(o["sym"], o["dtype"]) for o in r["outputs"]] if tok else [])

    if sig(a, True) != sig(b, True):
        return "**yes**"
    return "fixed only" if sig(a, False) != sig(b, False) else "no"


# What torch's derivative formulas keep on CUDA, for when the cuda probe cannot run here (no C++
# compiler for the guard shim, or a crash): the saved arguments of each op's backward formula.
STATIC_CUDA = {
    "F.rms_norm bf16 (bf16 weight)": "x (input); weight; rstd (s,b,1) fp32 [_fused_rms_norm]",
    "torch.nn.RMSNorm bf16": "x (input); weight; rstd (s,b,1) fp32 [_fused_rms_norm]",
    "F.layer_norm bf16 (bf16 weight, bias)": "x; weight; bias; mean, rstd (s,b,1) fp32",
    "torch.nn.LayerNorm bf16": "x; weight; bias; mean, rstd (s,b,1) fp32",
    "F.dropout bf16 p=0.1 (training)": "mask (s,b,h) bool [native_dropout]",
    "F.scaled_dot_product_attention causal bf16":
        "q; k; v; out; logsumexp (b,heads,s) fp32; rng_state (2) u64; unused () u64 [flash]",
}


def table(res, dims):
    rows = ["| op | CPU saves | CUDA saves | saved B/token CPU | CUDA | output dtype CPU → CUDA |"
            " differs | source |", "|" + "---|" * 8]
    cpu, cuda = res["cpu"], res["cuda"]
    flash = "aten._scaled_dot_product_flash_attention (CUDA flash) causal bf16"
    for name in CASES:
        a, b = cpu.get(name), cuda.get(name)
        src = "probe"
        if name.startswith("F.scaled_dot_product_attention causal bf16"):
            b, src = cuda.get(flash + name[len("F.scaled_dot_product_attention causal bf16"):]), \
                "probe+rule"
        elif name.startswith("F.rms_norm") or name.startswith("torch.nn.RMSNorm"):
            src = "probe+shim"
        if a is None and b is None:
            continue
        d = differs(a, b)
        cuda_text = fmt_saved(b)
        if b is not None and b.get("error"):
            src = "derivatives (cuda probe failed)"
            cuda_text = STATIC_CUDA.get(name, cuda_text)
        rows.append(f"| {name} | {fmt_saved(a)} | {cuda_text} | {fmt_bytes(a, dims)} | "
                    f"{fmt_bytes(b, dims)} | {fmt_out(a) or '—'} → {fmt_out(b) or '—'} | "
                    f"{d or '—'} | {src} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all records to this file")
    ap.add_argument("--only", help="cases whose name contains this substring")
    ap.add_argument("--raw", action="store_true",
                    help="also run the cuda cases without the _fused_rms_norm placeholder")
    ap.add_argument("--no-real", action="store_true", help="skip the real-CPU cross-check")
    ap.add_argument("--target", default="",
                    help="sizes for bytes/token, e.g. s=4096,b=1,h=4096,heads=32,d=128,f=16384,"
                         "V=131072")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for kv in filter(None, a.target.split(",")):
        k, v = kv.split("=")
        TARGET_DIMS[k.strip()] = int(v)
    if a.worker:
        worker(a.worker, json.loads(a.cases), a.raw, not a.no_real)
        return 0
    names = [n for n in CASES if not a.only or a.only.lower() in n.lower()]
    t0 = time.perf_counter()
    res = {"cpu": run_worker("cpu", [n for n in names if ONLY_ON.get(n, "cpu") == "cpu"],
                             check_real=not a.no_real, timeout=a.timeout),
           "cuda": run_worker("cuda", [n for n in names if ONLY_ON.get(n, "cuda") == "cuda"],
                              timeout=a.timeout)}
    if a.raw:
        res["cuda_raw"] = run_worker("cuda", [n for n in names if "rms" in n.lower()], raw=True,
                                     timeout=a.timeout)
    for r in res["cpu"].values():
        if r.get("real_matches_fake") is False:
            print(f"warning: real CPU and fake CPU disagree for {r['case']}", file=sys.stderr)
    print(f"probe sizes {PROBE}; bytes at {TARGET_DIMS} per token (s·b); 'new' = storages the "
          "op allocated (not an input or the output); 'fwd temp' = forward peak minus what is "
          "live at its end\n")
    print(table(res, TARGET_DIMS))
    if a.raw:
        print("\nCUDA without the _fused_rms_norm placeholder (what a CPU-only build does):")
        for n, r in res["cuda_raw"].items():
            print(f"- {n}: {fmt_saved(r)} [{r.get('grad_fn')}]")
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    if a.json:
        for dev in res.values():
            for r in dev.values():
                if not r.get("error"):
                    r["summary"] = summarize(r, TARGET_DIMS)
        with open(a.json, "w") as f:
            json.dump(dict(probe=PROBE, target=TARGET_DIMS, notes=NOTE, results=res), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
