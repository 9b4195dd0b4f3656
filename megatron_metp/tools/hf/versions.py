"""The two ``config.json`` layouts of transformers 4.x and 5.x, read alike and written as the
user's transformers writes them.

What differs (checked against what 4.57.6 and 5.25.0 ``save_pretrained`` write for tiny Llama,
Mistral, Qwen2, Qwen3 with YaRN, Qwen3-MoE and Mixtral: ``tests/data/hf_configs/``):

=====================  ==================================  ====================================
setting                transformers 4.x                    transformers 5.x
=====================  ==================================  ====================================
RoPE base              ``rope_theta``                      ``rope_parameters.rope_theta``
RoPE scaling           ``rope_scaling`` (null, or a dict   ``rope_parameters`` (``rope_type``
                       with ``rope_type``/``type``)        ``default``, or the scaling's keys)
per-layer-type RoPE    —                                   ``rope_parameters`` keyed by the
                                                           ``layer_types`` names
Qwen3-MoE experts      ``num_experts``                     ``num_local_experts``
=====================  ==================================  ====================================

(Both write the dtype as ``dtype``; older 4.x releases wrote ``torch_dtype``, which both read.
Qwen2/Qwen3 ``layer_types`` and the token ids are written by both; 5.x adds ``pad_token_id``.)

:func:`canonical` turns either into one form (4.x names: ``rope_theta``, ``rope_scaling``,
``num_experts`` for Qwen3-MoE) before anything is checked, naming the source key (``rope_scaling``
or ``rope_parameters``) in ``_rope_source``. transformers 5 takes ``rope_scaling`` over
``rope_parameters`` and ``rope_parameters.rope_theta`` over ``rope_theta``; 4.x ignores
``rope_parameters``. So a config holding both forms is read only when they agree, and refused
naming both keys when they differ (the two versions would build different models). Per-layer-type
RoPE converts when every layer type in use has the same settings (METP's layers share one RoPE).

:func:`to_layout` writes the canonical form back in layout 4 or 5; :func:`installed_layout` is
the major version of the installed transformers (``hf export`` writes that one unless
``--transformers-layout`` says otherwise).
"""

from __future__ import annotations

from typing import Optional

from .errors import HFConfigError

#: the layouts :func:`to_layout` writes
LAYOUTS = (4, 5)
#: key that names the canonical config's RoPE source in messages (not a config.json key)
ROPE_SOURCE = "_rope_source"


def _err(msg: str):
    return HFConfigError(msg)


def _rope_settings(cfg: dict) -> tuple:
    """``(rope_parameters or None, its name in messages)`` with per-layer-type RoPE collapsed."""
    rp = cfg.get("rope_parameters")
    if rp is None:
        return None, "rope_parameters"
    if not isinstance(rp, dict):
        raise _err(f"config.json: rope_parameters = {rp!r} must be null or an object")
    types = cfg.get("layer_types") or []
    nested = [k for k in rp if isinstance(rp[k], dict) or k in types]
    if not nested:
        return dict(rp), "rope_parameters"
    flat = sorted(set(rp) - set(nested))
    if flat:
        raise _err(f"config.json: rope_parameters mixes per-layer-type entries {nested} with "
                   f"top-level keys {flat}; write one form")
    used = sorted(set(types)) if types else sorted(nested)
    missing = [t for t in used if rp.get(t) is None]
    if missing:
        raise _err(f"config.json: rope_parameters has no entry for layer type(s) {missing} "
                   f"of layer_types")
    first = rp[used[0]]
    differ = [t for t in used[1:] if rp[t] != first]
    if differ:
        raise _err(f"config.json: rope_parameters differs between layer types "
                   f"{[used[0]] + differ} ({ {t: rp[t] for t in [used[0]] + differ} }): METP's "
                   f"layers share one rotary embedding; only a model whose layer types all use "
                   f"the same RoPE converts")
    return dict(first), f"rope_parameters.{used[0]}"


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and \
            not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def _kind(d: dict) -> dict:
    """A RoPE dict for comparison: ``type`` as ``rope_type``, without the base."""
    d = {k: v for k, v in d.items() if k not in ("rope_theta", "type")}
    d.setdefault("rope_type", (d.get("rope_type") or "default"))
    return d


def canonical(cfg: dict) -> dict:
    """``cfg`` with the 5.x layout read into the 4.x names (see the module docstring); a
    config already in 4.x layout comes back unchanged (plus ``_rope_source``).

    Where both forms are present: a truthy ``rope_scaling`` is the RoPE in either version (5.x
    replaces ``rope_parameters`` by it, 4.x never reads ``rope_parameters``), so a
    ``rope_parameters`` with another scaling is refused; the base may be written as
    ``rope_theta``, ``rope_parameters.rope_theta`` or ``rope_scaling.rope_theta``, and every one
    present must be the same number (the versions read them in different orders)."""
    out = dict(cfg)
    rp, where = _rope_settings(cfg)
    rs = cfg.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        raise _err(f"config.json: rope_scaling = {rs!r} must be null or an object")
    source = "rope_scaling"
    thetas = {}
    if "rope_theta" in cfg:
        thetas["rope_theta"] = cfg["rope_theta"]
    if rs and "rope_theta" in rs:
        thetas["rope_scaling.rope_theta"] = rs["rope_theta"]
        out["rope_scaling"] = rs = {k: v for k, v in rs.items() if k != "rope_theta"}
    if rp is not None:
        if "rope_theta" in rp:
            thetas[f"{where}.rope_theta"] = rp.pop("rope_theta")
        prf = rp.pop("partial_rotary_factor", None)
        if prf is not None:
            if "partial_rotary_factor" in cfg and not _same(cfg["partial_rotary_factor"], prf):
                raise _err(f"config.json: partial_rotary_factor = "
                           f"{cfg['partial_rotary_factor']!r} and {where}.partial_rotary_factor "
                           f"= {prf!r} differ; keep one")
            out["partial_rotary_factor"] = prf
        scaling = None if _kind(rp) == {"rope_type": "default"} else rp
        if rs and scaling is not None and _kind(scaling) != _kind(rs):
            raise _err(f"config.json: rope_scaling = {rs!r} and {where} = {rp!r} differ "
                       f"(transformers 5 takes rope_scaling, 4.x ignores rope_parameters); "
                       f"keep one")
        if not rs:
            out["rope_scaling"], source = scaling, where
        out.pop("rope_parameters")
    values = list(thetas.values())
    if any(not _same(v, values[0]) for v in values[1:]):
        raise _err(f"config.json: the RoPE base is written differently in "
                   f"{', '.join(f'{k} = {v!r}' for k, v in thetas.items())} (transformers 4.x "
                   f"and 5.x read them in different orders); keep one")
    if values:
        out["rope_theta"] = values[0]
    out[ROPE_SOURCE] = source
    if cfg.get("model_type") == "qwen3_moe" and "num_local_experts" in cfg:
        n = cfg["num_local_experts"]
        if "num_experts" in cfg and cfg["num_experts"] != n:
            raise _err(f"config.json: num_experts = {cfg['num_experts']!r} and num_local_experts "
                       f"= {n!r} differ (Qwen3-MoE: transformers 4.x reads num_experts, 5.x "
                       f"num_local_experts); keep one")
        out["num_experts"] = n
        out.pop("num_local_experts")
    return out


def rope_source(cfg: dict) -> str:
    """The config key a canonical config's ``rope_scaling`` came from (for messages)."""
    return cfg.get(ROPE_SOURCE, "rope_scaling")


def installed_layout() -> Optional[int]:
    """4 or 5: the layout the installed transformers writes (None if it is not installed)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        major = int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return None
    return 5 if major >= 5 else 4


def source_layout(cfg: dict) -> int:
    """The layout a ``config.json`` is in (5 if it has any 5.x-only key, else 4)."""
    if "rope_parameters" in cfg or (
            cfg.get("model_type") == "qwen3_moe" and "num_local_experts" in cfg):
        return 5
    return 4


def to_layout(cfg: dict, layout: int) -> dict:
    """The (canonical or either-layout) ``cfg`` as transformers ``layout`` (4 or 5) writes it:
    the same model, only the names differ (:func:`canonical` of the result equals
    :func:`canonical` of ``cfg``)."""
    if layout not in LAYOUTS:
        raise _err(f"--transformers-layout {layout!r}: choose 4 or 5")
    c = canonical(cfg)
    c.pop(ROPE_SOURCE, None)
    out = {k: v for k, v in c.items() if k not in ("rope_theta", "rope_scaling")}
    theta = c.get("rope_theta", 10000.0)
    scaling = c.get("rope_scaling")
    if layout == 4:
        out.update(rope_theta=theta, rope_scaling=scaling)
    else:
        rp = {"rope_type": "default"} if not scaling else \
            {k: v for k, v in scaling.items() if k != "type"} | \
            {"rope_type": scaling.get("rope_type", scaling.get("type"))}
        out["rope_parameters"] = dict(rp, rope_theta=theta)
        if "torch_dtype" in out:  # 5.x writes (and prefers) dtype
            out["dtype"] = out.pop("torch_dtype")
        if out.get("model_type") == "qwen3_moe" and "num_experts" in out:
            out["num_local_experts"] = out.pop("num_experts")
    return dict(sorted(out.items()))


def export_layout(cfg: dict, layout: Optional[int] = None) -> tuple:
    """``(config, layout)`` for ``hf export``: ``cfg`` in ``layout`` (4 or 5), by default the
    installed transformers', else the layout ``cfg`` is in."""
    if layout is None:
        layout = installed_layout() or source_layout(cfg)
    return to_layout(cfg, layout), layout
