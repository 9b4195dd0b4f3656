"""What the weight checks of ``hf import`` cost (docs/huggingface.md, "Weights checked on the way
in"): a random Llama-shaped ``model.safetensors`` of each size and dtype is written to a
temporary folder and read (page-cached, best of 5) as the import read it before the checks
(``safetensors.torch.load_file`` + a copy of every tensor) and as it reads it now
(:func:`megatron_metp.tools.hf.weights_check.read_checked_safetensors` + the same copy).

    OMP_NUM_THREADS=1 python scripts/hf_weights_check_cost.py
"""

import json
import os
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from megatron_metp.tools.hf.config import geometry_from_hf
from megatron_metp.tools.hf.layout import hf_names
from megatron_metp.tools.hf.weights_check import (_nonfinite, check_headers,
                                                  read_checked_safetensors)

BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
CASES = {
    "tiny": dict(BASE, vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32),
    "moderate": dict(BASE, vocab_size=16000, hidden_size=1024, intermediate_size=2816,
                     num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                     max_position_embeddings=2048),
}


def best(f, n=5):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    with tempfile.TemporaryDirectory() as root:
        for name, cfg in CASES.items():
            for dtype in ("float32", "bfloat16"):
                d = os.path.join(root, f"{name}-{dtype}")
                os.makedirs(d)
                cfg2 = dict(cfg, torch_dtype=dtype)
                with open(os.path.join(d, "config.json"), "w") as f:
                    json.dump(cfg2, f)
                g = geometry_from_hf(cfg2)
                torch.manual_seed(0)
                path = os.path.join(d, "model.safetensors")
                save_file({k: torch.randn(s).to(getattr(torch, dtype))
                           for k, s in hf_names(g).items()}, path)
                size = os.path.getsize(path)
                before = best(lambda: [v.clone() for v in load_file(path).values()])
                now = best(lambda: [v.clone() for v in
                                    read_checked_safetensors(d, g, cfg2).values()])
                headers = best(lambda: check_headers(d, g, cfg2))
                values = best(lambda: [_nonfinite(k, v) for k, v in load_file(path).items()])
                print(f"{name:8s} {dtype:8s} {size / 1e6:8.3f} MB: read {before * 1e3:7.1f} ms "
                      f"before, {now * 1e3:7.1f} ms checked (+{(now - before) * 1e3:.1f} ms); "
                      f"header/index/name checks {headers * 1e3:.2f} ms, value check "
                      f"{values * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
