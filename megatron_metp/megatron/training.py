"""A small Megatron training loop for tiny GPTs: stock TP, METP and ring self-attention, same data.

It uses megatron-core's real pieces — ``GPTModel``, ``DistributedDataParallel``,
``get_megatron_optimizer`` (with or without the distributed optimizer), the pipeline schedules and
``finalize_model_grads`` — so tests and ``make demo`` exercise what ``pretrain_gpt.py`` runs.
Every layout starts from the same full weights (:func:`full_weight`, a deterministic function of
the parameter's global name) and sees the same global batches (:func:`global_batch`), so losses can
be compared across layouts step by step.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from ..runtime.finite import set_iteration
from ..runtime.watchdog import bounded
from .groups import METPGroups
from .linear import is_metp_sharded
from ..ops.rope_recipe import rope_recipe


@dataclass
class GPTSize:
    """Geometry of the tiny GPT."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: int = 64
    vocab_size: int = 128
    seq_length: int = 32
    swiglu: bool = False
    bias: bool = True
    position_embedding_type: str = "rope"
    normalization: str = "LayerNorm"
    tie_embeddings: bool = False
    #: Mixture-of-Experts (:mod:`.moe`): experts per MoE layer (None: dense), router top-k, an
    #: expert's FFN size (None: ``ffn_hidden_size``), Megatron's ``moe_layer_freq``
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_layer_freq: Union[int, List[int]] = 1
    #: the share of each head's channels RoPE rotates (``--rotary-percent``; partial RoPE)
    rotary_percent: float = 1.0


#: values of :attr:`Layout.recompute` (Megatron's ``recompute_granularity``; selective runs the
#: modules of :mod:`.selective` with METP layers)
RECOMPUTE = (None, "full", "selective")
#: values of :attr:`Layout.recompute_method` (Megatron's ``recompute_method``)
RECOMPUTE_METHODS = ("uniform", "block")


#: the ``Layout`` field behind each :class:`~.settings.METPSettings` field (what a refusal names)
LAYOUT_FIELDS = {"metp": "Layout.metp", "context": "Layout.cp", "tp": "Layout.tp",
                 "pp": "Layout.pp", "mode": "Layout.mode", "kernel": "Layout.kernel",
                 "vocab_parallel": "Layout.vocab_parallel",
                 "offload_activations": "Layout.offload_activations",
                 "keep_attention_output": "Layout.keep_attention_output",
                 "full_recompute": "Layout.recompute='full'",
                 "rope_recipe": "Layout.rope_fp32_recipe",
                 "transformer_impl": "Layout.transformer_impl",
                 "packed": "Layout.packed_eod", "packed_eod": "Layout.packed_eod"}


@dataclass
class Layout:
    """How the job is parallelised. ``mode``: ``"metp"``, ``"tp"`` (stock Megatron) or
    ``"ring"`` (ring self-attention: sequence over the METP group, weights replicated there).

    ``recompute="full"`` sets Megatron's activation recompute (``recompute_granularity``,
    ``recompute_method`` ``"uniform"``/``"block"``, ``recompute_num_layers``) on the
    TransformerConfig: whole layers, rings included, re-run in backward. ``recompute="selective"``
    sets Megatron's selective recompute of ``recompute_modules`` (``None``: Megatron's default,
    ``core_attn``); METP layers run the modules :mod:`.selective` lists and refuse the others.
    ``offload_activations`` attaches :class:`megatron_metp.runtime.offload.ActivationOffloader` to the
    model's transformer block (Megatron-LM: ``--metp-offload-activations [N]``): what the layers keep
    for backward waits in host memory; ``True``: every layer's, an int ``N``: the first ``N``
    layers' of each pipeline stage (the last ones keep theirs on the device).
    ``keep_attention_output`` (Megatron-LM: ``--metp-keep-attention-output [N]``; needs
    ``recompute="full"`` and METP): ``True`` every layer, an int ``N`` the first ``N`` layers of
    each pipeline stage keep their attention output and log-sum-exp for the backward instead of
    running attention again in the recompute (:mod:`.keep_attention`). ``transformer_impl`` (``--transformer-impl``) picks the
    METP layers' norms (:func:`megatron_metp.megatron.gpu_stack.select_norm`: Transformer
    Engine's where installed, else the local ones). ``packed_eod``: the token id that ends each
    packed document (Megatron-LM's ``--reset-position-ids --reset-attention-mask
    --eod-mask-loss``): the batches get Megatron's loss mask (zero at EOD tokens) and reset
    positions; stock TP gets Megatron's dense document mask, METP and the ring baseline derive
    the boundaries from the tokens (:class:`~megatron_metp.megatron.packing.DocumentBoundaries`;
    every sample of a micro-batch must have the same boundaries). ``extra`` adds or overrides any other TransformerConfig
    field. ``cp``: METP × context parallelism, the *outer* factor ``c`` (mode ``"metp"`` only):
    Megatron's CP group has ``metp·cp`` ranks, the sequence is split over all of them, the
    weights over the METP group only (world = TP × METP × CP × PP × DP). ``rope_fp32_recipe``
    (Megatron-LM: ``--metp-rope-fp32-recipe``): METP and ring models keep Megatron's fp32 RoPE
    angles instead of exact ones for this rank's tokens (:mod:`.rope`; also
    ``METP_ROPE_RECIPE=megatron``); stock TP always has Megatron's. ``init_like_tp``: METP's
    sharded weights re-drawn as stock TP of size TP × METP draws them when the config initialises
    on the device (``extra={"use_cpu_initialization": False}``; :func:`.init.initialize_like_tp`).
    ``ep`` (MoE, mode ``"metp"``): the expert-model-parallel size, ``None`` for ``metp`` (the
    experts sharded over the METP group), or a multiple of it (EP wider than the METP group, over
    METP × CP or METP × DP: :mod:`.wide_ep`).
    """

    tp: int = 1
    pp: int = 1
    metp: int = 1
    cp: int = 1
    mode: str = "metp"
    micro_batch_size: int = 1
    global_batch_size: int = 4
    distributed_optimizer: bool = False
    lr: float = 1e-3
    kernel: Optional[str] = None
    vocab_parallel: bool = False
    recompute: Optional[str] = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: Optional[List[str]] = None
    offload_activations: Union[bool, int] = False
    keep_attention_output: Union[bool, int] = False
    transformer_impl: str = "local"
    packed_eod: Optional[int] = None
    rope_fp32_recipe: bool = False
    init_like_tp: bool = True
    ep: Optional[int] = None
    extra: Dict = field(default_factory=dict)

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout.recompute must be 'full', 'selective' or None, got "
                             f"{self.recompute!r}")
        if self.recompute_modules is not None and self.recompute != "selective":
            raise ValueError("Layout.recompute_modules needs recompute='selective'")
        if self.recompute == "selective" and self.mode != "tp":
            from .selective import selective_problems

            problems = selective_problems(self.recompute_modules, weight_ring=self.mode == "metp",
                                          offload=bool(self.offload_activations),
                                          given="Layout.recompute='selective'")
            if problems:
                raise ValueError("; ".join(problems))
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"Layout.recompute_method must be one of {RECOMPUTE_METHODS}, got "
                             f"{self.recompute_method!r}")
        if isinstance(self.recompute_num_layers, bool) or \
                not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 1:
            raise ValueError(f"Layout.recompute_num_layers must be an int >= 1, got "
                             f"{self.recompute_num_layers!r}")
        self.settings()  # METP's own rules (METPSettings.problems), naming these fields

    @property
    def model_ranks(self) -> int:
        """Ranks of one model replica: TP × METP × CP × PP."""
        return self.tp * self.pp * self.metp * self.cp

    def recompute_config(self, num_layers: int) -> dict:
        """The TransformerConfig fields of :attr:`recompute` (empty when it is None); checks
        :attr:`recompute_num_layers` against the ``num_layers / pp`` layers of a stage."""
        if self.recompute is None:
            return {}
        if self.recompute == "selective":
            from .selective import selective_modules

            return {"recompute_granularity": "selective",
                    "recompute_modules": selective_modules(self.recompute_modules)}
        per_stage = num_layers // self.pp
        n = self.recompute_num_layers
        if n > per_stage:
            raise ValueError(f"Layout.recompute_num_layers={n} exceeds the {per_stage} layers of a "
                             f"pipeline stage (num_layers {num_layers} / pp {self.pp})")
        if self.recompute_method == "uniform" and per_stage % n:
            raise ValueError(f"Layout.recompute_num_layers={n} does not divide the {per_stage} "
                             f"layers of a pipeline stage (recompute_method='uniform' checkpoints "
                             f"chunks of recompute_num_layers layers)")
        return {"recompute_granularity": self.recompute, "recompute_method": self.recompute_method,
                "recompute_num_layers": n}

    def offload_layers(self, num_layers: int) -> Optional[int]:
        """The layers per stage :attr:`offload_activations` offloads (``None``: every layer, or
        no offload); ``ValueError`` when ``N`` exceeds the ``num_layers / pp`` layers of a stage
        or splits a uniform recompute chunk (``runtime.offload.check_offload_layers``)."""
        n = self.offload_activations
        if n is False or n is True:
            return None
        from types import SimpleNamespace

        from ..runtime.offload import check_offload_layers

        cfg = SimpleNamespace(recompute_granularity=self.recompute,
                              recompute_method=self.recompute_method,
                              recompute_num_layers=self.recompute_num_layers)
        check_offload_layers(n, num_layers // self.pp, cfg, what="Layout.offload_activations")
        return n

    def check_keep_layers(self, num_layers: int) -> None:
        """``ValueError`` when :attr:`keep_attention_output` ``N`` exceeds the ``num_layers /
        pp`` layers of a stage."""
        from .settings import check_kept_attention_layers

        check_kept_attention_layers(self.keep_attention_output, num_layers // self.pp,
                                    "Layout.keep_attention_output")

    def settings(self, num_layers: Optional[int] = None):
        """This layout as :class:`~.settings.METPSettings` (``num_layers`` checks an
        ``offload_activations`` count against the layers of a stage); refusals name the
        ``Layout`` fields."""
        from .settings import METPSettings

        if num_layers is not None:
            self.offload_layers(num_layers)  # refused here when N does not fit a stage
            self.check_keep_layers(num_layers)
        settings = METPSettings(
            mode=self.mode, metp=self.metp, context=self.cp, tp=self.tp, pp=self.pp,
            kernel=self.kernel, vocab_parallel=self.vocab_parallel,
            offload_activations=self.offload_activations,
            keep_attention_output=None if self.keep_attention_output is False
            else self.keep_attention_output,
            rope_recipe=rope_recipe(self.rope_fp32_recipe),
            rope_recipe_source="Layout.rope_fp32_recipe", transformer_impl=self.transformer_impl,
            packed=self.packed_eod is not None, packed_eod=self.packed_eod,
            init_like_tp=self.init_like_tp)
        full = "full" in (self.recompute, self.extra.get("recompute_granularity"))
        settings.check(names=LAYOUT_FIELDS, full_recompute=full)
        return settings

    def describe(self) -> str:
        name = {"metp": f"METP={self.metp}", "tp": "stock", "ring": f"ring-SA={self.metp}"}[self.mode]
        if self.vocab_parallel:
            name += "+vocab"
        if self.recompute == "selective":
            from .selective import selective_modules

            name += f"+recompute=selective/{','.join(selective_modules(self.recompute_modules))}"
        elif self.recompute:
            name += (f"+recompute={self.recompute}/{self.recompute_method}/"
                     f"{self.recompute_num_layers}")
        if self.offload_activations:
            name += "+offload" + ("" if self.offload_activations is True
                                  else f"={self.offload_activations}")
        if self.keep_attention_output:
            name += "+keep-attention" + ("" if self.keep_attention_output is True
                                         else f"={self.keep_attention_output}")
        parts = [name] + [f"{k}={v}" for k, v in (("CP", self.cp), ("TP", self.tp), ("PP", self.pp))
                          if v > 1]
        dp = dist.get_world_size() // self.model_ranks if dist.is_initialized() else 1
        if dp > 1:
            parts.append(f"DP={dp}" + ("+distopt" if self.distributed_optimizer else ""))
        return " × ".join(parts)


def transformer_config(size: GPTSize, layout: Layout):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=size.num_layers, hidden_size=size.hidden_size,
        num_attention_heads=size.num_attention_heads,
        num_query_groups=size.num_query_groups or size.num_attention_heads,
        ffn_hidden_size=size.ffn_hidden_size, normalization=size.normalization,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.metp * layout.cp,
        use_cpu_initialization=True, perform_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=size.bias,
        gated_linear_unit=size.swiglu, activation_func=F.silu if size.swiglu else F.gelu,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, batch_p2p_sync=False)
    kwargs.update(layout.recompute_config(size.num_layers))
    from .moe import moe_config_fields

    kwargs.update(moe_config_fields(  # stock keeps EP 1 unless layout.extra sets it
        num_experts=size.num_experts, topk=size.moe_router_topk,
        ffn_hidden_size=size.moe_ffn_hidden_size, layer_freq=size.moe_layer_freq,
        metp_parallel_size=layout.metp if layout.mode == "metp" else 1,
        expert_model_parallel_size=layout.ep if layout.mode == "metp" else None))
    layout.offload_layers(size.num_layers)  # refused here, before any model is built
    layout.check_keep_layers(size.num_layers)
    if layout.packed_eod is not None:
        # the loss mask leaves EOD tokens out, so the ranks of a METP ring hold different token
        # counts: gradients are scaled by the global count (Megatron-LM's
        # --calculate-per-token-loss), not each rank's own mean averaged over the ring
        kwargs["calculate_per_token_loss"] = True
    kwargs.update(layout.extra)
    if layout.mode != "tp":
        # before Megatron's own checks: these are refused with METP whatever else is set
        from types import SimpleNamespace

        from .modules import check_recompute_config

        check_recompute_config(SimpleNamespace(**kwargs))
    if kwargs.get("multi_latent_attention"):  # layout.extra's MLA fields (q_lora_rank, ...)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def build_model(size: GPTSize, layout: Layout, groups: METPGroups):
    """This pipeline stage's ``GPTModel`` (tied embeddings only if ``size.tie_embeddings``),
    built by :func:`.build.build_metp_gpt` from :meth:`Layout.settings`.

    ``layout.vocab_parallel`` (METP mode only) builds a :class:`~.vocab.METPGPTModel`: word
    embedding and output layer + loss sharded over TP×METP.
    """
    from megatron.core import parallel_state as ps

    from .build import build_metp_gpt

    cfg = transformer_config(size, layout)
    if layout.vocab_parallel and layout.mode != "metp":
        raise ValueError(f"vocab_parallel needs mode='metp', got mode={layout.mode!r}")
    return build_metp_gpt(cfg, groups, layout.settings(size.num_layers),
                          vocab_size=size.vocab_size, max_sequence_length=size.seq_length,
                          pre_process=ps.is_pipeline_first_stage(),
                          post_process=ps.is_pipeline_last_stage(),
                          share_embeddings_and_output_weights=size.tie_embeddings,
                          position_embedding_type=size.position_embedding_type,
                          normalization=size.normalization, rotary_percent=size.rotary_percent)


# ---------------------------------------------------------------- same weights in every layout

def _global_name(model, name: str) -> str:
    """``decoder.layers.<local>.`` → ``decoder.layers.<global>.`` (pipeline stages); a MoE
    layer's ``local_experts.<local>.`` → ``<global>`` expert index (:mod:`.moe`)."""
    if not name.startswith("decoder.layers."):
        return name
    from .moe import global_expert_name

    name = global_expert_name(model, name)
    local = int(name.split(".")[2])
    glob = model.decoder.layers[local].layer_number - 1
    return name.replace(f"decoder.layers.{local}.", f"decoder.layers.{glob}.", 1)


def full_weight(name: str, shape, seed: int = 1234) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: deterministic, rank-independent."""
    if "q_layernorm." in name or "k_layernorm." in name:  # --qk-layernorm: not all ones, so
        gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))  # q/k mix-ups show
        return 1.0 + torch.randn(shape, generator=gen) * 0.2
    if name.endswith("layer_norm_weight") or name.endswith("layernorm.weight") or \
            name.endswith("final_layernorm.weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen) * 0.02
    gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * 0.05


def shard_for(param: torch.Tensor, full: torch.Tensor, groups: METPGroups, gated: bool) -> torch.Tensor:
    """This rank's piece of ``full`` for ``param``, by Megatron's TP attributes (and METP's)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if is_metp_sharded(param):
        n, idx = groups.shards, groups.shard_index
    else:
        n, idx = groups.tp_size, groups.tp_rank
    if gated:  # SwiGLU fc1: shard r holds [gate_r | up_r]
        return torch.cat([h.chunk(n, dim=dim)[idx] for h in full.chunk(2, dim=dim)], dim=dim)
    return full.chunk(n, dim=dim)[idx]


def full_shape(param: torch.Tensor, groups: METPGroups):
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= groups.shards if is_metp_sharded(param) else groups.tp_size
    return shape


def load_initial_weights(model, groups: METPGroups, size: GPTSize, seed: int = 1234) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            gname = _global_name(model, name)
            if size.tie_embeddings and gname == "output_layer.weight":
                gname = "embedding.word_embeddings.weight"  # the last stage's copy (PP > 1)
            gated = size.swiglu and "linear_fc1.weight" in name or \
                (size.swiglu and "linear_fc1.bias" in name)
            full = full_weight(gname, full_shape(param, groups), seed)
            param.copy_(shard_for(param, full, groups, gated))


# ---------------------------------------------------------------- data

def global_batch(size: GPTSize, step: int, global_batch_size: int, seed: int = 7):
    """The ``step``-th global batch: tokens and labels ``[global_batch_size, seq]``."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.randint(0, size.vocab_size, (global_batch_size, size.seq_length + 1),
                           generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _microbatches(size: GPTSize, layout: Layout, step: int, batch_fn=None):
    from megatron.core import parallel_state as ps
    from .compat import get_batch_on_this_cp_rank

    tokens, labels = (batch_fn or global_batch)(size, step, layout.global_batch_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mb = layout.micro_batch_size
    per_dp = layout.global_batch_size // dp
    start = dp_rank * per_dp
    pos = torch.arange(size.seq_length).unsqueeze(0)
    for i in range(per_dp // mb):
        sl = slice(start + i * mb, start + (i + 1) * mb)
        batch = {"tokens": tokens[sl], "labels": labels[sl], "loss_mask": torch.ones(mb, size.seq_length),
                 "position_ids": pos.expand(mb, -1).contiguous()}
        if layout.packed_eod is not None:
            batch.update(_packed_fields(tokens[sl], layout.packed_eod,
                                        dense_mask=layout.mode == "tp"))
        if ps.get_context_parallel_world_size() > 1:
            batch = get_batch_on_this_cp_rank(batch, cp_group=ps.get_context_parallel_group())
        yield batch


def _packed_fields(tokens: torch.Tensor, eod: int, dense_mask: bool) -> dict:
    """Megatron's GPTDataset fields of packed samples ``tokens [mb, s]`` (documents end with
    ``eod``; ``--reset-position-ids --reset-attention-mask --eod-mask-loss``): ``loss_mask``,
    ``position_ids`` and, with ``dense_mask`` (stock TP), the ``[mb, 1, s, s]`` boolean
    ``attention_mask`` (True = masked out)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    rows = [_get_ltor_masks_and_position_ids(t, eod, True, True, True, dense_mask)
            for t in tokens]
    out = {"loss_mask": torch.stack([r[1] for r in rows]),
           "position_ids": torch.stack([r[2] for r in rows])}
    if dense_mask:
        out["attention_mask"] = torch.stack([r[0] for r in rows])
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"])
    mask = batch["loss_mask"]

    def loss_func(output_tensor):
        losses = output_tensor.float().view(-1) * mask.view(-1)
        loss = losses.sum()
        num_tokens = mask.sum().to(torch.int)
        report = torch.stack([loss.detach().clone(), num_tokens.float()])
        return loss, num_tokens, {"lm loss": report}

    return output, loss_func


# ---------------------------------------------------------------- the loop

@dataclass
class StepRecord:
    iteration: int
    lm_loss: float
    grad_norm: float
    seconds: float


def train(size: GPTSize, layout: Layout, steps: int, *, log: Optional[Callable[[str], None]] = None,
          checkpoint_fn: Optional[Callable] = None, start_step: int = 0, state=None,
          seed: int = 1234, batch_fn: Optional[Callable] = None) -> List[StepRecord]:
    """Build the model for ``layout`` on the already-initialised world and train ``steps`` steps.

    ``state`` (from a previous call) continues training; ``checkpoint_fn(step, state)`` is called
    after every step; ``batch_fn(size, step, global_batch_size) -> (tokens, labels)`` replaces
    :func:`global_batch` as the data. Returns one record per step; rank 0's ``log`` gets Megatron-style lines.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from . import cpu

    if state is None:
        state = setup(size, layout, seed=seed)
    ddp, opt, groups = state["model"], state["optimizer"], state["groups"]
    cfg = ddp.config
    fwd_bwd = get_forward_backward_func()
    records = []
    dp = dist.get_world_size() // layout.model_ranks
    n_mb = layout.global_batch_size // (dp * layout.micro_batch_size)
    for step in range(start_step, start_step + steps):
        set_iteration(step + 1)
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        # each phase records this rank's progress; a wait that times out or breaks in it ends
        # with StalledRankError naming the rank that stalled or died (megatron_metp.runtime.watchdog)
        with bounded(f"forward-backward of iteration {step + 1}"):
            reports = fwd_bwd(forward_step_func=_forward_step,
                              data_iterator=_microbatches(size, layout, step, batch_fn),
                              model=[ddp], num_microbatches=n_mb, seq_length=size.seq_length,
                              micro_batch_size=layout.micro_batch_size, forward_only=False)
        with bounded(f"optimizer step of iteration {step + 1}"), \
                (cpu.cuda_to_cpu() if cpu.is_enabled() else _null()):
            ok, grad_norm, _ = opt.step()
        with bounded(f"loss reduction of iteration {step + 1}"):
            lm = _reduce_loss(reports)
        dt = time.perf_counter() - t0
        rec = StepRecord(step + 1, lm, float(grad_norm or 0.0), dt)
        records.append(rec)
        if log is not None and dist.get_rank() == 0:
            log(megatron_log_line(rec, steps + start_step, layout, opt))
        if checkpoint_fn is not None:
            checkpoint_fn(step + 1, state)
    return records


def setup(size: GPTSize, layout: Layout, *, seed: int = 1234) -> dict:
    """Model (wrapped in Megatron DDP) and optimizer for ``layout``, from the shared initial weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from . import cpu
    from .wide_ep import sum_metp_shards_over_replicas

    groups = METPGroups.from_parallel_state(context_parallel_size=layout.cp)
    # Megatron moves a tied embedding's last-stage copy to CUDA while building (PP > 1)
    with cpu.cuda_to_cpu() if cpu.is_enabled() else _null():
        model = build_model(size, layout, groups)
    load_initial_weights(model, groups, size, seed)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=layout.distributed_optimizer)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
    # EP wider than the METP group: METP-sharded gradients summed over their replicas first
    sum_metp_shards_over_replicas(ddp, groups.ep_replicas)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    opt_cfg = OptimizerConfig(optimizer="adam", lr=layout.lr, weight_decay=0.0, clip_grad=1.0,
                              use_distributed_optimizer=layout.distributed_optimizer,
                              params_dtype=torch.float32)
    with cpu.cuda_to_cpu() if cpu.is_enabled() else _null():
        opt = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False)
    return {"model": ddp, "optimizer": opt, "groups": groups}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _reduce_loss(reports) -> float:
    """Mean ``lm loss`` over the global batch (sum and token count reduced over DP×CP)."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(2)
    if ps.is_pipeline_last_stage():
        for r in reports:
            total += r["lm loss"].float()
    dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    # pipeline: the last stage holds the loss; share it with the stage holding rank 0
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return (total[0] / total[1].clamp_min(1)).item()


def megatron_log_line(rec: StepRecord, total: int, layout: Layout, opt) -> str:
    """One line in Megatron's training-log format."""
    lr = opt.param_groups[0]["lr"] if hasattr(opt, "param_groups") else layout.lr
    return (f" iteration {rec.iteration:8d}/{total:8d} | consumed samples: "
            f"{rec.iteration * layout.global_batch_size:12d} | elapsed time per iteration (ms): "
            f"{rec.seconds * 1000:.1f} | learning rate: {lr:.6E} | global batch size: "
            f"{layout.global_batch_size:5d} | lm loss: {rec.lm_loss:.6E} | loss scale: 1.0 | "
            f"grad norm: {rec.grad_norm:.3f} | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


def init_parallel(layout: Layout, seq_length: Optional[int] = None, *,
                  timeout_s: Optional[float] = None) -> METPGroups:
    """Megatron's parallel state for ``layout`` on the initialised world (plus RNG seeds).

    Every group — Megatron's, the METP rings and the default group — waits at most the job
    timeout: ``timeout_s``, else ``METP_RING_TIMEOUT_S`` (:mod:`megatron_metp.runtime.watchdog`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..runtime.watchdog import apply_to_process_groups, job_timeout_s
    from .parallel import initialize_model_parallel

    if layout.mode not in ("metp", "tp", "ring"):
        raise ValueError(f"layout.mode must be 'metp', 'tp' or 'ring', got {layout.mode!r}")
    timeout_s = job_timeout_s() if timeout_s is None else float(timeout_s)
    if layout.mode == "metp":
        groups = initialize_model_parallel(layout.tp, layout.pp, layout.metp, seq_length=seq_length,
                                           context_parallel_size=layout.cp,
                                           expert_model_parallel_size=layout.ep or 1,
                                           create_gloo_process_groups=False,
                                           ring_timeout_s=timeout_s)
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                     pipeline_model_parallel_size=layout.pp,
                                     context_parallel_size=layout.metp,
                                     create_gloo_process_groups=False,
                                     distributed_timeout_minutes=timeout_s / 60.0)
        apply_to_process_groups(timeout_s)
        groups = METPGroups.from_parallel_state(timeout_s=timeout_s)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    return groups
