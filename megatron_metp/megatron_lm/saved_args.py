"""Every plain field of the ``args`` a Megatron-LM ``torch_dist`` checkpoint was saved with, read
without running any code from the checkpoint.

Megatron-LM keeps its ``argparse.Namespace`` in the checkpoint's common state (``common.pt`` in
core_v0.16.1, a byte object of rank 0's shard in core_v0.19.0: located by
:func:`megatron_metp.megatron_lm.resume.common_state_file`), a ``torch.save`` zip whose ``data.pkl``
is a pickle. :func:`read_saved_args` unpickles it with an unpickler that resolves *no* global:
every class or function the pickle names (``argparse.Namespace``, megatron enums, torch's tensor
rebuild functions) becomes an inert :class:`_Opaque` record of its arguments and state, tensor
storages are not read, and a ``torch.<dtype>`` becomes the string ``"torch.<dtype>"``. The
``Namespace``'s attribute dict is then the first ``_Opaque`` state holding ``num_layers`` and
``hidden_size``; the fields kept are those whose values are ``None``, booleans, numbers,
strings, or lists / tuples of them.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Optional

__all__ = ["read_saved_args"]

_PLAIN = (type(None), bool, int, float, str)


class _Opaque:
    """Stands for any global a pickle names: records what it was built from, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.args, self.state = args, None

    def __call__(self, *args, **kwargs):  # a global used as a function (REDUCE)
        return _Opaque(*args)

    def __setstate__(self, state):  # BUILD
        self.state = state


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch" and name[:1].islower() and "." not in name:
            return f"torch.{name}"  # a dtype (torch.float32 pickles as a global)
        return _Opaque

    def persistent_load(self, pid):  # torch.save's tensor storages: not read
        return None


def _plain(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(isinstance(x, _PLAIN) for x in v)
    return isinstance(v, _PLAIN)


def _find_args(obj, depth: int = 0) -> Optional[dict]:
    """The attribute dict of the saved ``Namespace`` inside the unpickled common state."""
    if depth > 6:
        return None
    if isinstance(obj, _Opaque):
        state = getattr(obj, "state", None)  # None: built by NEWOBJ, never BUILD
        if isinstance(state, dict) and "num_layers" in state and "hidden_size" in state:
            return state
        return _find_args(state, depth + 1)
    if isinstance(obj, dict):
        if isinstance(obj.get("args"), _Opaque):
            found = _find_args(obj["args"], depth + 1)
            if found is not None:
                return found
        values = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    else:
        return None
    for v in values:
        found = _find_args(v, depth + 1)
        if found is not None:
            return found
    return None


def read_saved_args(iteration_dir: str) -> Optional[dict]:
    """The plain fields of the Megatron-LM ``args`` saved in ``iteration_dir`` (a checkpoint's
    ``iter_NNNNNNN`` or ``release`` directory), e.g. ``{"num_layers": 2, "normalization":
    "RMSNorm", "window_size": None, ...}``; ``None`` when the directory holds no saved args (a
    checkpoint written by ``megatron_metp.tools.hf import``, or an unreadable one)."""
    from .resume import common_state_file

    source = common_state_file(iteration_dir)
    if source is None:
        return None
    try:
        with zipfile.ZipFile(source) as zf:
            name = next((n for n in zf.namelist() if n.endswith("/data.pkl")), None)
            if name is None:
                return None
            data = zf.read(name)
        common = _InertUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - not a torch.save zip, or a damaged pickle
        return None
    found = _find_args(common)
    if found is None:
        return None
    return {k: (list(v) if isinstance(v, list) else v) for k, v in found.items()
            if isinstance(k, str) and _plain(v)}
