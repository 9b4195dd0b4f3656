"""Host offload without prefetch (``METP_OFFLOAD_PREFETCH=0`` / ``prefetch=False``): exact, no
group brought back ahead of its backward, one layer group on the device at a time (fake
tensors); the environment variable is validated."""

import pytest
import torch

from megatron_metp.runtime import offload as O
from tests.test_offload import Block, _run


def test_no_prefetch_is_exact_and_brings_groups_back_on_demand(monkeypatch):
    torch.manual_seed(0)
    block = Block(3, 16)
    x = torch.randn(64, 16)
    ref = _run(block, x)
    monkeypatch.setenv(O.PREFETCH_ENV, "0")
    off = O.ActivationOffloader(min_bytes=0).attach(block)
    assert off.prefetch is False
    got = _run(block, x, off)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    st = off.stats
    assert st.offloaded_bytes == st.fetched_bytes > 0 and st.host_bytes == 0
    assert st.prefetched_groups == 0
    # negative control: with prefetch the same run brings groups back ahead of time
    other = Block(3, 16)
    on = O.ActivationOffloader(min_bytes=0, prefetch=True).attach(other)
    _run(other, x, on)
    assert on.stats.prefetched_groups >= 2


def test_prefetch_env_is_validated(monkeypatch):
    monkeypatch.setenv(O.PREFETCH_ENV, "maybe")
    with pytest.raises(ValueError, match="METP_OFFLOAD_PREFETCH must be 0 or 1"):
        O.ActivationOffloader()
    monkeypatch.setenv(O.PREFETCH_ENV, "1")
    assert O.ActivationOffloader().prefetch is True
