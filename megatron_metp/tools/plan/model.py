"""The job being planned: the model geometry (:class:`Model`, :data:`PRESETS`), the parallel
sizes and training choices (:class:`Job`), how each mode lays them out on the ``W = tp·metp`` GPUs
of a pipeline stage (:class:`Layout`, :func:`layout`), Megatron's vocabulary padding and the
checks that name the flag of a size that cannot be laid out (:func:`.job_checks.validate`);
with the byte sizes and the mode names every other module uses."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence, Tuple


GiB = 2 ** 30
MiB = 2 ** 20
BF16, FP32 = 2, 4
MODES = ("tp", "tp-sp", "cp", "ring", "metp", "metp+vocab")
MODE_NAMES = {
    "tp": "stock TP",
    "tp-sp": "TP+SP",
    "cp": "context parallel (ring) + TP",
    "ring": "ring self-attention",
    "metp": "METP",
    "metp+vocab": "METP + vocabulary split",
    "alst": "ALST (Ulysses + ZeRO-3, published recipe)",
}
#: modes planned on request only (``--modes``), not by default: the peers' recipes
PEER_MODES = ("alst",)
#: the modes that the METP vocabulary split applies to (``--vocab-parallel``)
VOCAB_MODES = ("metp", "metp+vocab")
#: ``Job.keep_attention_output`` of ``metp plan --keep-attention-output`` without N: as many
#: layers per stage as the host and the device hold (:func:`.partial.resolve_keep`)
KEEP_AUTO = -1


@dataclass(frozen=True)
class Model:
    """Transformer geometry (GPT: LayerNorm, RoPE, no biases, GeLU unless ``swiglu``)."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    query_groups: Optional[int] = None
    swiglu: bool = False
    tied: bool = True
    name: str = "custom"
    kv_channels: Optional[int] = None  # head width (--kv-channels); None: hidden / heads
    qk_layernorm: bool = False         # per-head q/k norms (--qk-layernorm, Qwen3)
    add_qkv_bias: bool = False         # bias on q, k, v only (--add-qkv-bias, Qwen2.5)
    experts: int = 0                   # routed experts per MoE layer (--num-experts; 0: dense)
    topk: int = 0                      # experts per token (--moe-router-topk)
    moe_ffn: Optional[int] = None      # one expert's FFN (--moe-ffn-hidden-size; None: ffn)
    moe_layer_freq: int = 1            # --moe-layer-freq N: layers 0, N, 2N, ... are MoE
    moe_first_dense: int = 0           # the first N layers dense (--moe-layer-freq
    #                                    ([0]*N+[1]*(L-N)): GLM's first_k_dense_replace)
    moe_shared_ffn: int = 0            # shared expert (--moe-shared-expert-intermediate-size)
    # what metp measure builds (so that it builds the model training builds); the plan's own
    # arithmetic keeps LayerNorm without linear biases (see the presets' note below)
    normalization: str = "LayerNorm"   # --normalization LayerNorm | RMSNorm
    bias: bool = False                 # linear biases (Megatron's default; --disable-bias-linear)
    # multi-latent attention (DeepSeek; --multi-latent-attention when kv_lora_rank > 0; .mla)
    kv_lora_rank: int = 0              # --kv-lora-rank (0: no MLA)
    q_lora_rank: Optional[int] = None  # --q-lora-rank (None: q projected from the hidden state)
    qk_head_dim: int = 128             # --qk-head-dim: non-rotated q/k channels per head
    qk_pos_emb_head_dim: int = 64      # --qk-pos-emb-head-dim: rotated ones (one shared key)
    v_head_dim: int = 128              # --v-head-dim

    @property
    def moe(self) -> bool:
        """A Mixture-of-Experts model (:mod:`.moe`)."""
        return self.experts > 0

    @property
    def mla(self) -> bool:
        """Multi-latent attention (:mod:`.mla`)."""
        return self.kv_lora_rank > 0

    @property
    def groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    def with_seq(self, seq: int) -> "Model":
        return replace(self, seq=int(seq))


#: The repo's model geometries (``configs/models/*.sh``): gpt-1.3b is GPT-3 XL's shape (GeLU,
#: tied embeddings); gpt-7b is Llama-2-7B's (SwiGLU 11008, untied); gpt-13b has 28 layers of
#: hidden 6144 with 48 heads of 128 (SwiGLU 16384, untied) so that TP×METP = 16 divides the heads.
#: 32000-token vocabulary. The configs use RMSNorm for 7B/13B; the plan and the measurement use
#: LayerNorm everywhere (a fused GPU RMSNorm keeps the same input and one fp32 statistic instead
#: of two, a difference below 0.1 % of a layer's activations). ``seq`` is a default only.
PRESETS: Dict[str, Model] = {
    "gpt-1.3b": Model(name="gpt-1.3b", hidden=2048, layers=24, heads=16, ffn=8192, vocab=32000,
                      seq=32768),
    "gpt-7b": Model(name="gpt-7b", hidden=4096, layers=32, heads=32, ffn=11008, vocab=32000,
                    seq=131072, swiglu=True, tied=False),
    "gpt-13b": Model(name="gpt-13b", hidden=6144, layers=28, heads=48, ffn=16384, vocab=32000,
                     seq=262144, swiglu=True, tied=False),
    # Meta's Llama-3 8B / 70B geometries (their config.json; configs/models/llama3-8b.sh)
    "llama3-8b": Model(name="llama3-8b", hidden=4096, layers=32, heads=32, query_groups=8,
                       ffn=14336, vocab=128256, seq=131072, swiglu=True, tied=False),
    "llama3-70b": Model(name="llama3-70b", hidden=8192, layers=80, heads=64, query_groups=8,
                        ffn=28672, vocab=128256, seq=131072, swiglu=True, tied=False),
    # Mixture-of-Experts (their config.json; configs/models/qwen3-30b-a3b.sh): Qwen3-30B-A3B,
    # every layer MoE (decoder_sparse_step 1), 128 experts of 768, top-8, q/k norms; Mixtral
    # 8x7B, 8 experts of 14336, top-2
    "qwen3-30b-a3b": Model(name="qwen3-30b-a3b", hidden=2048, layers=48, heads=32,
                           query_groups=4, kv_channels=128, ffn=6144, vocab=151936, seq=1048576,
                           swiglu=True, tied=False, qk_layernorm=True, experts=128, topk=8,
                           moe_ffn=768),
    "mixtral-8x7b": Model(name="mixtral-8x7b", hidden=4096, layers=32, heads=32, query_groups=8,
                          ffn=14336, vocab=32000, seq=131072, swiglu=True, tied=False,
                          experts=8, topk=2, moe_ffn=14336),
    # GLM-4.5-Air (zai-org's config.json, as tests/test_hf_moe_families.GLM45_AIR): 46 layers,
    # the first dense (ffn 10944), 128 experts of 1408 top-8 and one shared expert of 1408,
    # q/k/v biases; partial RoPE, the sigmoid router and the MTP layer do not change the plan
    "glm-4.5-air": Model(name="glm-4.5-air", hidden=4096, layers=46, heads=96, query_groups=8,
                         kv_channels=128, ffn=10944, vocab=151552, seq=131072, swiglu=True,
                         tied=False, add_qkv_bias=True, experts=128, topk=8, moe_ffn=1408,
                         moe_first_dense=1, moe_shared_ffn=1408),
    # gpt-oss-120b (OpenAI's config.json): 36 layers, 128 experts of 2880 top-4, heads of 64
    # (PRESET_NOTES: its sliding-window layers planned as full attention)
    "gpt-oss-120b": Model(name="gpt-oss-120b", hidden=2880, layers=36, heads=64, query_groups=8,
                          kv_channels=64, ffn=2880, vocab=201088, seq=131072, swiglu=True,
                          tied=False, experts=128, topk=4, moe_ffn=2880),
    # multi-latent attention + DeepSeekMoE (their config.json, docs/mla.md#presets): ffn is the
    # leading dense layers' FFN, moe_shared_ffn = n_shared_experts × moe_intermediate_size
    "deepseek-v2-lite": Model(name="deepseek-v2-lite", hidden=2048, layers=27, heads=16,
                              ffn=10944, vocab=102400, seq=32768, swiglu=True, tied=False,
                              normalization="RMSNorm", qk_layernorm=True, experts=64, topk=6,
                              moe_ffn=1408, moe_shared_ffn=2 * 1408, moe_first_dense=1,
                              kv_lora_rank=512),
    "moonlight-16b-a3b": Model(name="moonlight-16b-a3b", hidden=2048, layers=27, heads=16,
                               ffn=11264, vocab=163840, seq=8192, swiglu=True, tied=False,
                               normalization="RMSNorm", qk_layernorm=True, experts=64, topk=6,
                               moe_ffn=1408, moe_shared_ffn=2 * 1408, moe_first_dense=1,
                               kv_lora_rank=512),
    "deepseek-v3": Model(name="deepseek-v3", hidden=7168, layers=61, heads=128, ffn=18432,
                         vocab=129280, seq=131072, swiglu=True, tied=False,
                         normalization="RMSNorm", qk_layernorm=True, experts=256, topk=8,
                         moe_ffn=2048, moe_shared_ffn=2048, moe_first_dense=3, kv_lora_rank=512,
                         q_lora_rank=1536),
}
#: what a preset's plan does not model, printed with its plans (``metp plan``, ``--reach``,
#: ``--fastest``)
PRESET_NOTES: Dict[str, str] = {
    "gpt-oss-120b": "gpt-oss alternates 128-token sliding-window layers with full ones; the "
                    "METP runtime refuses sliding windows (--window-attn-skip-freq), so every "
                    "layer is planned as full causal attention: an upper bound on the "
                    "attention's memory and time for stock Megatron too (its sinks, linear "
                    "biases and clamped SwiGLU are not in the plan's arithmetic)",
    "glm-4.5-air": "GLM-4.5-Air's shared expert is planned as a dense MLP of 1408 beside the "
                   "routed experts (its weights, activations and time); its MTP layer is not "
                   "planned",
}



@dataclass(frozen=True)
class Job:
    """Parallel sizes and training choices (see :mod:`megatron_metp.tools.plan` for the modes)."""

    tp: int = 1
    metp: int = 8
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    microbatches: int = 0          # per step; 0 = enough to fill the pipeline (≥ pp)
    kernel: str = "flash"          # "flash" or "unfused"
    keep_intermediate: bool = False  # METP MLP: keep x·W1ᵀ instead of recomputing it
    distributed_optimizer: bool = False
    vocab_parallel: bool = False   # METP only: word embedding + output layer split over TP×METP
    precision: str = "bf16"
    hardware: str = "H100-80GB"
    reserve_gib: float = 2.0
    recompute: str = "none"        # "none", "selective" (core attention; METP: core_attn), "full"
    recompute_method: str = "uniform"  # full: "uniform" (chunks of N layers) or "block" (first N)
    recompute_num_layers: int = 1
    offload: bool = False          # --metp-offload-activations: saved tensors to host memory
    cp: int = 1                    # METP × CP: the outer factor c of Megatron's CP group of
    #                                size metp·cp (mode metp only; --context-parallel-size c)
    optimizer_offload: bool = False  # Megatron's --optimizer-cpu-offload (fraction 1.0)
    host_memory_gib: Optional[float] = None  # host RAM per node (None: the preset's; plan.host)
    offload_prefetch: bool = True  # offload: prefetch layer l-1 in l's backward (2 groups on device)
    offload_layers: Optional[int] = None  # offload: layers per stage offloaded (--offload-activations
    #                                       N); None: every layer, or as many as the node's host
    #                                       memory holds when it cannot hold them all (.partial)
    attention_kernel: Optional[str] = None  # the kernel the time model assumes (--kernel NAME;
    #                                         None: the hardware's default, .rates)
    rates_file: Optional[str] = None  # --rates FILE: measured rates overriding the table
    # Mixture-of-Experts (:mod:`.moe`; dense models ignore them)
    ep: int = 0                    # expert-parallel size (--ep; stock modes 0: 1); METP: 0 = p
    #                                (the experts over its group), or a multiple of p (wide EP)
    moe_dispatcher: str = "allgather"  # --moe-token-dispatcher-type allgather | alltoall
    moe_imbalance: float = 1.0     # routed rows of the busiest EP rank over the mean (n·k)
    moe_token_tiles: bool = True   # METP: the routed part over token tiles (stock: never)
    moe_grouped_gemm: bool = False  # --moe-grouped-gemm: every expert's backward at once
    # token tiles of the job (its --metp-mlp-token-tile / --metp-moe-token-tiles; a --config's
    # EXTRA_ARGS or METP_MLP_TOKEN_TILE): None = the override (METP_MLP_TOKEN_TILE /
    # METP_MOE_TOKEN_TILES in this environment), else auto from the budget, as the ops resolve it
    mlp_token_tile: Optional[int] = None  # token rows per MLP ring pass (0 = whole)
    moe_tile_count: Optional[int] = None  # token tiles per MoE layer (1 = whole)
    # kept attention (METP modes, full recompute: --metp-keep-attention-output [N], .keep): None
    # off; N the first N layers of each stage keep the attention output O and its log-sum-exp
    # instead of re-running the attention forward (N >= the stage's layers: every layer);
    # KEEP_AUTO: as many as the host (offloaded layers) and the device (kept ones) hold
    keep_attention_output: Optional[int] = None

    @property
    def width(self) -> int:
        return self.tp * self.metp

    @property
    def replica(self) -> int:
        """GPUs of one model replica: TP × METP × CP × PP."""
        return self.tp * self.metp * self.cp * self.pp

    @property
    def inflight(self) -> int:
        """Micro-batches whose activations the first pipeline stage holds at once (1F1B)."""
        if self.pp == 1:
            return 1
        return min(self.pp, self.microbatches) if self.microbatches else self.pp


@dataclass(frozen=True)
class Layout:
    """How one mode uses the ``W`` GPUs: TP size ``t``, sequence-sharding size ``c``, SP, and the
    number of shards of each transformer-layer weight."""

    mode: str
    t: int
    c: int
    sp: bool
    weight_shards: int
    vocab: bool = False  # word embedding / output layer split over t·p (METP vocabulary)
    cp: int = 1          # METP × CP: the outer CP factor (the sequence over c = p·cp ranks)

    @property
    def p(self) -> int:
        """The METP group (weights, weight ring, vocabulary ring): ``c / cp``."""
        return self.c // self.cp

    @property
    def vocab_shards(self) -> int:
        """Shards of each vocabulary table: ``t·p`` with the METP split, else TP's ``t``."""
        return self.t * self.p if self.vocab else self.t

    @property
    def vocab_pad(self) -> int:
        """Megatron-LM pads the vocabulary to a multiple of ``128 × vocab_pad``: ``t·p`` with
        METP (METP pads as stock TP of size ``t·p`` does), else TP's ``t``."""
        return self.t * self.p if self.mode in VOCAB_MODES else self.t

    def describe(self) -> str:
        if self.mode in ("tp", "tp-sp"):
            return f"TP={self.t}" + ("+SP" if self.sp else "")
        if self.mode in VOCAB_MODES:
            return f"METP={self.p}" + (f"×CP={self.cp}" if self.cp > 1 else "") + \
                (f"×TP={self.t}" if self.t > 1 else "") + ("+vocab" if self.vocab else "")
        if self.mode == "ring":
            return f"ring={self.c}"
        if self.mode == "alst":
            return f"Ulysses={self.c}+ZeRO-3"
        return f"TP={self.t}{'+SP' if self.sp else ''}×CP={self.c}"


def alst_layout(job: Job) -> Layout:
    """Ulysses over every GPU of the job: ``c = W`` sequence shards, weights ZeRO-3-sharded."""
    W = job.tp * job.metp * job.cp
    return Layout("alst", 1, W, False, W)


def layout(mode: str, job: Job) -> Layout:
    W = job.width
    if mode == "tp":
        return Layout(mode, W, 1, False, W)
    if mode == "tp-sp":
        return Layout(mode, W, 1, W > 1, W)
    if mode == "cp":
        return Layout(mode, job.tp, job.metp, job.tp > 1, job.tp)
    if mode == "ring":
        return Layout(mode, 1, W, False, 1)
    if mode in VOCAB_MODES:
        return Layout(mode, job.tp, job.metp * job.cp, False, W,
                      vocab=mode == "metp+vocab" or job.vocab_parallel, cp=job.cp)
    if mode == "alst":
        return alst_layout(job)
    raise ValueError(f"--modes: unknown mode {mode!r}; choose from "
                     f"{', '.join(MODES + PEER_MODES)}")


def canonical(mode: str, job: Job) -> Tuple[str, Job]:
    """``("metp+vocab", job)`` → ``("metp", job with vocab_parallel)``; other modes unchanged."""
    if mode == "metp+vocab":
        return "metp", replace(job, vocab_parallel=True)
    return mode, job


def padded_vocab(vocab: int, t: int, multiple: int = 128) -> int:
    """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by (128) × TP``."""
    m = multiple * t
    return -(-vocab // m) * m
