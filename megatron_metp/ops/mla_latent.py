"""Multi-latent attention's per-head-group pieces: the latent a ring step carries, the head
group's K and V up-projected from it, and the transpose of that up-projection.

Names (one head group of ``H = A/p`` heads; ``A`` heads in all): ``kvr = kv_lora_rank``,
``dn = qk_head_dim`` (the heads' non-rotated query/key channels), ``dr = qk_pos_emb_head_dim``
(the rotated channels, one key shared by every head), ``dv = v_head_dim``; ``C = kvr + dr``.

The latent of ``m`` tokens ``L [m, b, C] = [c ‖ k_pe]``: ``c`` the kv latent after its RMSNorm,
``k_pe`` the shared RoPE key after its rotation (:mod:`.mla_rope`). With the head group's slice
of ``linear_kv_up_proj`` ``W_kv [H·(dn+dv), kvr]`` (per head: ``dn`` key rows, then ``dv`` value
rows, Megatron's layout)::

    [k_nope_h | v_h] = c·W_kv,hᵀ            k_h = [k_nope_h | k_pe],   v_h       (every head h)

and, for the gradients ``dk_h [m, dn+dr]``, ``dv_h [m, dv]`` of the block's keys and values::

    dW_kv,h += [dk_nope_h | dv_h]ᵀ·c          dc = Σ_h [dk_nope_h | dv_h]·W_kv,h
    dk_pe = Σ_h dk_h[:, dn:]                  dL = [dc ‖ dk_pe]   ([m, b, C], fp32)

Kernels that need equal query/key and value head dims (the flash ones) get ``v`` zero-padded to
``dn+dr`` channels (``pad``): the padded output channels are zero and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MLAGeometry:
    """Head and channel counts of one multi-latent attention (module docstring's names);
    ``blocks``: head-group blocks the outer loop runs (``p/kb``, ``kb`` head groups each; ``p``
    with one head group per block), ``heads_local = A/blocks`` the heads of one block (``H``),
    ``q_in`` the query input's width (``q_lora_rank``, or the hidden size without a query
    latent), ``pad``: ``v`` zero-padded to ``dn+dr``."""

    heads: int
    blocks: int
    kvr: int
    dn: int
    dr: int
    dv: int
    q_in: int
    pad: bool = False

    @property
    def heads_local(self) -> int:
        return self.heads // self.blocks

    @property
    def dq(self) -> int:
        """Channels of a query/key head: ``dn + dr``."""
        return self.dn + self.dr

    @property
    def latent(self) -> int:
        """``C = kvr + dr``: values per token a K/V ring step carries."""
        return self.kvr + self.dr

    @property
    def dv_kernel(self) -> int:
        """The value head dim the attention kernel sees (``dn + dr`` with ``pad``)."""
        return self.dq if self.pad else self.dv


def expand_latent(lat: torch.Tensor, wkv: torch.Tensor, geo: MLAGeometry):
    """``L [m, b, C]`` (any strides) and ``W_kv [H·(dn+dv), kvr]`` → heads-first
    ``k [b, H, m, dn+dr]``, ``v [b, H, m, dv_kernel]`` in ``L``'s dtype."""
    m, b = lat.shape[:2]
    H, dn, dv = geo.heads_local, geo.dn, geo.dv
    kv = torch.mm(lat[..., :geo.kvr].reshape(m * b, geo.kvr), wkv.t()).view(m, b, H, dn + dv)
    k = lat.new_empty(b, H, m, geo.dq)
    k[..., :dn] = kv[..., :dn].permute(1, 2, 0, 3)
    k[..., dn:] = lat[..., geo.kvr:].permute(1, 0, 2).unsqueeze(1)
    if geo.pad:
        v = lat.new_zeros(b, H, m, geo.dq)
        v[..., :dv] = kv[..., dn:].permute(1, 2, 0, 3)
    else:
        v = kv[..., dn:].permute(1, 2, 0, 3).contiguous()
    return k, v


def latent_grads(dk: torch.Tensor, dv: torch.Tensor, lat: torch.Tensor, wkv: torch.Tensor,
                 dwkv: torch.Tensor, geo: MLAGeometry) -> torch.Tensor:
    """The transpose of :func:`expand_latent` for one block: heads-first ``dk [b, H, m, dn+dr]``
    and ``dv [b, H, m, dv_kernel]`` (fp32) → ``dL [m, b, C]`` (fp32); ``dW_kv``'s contribution
    of this block is added into ``dwkv [H·(dn+dv), kvr]`` (fp32) in place."""
    b, H, m = dk.shape[:3]
    dn = geo.dn
    dkv = torch.cat((dk[..., :dn], dv[..., :geo.dv]), dim=-1).permute(2, 0, 1, 3)
    dkv = dkv.reshape(m * b, H * (dn + geo.dv))
    c = lat[..., :geo.kvr].reshape(m * b, geo.kvr).to(dkv.dtype)
    dwkv.addmm_(dkv.t(), c)
    out = torch.empty(m, b, geo.latent, dtype=dkv.dtype, device=dkv.device)
    out[..., :geo.kvr] = torch.mm(dkv, wkv.to(dkv.dtype)).view(m, b, geo.kvr)
    out[..., geo.kvr:] = dk[..., dn:].sum(1).permute(1, 0, 2)
    return out
