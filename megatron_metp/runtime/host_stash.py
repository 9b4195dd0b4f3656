"""Row-addressable stashes: ``[rows, width]`` tensors an op parks now and reads back tile by tile.

The streaming METP layer (:mod:`megatron_metp.ops.layer`) keeps a layer's input, every head
group's attention output and every head group's ``d(qkv)`` between the phases of its backward
without holding any of them whole on the device: it writes them row range by row range and reads
back the row ranges (tiles of tokens) it works on. :class:`Stash` is such a tensor, either

* on the **host** (pinned memory on CUDA; copies on a side stream ordered after the compute
  stream, so a write overlaps the compute that follows it, and a read's copy overlaps whatever
  the compute stream runs before it needs the rows, if :meth:`Stash.prefetch` asked early); or
* on the **device** (a plain tensor: reads are views, writes are copies), where no host memory
  is to be used (no ``--metp-offload-activations``).

On the CPU the host copy is a separate tensor and every write and read is a real copy, so results
are exact and the code path is the GPU's. Under ``FakeTensorMode`` (the fake-rank memory
instruments) a host stash allocates nothing on the host: its bytes are counted (in the
offloader's statistics when one is given: :meth:`ActivationOffloader.count_host`), and each read
allocates the tile on the device, so the tracker sees exactly the device side.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


#: how many chunks ahead a pass over a stash starts its host copies (the streaming layer's
#: readers, :class:`~megatron_metp.ops.layer_attention.Rows`): two, so that a chunk whose
#: compute is short (a projection of ``x`` to one head group's columns) does not leave the copy
#: engine idle while the next read waits
PREFETCH_DEPTH = 2

_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE_STREAMS.get(idx)
    if s is None:
        s = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return s


class Stash:
    """A ``[rows, width]`` tensor of ``dtype`` for ``device``'s computation, kept on the host
    (``host=True``) or on the device. ``offloader``: an
    :class:`~megatron_metp.runtime.offload.ActivationOffloader` whose statistics count the host
    bytes (taken at creation, given back by :meth:`release`). ``like``: a tensor of the
    computation (its device; a fake tensor makes the stash count only)."""

    def __init__(self, rows: int, width: int, like: torch.Tensor, *, host: bool,
                 dtype: Optional[torch.dtype] = None, offloader=None):
        self.rows, self.width = int(rows), int(width)
        self.dtype = dtype or like.dtype
        self.device = like.device
        self.host = bool(host)
        self.fake = _is_fake(like)
        self.nbytes = self.rows * self.width * torch.empty((), dtype=self.dtype).element_size()
        self._offloader = offloader if self.host else None
        self._cuda = self.device.type == "cuda" and not self.fake
        self._data: Optional[torch.Tensor] = None
        self._ready: Dict[Tuple[int, int], Tuple[torch.Tensor, object]] = {}
        if not self.host:
            self._data = torch.empty(self.rows, self.width, dtype=self.dtype, device=self.device)
        elif not self.fake:
            self._data = torch.empty(self.rows, self.width, dtype=self.dtype,
                                     pin_memory=self._cuda)
        if self._offloader is not None:
            self._offloader.count_host(self.nbytes)
        self._released = False

    @classmethod
    def wrap(cls, t: torch.Tensor) -> "Stash":
        """A device stash over the existing ``[rows, width]`` tensor ``t`` (no copy: reads are
        its views)."""
        self = cls.__new__(cls)
        t = t.detach()
        self.rows, self.width = t.shape
        self.dtype, self.device, self.host, self.fake = t.dtype, t.device, False, _is_fake(t)
        self.nbytes = t.numel() * t.element_size()
        self._offloader, self._cuda, self._data, self._ready = None, False, t, {}
        self._released = False
        return self

    # ------------------------------------------------------------------ writes

    def write(self, rows: slice, t: torch.Tensor) -> None:
        """Rows ``rows`` ← ``t`` (``[len(rows), width]``, any dtype castable; the device side
        may be freed or overwritten by the caller once :meth:`fence` returns)."""
        self._check_live()
        t = t.reshape(-1, self.width)
        if self._data is None:  # fake host: nothing is kept
            return
        dst = self._data[rows]
        if self.host and self._cuda:
            side = _side_stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                dst.copy_(t, non_blocking=True)
            t.record_stream(side)
        else:
            dst.copy_(t)
        self._ready.pop((rows.start, rows.stop), None)

    def fence(self) -> None:
        """Make the compute stream wait for every write issued so far (before it overwrites or
        frees what was written from)."""
        if self.host and self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(_side_stream(self.device))

    # ------------------------------------------------------------------ reads

    def prefetch(self, rows: slice) -> None:
        """Start copying rows ``rows`` to the device (a later :meth:`read` of the same rows
        takes them, so the copy overlaps what the compute stream runs in between); nothing to
        do for a device stash or on the CPU. Under fake tensors the tile is allocated now, as
        on a GPU."""
        if not self.host or not (self._cuda or self._data is None):
            return
        key = (rows.start, rows.stop)
        if key in self._ready:
            return
        if self._data is None:  # fake: the device tile exists from now on
            self._ready[key] = (torch.empty(rows.stop - rows.start, self.width,
                                            dtype=self.dtype, device=self.device), None)
            return
        side = _side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            dev = torch.empty(rows.stop - rows.start, self.width, dtype=self.dtype,
                              device=self.device)
            dev.copy_(self._data[rows], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        dev.record_stream(torch.cuda.current_stream(self.device))
        self._ready[key] = (dev, ev)

    def read(self, rows: slice) -> torch.Tensor:
        """Rows ``rows`` on the device, ``[len(rows), width]`` (a view for a device stash: do
        not write into it)."""
        self._check_live()
        n = rows.stop - rows.start
        if not self.host:
            return self._data[rows]
        if self._data is None:  # fake host stash: the tile is allocated on the device
            got = self._ready.pop((rows.start, rows.stop), None)
            return got[0] if got is not None else \
                torch.empty(n, self.width, dtype=self.dtype, device=self.device)
        if self._cuda:
            self.prefetch(rows)
            dev, ev = self._ready.pop((rows.start, rows.stop))
            torch.cuda.current_stream(self.device).wait_event(ev)
            return dev
        return self._data[rows].to(self.device, copy=True)

    # ------------------------------------------------------------------ lifetime

    def release(self) -> None:
        """Give the memory back (host bytes out of the offloader's count)."""
        if self._released:
            return
        self._released = True
        if self._offloader is not None:
            self._offloader.release_host(self.nbytes)
        self._data = None
        self._ready.clear()

    def _check_live(self):
        if self._released:
            raise RuntimeError("this stash was released")

    def __del__(self):  # pragma: no cover - a safety net for the host count
        try:
            self.release()
        except Exception:  # noqa: BLE001
            pass
