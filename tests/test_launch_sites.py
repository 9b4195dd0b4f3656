"""``benchmarks/launches.py --by-site``: every launch and every elementwise byte of a layer is
charged to the source line that issued it (the METP ops' own lines for METP), and the charges add
up to the counter's totals; negative control: without ``sites`` nothing is charged."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

TINY = dict(hidden=64, heads=8, ffn=128)


def test_sites_add_up_to_the_totals():
    import launches

    r = launches.per_layer("metp", 256, 4, sites=True, **TINY)
    assert sum(r["by_site"].values()) == r["launches"] > 0
    assert sum(r["bytes_by_site"].values()) == r["elementwise_bytes"] > 0
    assert any(k.startswith("add_ @ ops/ring_attention.py:") for k in r["by_site"])  # dK/dV sums
    assert any(k.startswith("_scaled_dot_product_flash_attention @ ops/attention_kernels.py:")
               for k in r["by_site"])
    assert any(k.startswith("fused_swiglu @ ops/activations.py:") for k in r["by_site"])
    plain = launches.per_layer("metp", 256, 4, **TINY)
    assert "by_site" not in plain and plain["launches"] == r["launches"]
