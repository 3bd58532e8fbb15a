"""Model facts from a Hugging Face ``config.json``: which layers keep which kind of state, in how
many units a TP side shards it, how many bytes a unit is, and whether it is paged per token or
kept in one slot per request; and, for a TP pairing, what each (prefill rank, decode rank) pair
moves of each group, from the library's :func:`mori_tp.pair_config`.

``mori-tp plan --config`` derives the same facts in Rust; ``cli/tests`` compares the two on every
config the repository ships. The families and their formulas (REFERENCE.md, "Model facts", cites
each source):

- dense GQA, MHA, MQA (Llama, Qwen, GLM): ``full_attention`` on every layer, K and V of
  ``num_key_value_heads`` heads of ``head_dim`` elements per token;
- MLA (DeepSeek V3): ``mla_latent``, one latent of ``kv_lora_rank + qk_rope_head_dim`` elements
  per token, held whole by every rank;
- MLA with an indexer (DeepSeek V3.2, ``index_head_dim``): also ``indexer``, one record per token
  of ``index_head_dim`` fp8 bytes and one fp32 scale per 128 of them (132 B for 128), held whole;
  with an fp8 cache the latent is 656 B (512 fp8 bytes, four fp32 scales, 64 bf16 rope elements);
- sliding window (gpt-oss, Gemma 3): ``full_attention`` and ``sliding_attention`` from
  ``layer_types`` (else Gemma 3's ``sliding_window_pattern``: layer ``i`` is full when
  ``(i + 1) % pattern == 0``); a sliding layer needs the last ``sliding_window`` tokens;
- Qwen3-Next (Gated DeltaNet): ``full_attention`` and, on linear-attention layers, a
  ``conv_state`` slot (q, k, v over ``linear_conv_kernel_dim - 1 + num_spec`` time steps) and a
  ``recurrent_state`` slot (``linear_num_value_heads`` heads of ``linear_value_head_dim *
  linear_key_head_dim`` elements);
- Mamba2 hybrids: Nemotron-H (``hybrid_override_pattern``: ``full_attention`` on ``*`` layers,
  Mamba2 on ``M`` layers), Granite-4.0-H (``layer_types`` of ``mamba`` and ``attention``) and
  Falcon-H1 (``model_type`` falcon_h1: attention and Mamba2 side by side on every layer). A Mamba2
  layer keeps a ``conv_state`` slot (x split by heads, B and C split by groups, over
  ``conv_kernel - 1 + num_spec`` time steps) and an ``ssm_state`` slot (``mamba_num_heads`` heads
  of ``mamba_head_dim * ssm_state_size`` elements); Granite-4.0-H and Falcon-H1 name the fields
  ``mamba_n_heads``, ``mamba_d_head``, ``mamba_n_groups``, ``mamba_d_state``, ``mamba_d_conv``.

The state dtypes are vLLM's (:func:`state_dtypes`): the conv state in ``mamba_cache_dtype`` (the
model's dtype unless given), the SSM and recurrent state in ``mamba_ssm_cache_dtype`` (the
config's, else fp32 for Nemotron-H, else the conv state's); neither follows an fp8 KV cache.
``num_spec`` (speculative tokens, default 0) lengthens a conv state as vLLM does.

Where a serving engine's tensor shape matters, it is an input, never a guess: a conv state's
orientation (vLLM keeps ``(state_len, dim)`` or ``(dim, state_len)``), a slot's stride (engines
pad slots; a required argument) and where each state starts in it, the page layout and page
size. :func:`plan` needs none of them (what moves and how
many bytes do not depend on them); :func:`conv_state_layouts`, :func:`state_layout` and
:func:`paged_layout` take them to build each rank's :class:`mori_tp.Layout`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._core import Action, head_sender, rank_heads
from ._pair import Layout, pair_config

__all__ = [
    "DTYPE_BYTES",
    "Group",
    "ModelFacts",
    "Part",
    "conv_state_layouts",
    "dtype_bytes",
    "paged_layout",
    "model_dtype",
    "plan",
    "read_config",
    "state_dtypes",
    "state_layout",
    "window_tokens",
]

#: Elements that share one fp32 scale in the fp8 indexer and latent (SGLang's
#: ``NSATokenToKVPool.quant_block_size``).
FP8_SCALE_BLOCK = 128

#: Bytes per element of the dtypes mori-tp knows, by the names ``mori-tp --dtype`` prints.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp32": 4}

_DTYPE_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "fp8": "fp8", "float8": "fp8",
    "fp8_e4m3": "fp8_e4m3", "fp8e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fnuz": "fp8_e4m3",
    "fp8_e4m3fnuz": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "fp8e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_e5m2", "fp8_e5m2fnuz": "fp8_e5m2",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
}


def dtype_name(text: str) -> str:
    """The name mori-tp prints for a dtype spelled as mori-tp, PyTorch, vLLM or SGLang spell it
    (``torch.bfloat16``, ``half``, ``float8_e4m3fn``), in any case.

    Raises:
        ValueError: a spelling mori-tp does not know.
    """
    lower = text.strip().lower()
    name = _DTYPE_NAMES.get(lower[len("torch."):] if lower.startswith("torch.") else lower)
    if name is None:
        raise ValueError(f"{text!r} is not a KV-cache dtype mori-tp knows; use one of "
                         f"{', '.join(sorted(DTYPE_BYTES))}")
    return name


def dtype_bytes(text: str) -> int:
    """Bytes per element of a dtype (:func:`dtype_name` spellings)."""
    return DTYPE_BYTES[dtype_name(text)]


@dataclass(frozen=True)
class Part:
    """Units of one group that TP ranks shard as they shard KV heads (REFERENCE.md section 3),
    or hold whole when there is one unit."""

    #: ``kv``, ``latent``, ``index_k``, ``x``, ``B``, ``C``, ``q``, ``k``, ``v``, ``state``.
    name: str
    #: What a unit is: ``head``, ``group``, ``record``.
    unit: str
    #: H: units before TP.
    units: int
    #: How a unit's bytes per token (paged) or per time step (slot) are counted: ``cache``
    #: (``elements`` times the KV-cache dtype), ``conv`` (times the conv state dtype, vLLM's
    #: ``mamba_cache_dtype``), ``state`` (times the SSM state dtype, vLLM's
    #: ``mamba_ssm_cache_dtype``), ``fixed`` (``elements`` bytes whatever the dtype) or
    #: ``mla_latent``.
    kind: str
    #: Elements per unit (``fixed``: bytes; ``mla_latent``: ``kv_lora_rank``).
    elements: int
    #: ``qk_rope_head_dim`` of an ``mla_latent`` part, else 0.
    rope: int = 0
    #: The engines split this part only evenly (``units % tp == 0``, vLLM's ``divide``), never
    #: replicating a unit over several ranks: Mamba2 heads and groups, Gated DeltaNet heads.
    must_divide: bool = False

    def unit_bytes(self, dtype: str, ssm_dtype: str, conv_dtype: Optional[str] = None) -> int:
        """Bytes of one unit per token or per time step, for a KV-cache dtype, an SSM dtype and a
        conv state dtype (``conv_dtype``; ``dtype`` when not given, as for the conv state's own
        ``dtype`` argument of :func:`conv_state_layouts`)."""
        cache = dtype_bytes(dtype)
        if self.kind == "cache":
            return self.elements * cache
        if self.kind == "conv":
            return self.elements * dtype_bytes(conv_dtype or dtype)
        if self.kind == "state":
            return self.elements * dtype_bytes(ssm_dtype)
        if self.kind == "fixed":
            return self.elements
        if cache == 1:  # vLLM fp8_ds_mla: fp8 latent, fp32 scales per 128, bf16 rope
            return self.elements + self.elements // FP8_SCALE_BLOCK * 4 + self.rope * 2
        return (self.elements + self.rope) * cache

    def dtype_label(self, dtype: str, ssm_dtype: str, conv_dtype: Optional[str] = None) -> str:
        if self.kind == "cache":
            return dtype_name(dtype)
        if self.kind == "conv":
            return dtype_name(conv_dtype or dtype)
        if self.kind == "state":
            return dtype_name(ssm_dtype)
        if self.kind == "fixed":
            return "fp8+fp32_scales"
        return "fp8_ds_mla" if dtype_bytes(dtype) == 1 else dtype_name(dtype)


@dataclass(frozen=True)
class Group:
    """Layers that keep the same kind of state in the same shape."""

    #: ``full_attention``, ``sliding_attention``, ``mla_latent``, ``indexer``, ``conv_state``,
    #: ``ssm_state``, ``recurrent_state``.
    name: str
    #: What it holds, for people.
    what: str
    #: Global layer indices.
    layers: Tuple[int, ...]
    #: Buffers per layer: 2 (K and V) or 1.
    buffers_per_layer: int
    #: ``paged`` (per token) or ``slot`` (one per request).
    storage: str
    parts: Tuple[Part, ...]
    #: A sliding group's window in tokens, else None.
    window: Optional[int] = None
    #: A slot's time steps without speculative tokens (a conv state's ``kernel - 1``; 1 for an
    #: SSM state), else None. :meth:`steps` adds the speculative tokens a conv state keeps.
    slot_steps: Optional[int] = None

    def steps(self, num_spec: int = 0) -> Optional[int]:
        """The slot's time steps with ``num_spec`` speculative tokens: vLLM sizes a conv state
        ``conv_kernel - 1 + num_spec`` rows (Mamba2 and Gated DeltaNet alike); an SSM or
        recurrent state keeps one whatever ``num_spec``. None for a paged group."""
        if self.slot_steps is None:
            return None
        return self.slot_steps + (_num_spec(num_spec) if self.name == "conv_state" else 0)


@dataclass(frozen=True)
class ModelFacts:
    """A model's groups of state, from its config.json."""

    name: str
    #: ``dense``, ``mla``, ``mla_indexer``, ``sliding_window``, ``gated_deltanet``, ``mamba2``.
    family: str
    total_layers: int
    groups: Tuple[Group, ...]
    #: The config's ``torch_dtype`` (or ``dtype``), if any.
    torch_dtype: Optional[str] = None
    #: The config's ``mamba_ssm_cache_dtype`` or ``mamba_ssm_dtype``, if any.
    ssm_dtype: Optional[str] = None
    #: The config's ``architectures``: vLLM's SSM state dtype default depends on it.
    architectures: Tuple[str, ...] = ()

    def group(self, name: str) -> Group:
        """The group called ``name``.

        Raises:
            KeyError: the model has no such group (the message lists those it has).
        """
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"{self.name} has no group {name!r}; it has "
                       f"{', '.join(g.name for g in self.groups)}")

    def main_group(self) -> Group:
        """The first paged group without a window (full attention or the MLA latent)."""
        for g in self.groups:
            if g.storage == "paged" and g.window is None:
                return g
        return self.groups[0]


class ConfigError(ValueError):
    """A config.json mori-tp cannot read facts from; the message names the field."""


def _positive(obj: Mapping[str, Any], key: str) -> Optional[int]:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 32:
        raise ConfigError(f"`{key}` is {json.dumps(value)}, expected a positive integer below "
                          f"2^32")
    return value


def _required(obj: Mapping[str, Any], key: str, why: str) -> int:
    value = _positive(obj, key)
    if value is None:
        raise ConfigError(f"`{key}` is missing ({why})")
    return value


def _head_dim_from_hidden(obj: Mapping[str, Any], fallback_for: str) -> int:
    why = f"needed to derive the head dimension without `{fallback_for}`"
    hidden = _required(obj, "hidden_size", why)
    heads = _required(obj, "num_attention_heads", why)
    if hidden % heads:
        raise ConfigError(f"`hidden_size` {hidden} is not a multiple of `num_attention_heads` "
                          f"{heads}, so the head dimension is unclear; add `{fallback_for}` to "
                          f"the config")
    return hidden // heads


def _string_list(obj: Mapping[str, Any], key: str) -> Optional[List[str]]:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"`{key}` is {json.dumps(value)}, expected a list of strings")
    return value


def _layer_types(obj: Mapping[str, Any], layers: int, every: Optional[int], full: str,
                 other: str) -> Optional[List[str]]:
    types = _string_list(obj, "layer_types")
    if types is not None:
        if len(types) != layers:
            raise ConfigError(f"`layer_types` lists {len(types)} layers but "
                              f"`num_hidden_layers` is {layers}")
        return types
    if every is None:
        return None
    return [full if (i + 1) % every == 0 else other for i in range(layers)]


def _indices(types: Sequence[str], name: str) -> Tuple[int, ...]:
    return tuple(i for i, t in enumerate(types) if t == name)


def _kv_group(name: str, what: str, layers: Sequence[int], kv_heads: int,
              head_dim: int) -> Group:
    return Group(name, what, tuple(layers), 2, "paged",
                 (Part("kv", "head", kv_heads, "cache", head_dim),))


def from_config(config: Mapping[str, Any], name: str = "config.json") -> ModelFacts:
    """The facts of a parsed config.json (a mapping, as ``json.load`` returns it).

    Raises:
        ConfigError: a field is missing or malformed; the message names it.
    """
    try:
        return _from_config(config, name)
    except ConfigError as error:
        raise ConfigError(f"{name}: {error}") from None


def _from_config(root: Mapping[str, Any], name: str) -> ModelFacts:
    if not isinstance(root, Mapping):
        raise ConfigError("the top level is not a JSON object")
    obj = root
    if "num_hidden_layers" not in obj and "num_layers" not in obj:
        text = obj.get("text_config")
        if isinstance(text, Mapping):
            obj = text
    torch_dtype = next((v for o in (obj, root) for v in (o.get("torch_dtype"), o.get("dtype"))
                        if isinstance(v, str)), None)
    ssm_dtype = next((obj[k] for k in ("mamba_ssm_cache_dtype", "mamba_ssm_dtype")
                      if isinstance(obj.get(k), str)), None)
    architectures = next((tuple(a for a in o["architectures"] if isinstance(a, str))
                          for o in (root, obj) if isinstance(o.get("architectures"), list)), ())
    layers = _positive(obj, "num_hidden_layers")
    if layers is None:
        layers = _required(obj, "num_layers", "and so is `num_hidden_layers`")
    every_layer = tuple(range(layers))

    def facts(family: str, groups: Sequence[Group]) -> ModelFacts:
        # A group no layer has (a pattern without attention layers) is left out.
        kept = tuple(g for g in groups if g.layers)
        return ModelFacts(name, family, layers, kept, torch_dtype, ssm_dtype, architectures)

    rank = _positive(obj, "kv_lora_rank")
    if rank is not None:
        rope = _required(obj, "qk_rope_head_dim", "an MLA model (it has `kv_lora_rank`) caches "
                                                  "kv_lora_rank + qk_rope_head_dim")
        latent_what = "MLA latent (kv_lora_rank + qk_rope_head_dim), one per token"
        index_dim = _positive(obj, "index_head_dim")
        if index_dim is None:
            return facts("mla", [Group("mla_latent", latent_what, every_layer, 1, "paged",
                                       (Part("latent", "head", 1, "cache", rank + rope),))])
        if index_dim % FP8_SCALE_BLOCK:
            raise ConfigError(f"`index_head_dim` {index_dim} is not a multiple of "
                              f"{FP8_SCALE_BLOCK}, the elements that share one fp32 scale in "
                              f"the fp8 indexer cache")
        record = index_dim + index_dim // FP8_SCALE_BLOCK * 4
        return facts("mla_indexer", [
            Group("mla_latent", latent_what, every_layer, 1, "paged",
                  (Part("latent", "head", 1, "mla_latent", rank, rope),)),
            Group("indexer", "indexer keys, fp8 with one fp32 scale per 128, one record per "
                  "token", every_layer, 1, "paged", (Part("index_k", "record", 1, "fixed",
                                                          record),)),
        ])

    groups_q = _positive(obj, "multi_query_group_num")
    if groups_q is not None and obj.get("multi_query_attention") is not False:
        # GLM: multi_query_group_num KV heads of kv_channels elements.
        kv_heads = groups_q
        head_dim = _positive(obj, "kv_channels") or _head_dim_from_hidden(obj, "kv_channels")
    else:
        kv_heads = _positive(obj, "num_key_value_heads")
        if kv_heads is None:
            kv_heads = _required(obj, "num_attention_heads", "and so is `num_key_value_heads`: "
                                                             "the KV head count is unknown")
        head_dim = (_positive(obj, "head_dim") or _positive(obj, "kv_channels")
                    or _positive(obj, "attention_head_dim")
                    or _head_dim_from_hidden(obj, "head_dim"))

    if "hybrid_override_pattern" in obj or "mamba_n_heads" in obj:
        return facts("mamba2", _mamba2(obj, layers, kv_heads, head_dim))

    types = _string_list(obj, "layer_types")
    if "linear_conv_kernel_dim" in obj or (types is not None and "linear_attention" in types):
        types = _layer_types(obj, layers, _positive(obj, "full_attention_interval"),
                             "full_attention", "linear_attention")
        if types is None:
            raise ConfigError("a Gated DeltaNet model needs `layer_types` or "
                              "`full_attention_interval`")
        return facts("gated_deltanet", _gated_deltanet(obj, types, kv_heads, head_dim))

    pattern = _positive(obj, "sliding_window_pattern") or _positive(obj, "_sliding_window_pattern")
    types = _layer_types(obj, layers, pattern, "full_attention", "sliding_attention")
    if types is not None and "sliding_attention" in types:
        window = _required(obj, "sliding_window", "its sliding_attention layers keep this many "
                                                  "tokens")
        for t in types:
            if t not in ("full_attention", "sliding_attention"):
                raise ConfigError(f"`layer_types` names a layer `{t}`; mori-tp knows "
                                  f"full_attention and sliding_attention here")
        full = _kv_group("full_attention", "K and V of every token",
                         _indices(types, "full_attention"), kv_heads, head_dim)
        sliding = Group("sliding_attention", "K and V of the last sliding_window tokens",
                        _indices(types, "sliding_attention"), 2, "paged",
                        (Part("kv", "head", kv_heads, "cache", head_dim),), window=window)
        return facts("sliding_window", [full, sliding])

    return facts("dense", [_kv_group("full_attention", "K and V of every token", every_layer,
                                     kv_heads, head_dim)])


def _gated_deltanet(obj: Mapping[str, Any], types: Sequence[str], kv_heads: int,
                    head_dim: int) -> List[Group]:
    why = "a Gated DeltaNet layer's conv and recurrent state"
    k_heads = _required(obj, "linear_num_key_heads", why)
    v_heads = _required(obj, "linear_num_value_heads", why)
    k_dim = _required(obj, "linear_key_head_dim", why)
    v_dim = _required(obj, "linear_value_head_dim", why)
    kernel = _required(obj, "linear_conv_kernel_dim", why)
    if kernel < 2:
        raise ConfigError(f"`linear_conv_kernel_dim` is {kernel}: a conv state keeps "
                          f"kernel - 1 time steps")
    for t in types:
        if t not in ("full_attention", "linear_attention"):
            raise ConfigError(f"`layer_types` names a layer `{t}`; a Qwen3-Next model has "
                              f"full_attention and linear_attention layers")
    linear = _indices(types, "linear_attention")
    return [
        _kv_group("full_attention", "K and V of every token", _indices(types, "full_attention"),
                  kv_heads, head_dim),
        Group("conv_state", "Gated DeltaNet conv1d state of q, k and v", linear, 1, "slot",
              (Part("q", "head", k_heads, "conv", k_dim, must_divide=True),
               Part("k", "head", k_heads, "conv", k_dim, must_divide=True),
               Part("v", "head", v_heads, "conv", v_dim, must_divide=True)),
              slot_steps=kernel - 1),
        Group("recurrent_state", "Gated DeltaNet recurrent state, per value head", linear, 1,
              "slot", (Part("state", "head", v_heads, "state", v_dim * k_dim,
                            must_divide=True),), slot_steps=1),
    ]


#: A Mamba2 hybrid's fields, as Nemotron-H names them and as Falcon-H1 and Granite-4.0-H do:
#: heads, head dimension, groups, state size, conv kernel.
_MAMBA2_FIELDS = {
    "hybrid_override_pattern": ("mamba_num_heads", "mamba_head_dim", "n_groups",
                                "ssm_state_size", "conv_kernel"),
    "mamba_n_heads": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                      "mamba_d_conv"),
}


def _mamba2_layers(obj: Mapping[str, Any], layers: int) -> Tuple[Tuple[int, ...],
                                                                  Tuple[int, ...]]:
    """(attention layers, Mamba2 layers): Nemotron-H's ``hybrid_override_pattern``; else
    ``layer_types`` (Granite-4.0-H: ``mamba``, ``attention``; ``hybrid``: both, as Falcon-H1's
    ``layers_block_type``); else Falcon-H1's parallel hybrid (attention and Mamba2 side by side on
    every layer) or Granite-4.0-H's default (every layer Mamba2), by ``model_type``."""
    if "hybrid_override_pattern" in obj:
        pattern = obj["hybrid_override_pattern"]
        if not isinstance(pattern, str):
            raise ConfigError(f"`hybrid_override_pattern` is {json.dumps(pattern)}, expected a "
                              f"string")
        if len(pattern) != layers:
            raise ConfigError(f"`hybrid_override_pattern` has {len(pattern)} layers but "
                              f"`num_hidden_layers` is {layers}")
        for i, c in enumerate(pattern):
            if c not in "M*-E":
                raise ConfigError(f"`hybrid_override_pattern` has `{c}` at layer {i}; mori-tp "
                                  f"knows M (Mamba2), * (attention), - (MLP) and E (MoE)")
        return _indices(pattern, "*"), _indices(pattern, "M")
    types = _layer_types(obj, layers, None, "", "")
    if types is not None:
        for t in types:
            if t not in ("mamba", "attention", "hybrid"):
                raise ConfigError(f"`layer_types` names a layer `{t}`; a Mamba2 hybrid with "
                                  f"`mamba_n_heads` has mamba, attention and hybrid (both) "
                                  f"layers")
        return (tuple(i for i, t in enumerate(types) if t in ("attention", "hybrid")),
                tuple(i for i, t in enumerate(types) if t in ("mamba", "hybrid")))
    every = tuple(range(layers))
    if obj.get("model_type") == "falcon_h1":  # transformers' layers_block_type: all "hybrid"
        return every, every
    if obj.get("model_type") == "granitemoehybrid":  # no layer_types: every layer Mamba2
        return (), every
    raise ConfigError("a Mamba2 hybrid with `mamba_n_heads` needs `layer_types` or a "
                      "`model_type` mori-tp knows (falcon_h1, granitemoehybrid) to say which "
                      "layers keep which state")


def _mamba_head_dim(obj: Mapping[str, Any], key: str, heads: int, why: str) -> int:
    """``mamba_d_head``, or for ``"auto"`` (transformers' Falcon-H1 and Granite-4.0-H configs)
    the Mamba2 intermediate size (``mamba_d_ssm``, else ``mamba_expand * hidden_size``) over the
    heads."""
    if obj.get(key) != "auto":
        return _required(obj, key, why)
    d_ssm = _positive(obj, "mamba_d_ssm")
    intermediate = d_ssm if d_ssm is not None else (
        _required(obj, "mamba_expand", f"`{key}` is auto") *
        _required(obj, "hidden_size", f"`{key}` is auto"))
    if intermediate % heads:
        raise ConfigError(f"`{key}` is auto, and the Mamba2 intermediate size {intermediate} is "
                          f"not a multiple of the {heads} heads")
    return intermediate // heads


def _mamba2(obj: Mapping[str, Any], layers: int, kv_heads: int, head_dim: int) -> List[Group]:
    attention, mamba = _mamba2_layers(obj, layers)
    spelling = "hybrid_override_pattern" if "hybrid_override_pattern" in obj else "mamba_n_heads"
    heads_key, dim_key, groups_key, state_key, kernel_key = _MAMBA2_FIELDS[spelling]
    why = "a Mamba2 layer's conv and SSM state"
    heads = _required(obj, heads_key, why)
    mamba_dim = _mamba_head_dim(obj, dim_key, heads, why)
    n_groups = _required(obj, groups_key, why)
    state = _required(obj, state_key, why)
    kernel = _required(obj, kernel_key, why)
    if kernel < 2:
        raise ConfigError(f"`{kernel_key}` is {kernel}: a conv state keeps kernel - 1 time steps")
    # Falcon-H1 names x's channels (the Mamba2 intermediate size) too: they are the heads'.
    d_ssm = _positive(obj, "mamba_d_ssm")
    if d_ssm is not None and d_ssm != heads * mamba_dim:
        raise ConfigError(f"`mamba_d_ssm` {d_ssm} is not `{heads_key}` {heads} x `{dim_key}` "
                          f"{mamba_dim} = {heads * mamba_dim}: x's channels split by heads")
    if n_groups > 1 and heads % n_groups:
        raise ConfigError(f"`{heads_key}` {heads} is not a multiple of `{groups_key}` "
                          f"{n_groups}: each group serves whole heads")
    attention_dim = _positive(obj, "attention_head_dim") or head_dim
    return [
        _kv_group("full_attention", "K and V of every token", attention, kv_heads,
                  attention_dim),
        Group("conv_state", "Mamba2 conv1d state of x, B and C", mamba, 1, "slot",
              (Part("x", "head", heads, "conv", mamba_dim, must_divide=True),
               Part("B", "group", n_groups, "conv", state, must_divide=n_groups > 1),
               Part("C", "group", n_groups, "conv", state, must_divide=n_groups > 1)),
              slot_steps=kernel - 1),
        Group("ssm_state", "Mamba2 SSM state, per head", mamba, 1, "slot",
              (Part("state", "head", heads, "state", mamba_dim * state, must_divide=True),),
              slot_steps=1),
    ]


def read_config(path: Union[str, "os.PathLike[str]"]) -> ModelFacts:
    """The facts of a ``config.json``, or of the one in a model directory (a Hugging Face snapshot
    or checkout), named by the path as given.

    Raises:
        ConfigError: no config.json there, or one mori-tp cannot read (the message says why).
    """
    name = os.fspath(path)
    file = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(file):
        raise ConfigError(f"{name} is a directory without a config.json (give the model's "
                          f"directory or its config.json)" if os.path.isdir(name)
                          else f"cannot read {file}: no such file")
    with open(file, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{name} is not valid JSON: {error}") from None
    return from_config(config, name)


# --- ownership (REFERENCE.md section 3), for the units each pair shares -----------------------


def _split_problem(group: Group, part: Part, tp: int) -> Optional[str]:
    """Why the engines cannot split ``part`` over ``tp`` ranks, or None when they can."""
    if part.must_divide and part.units % tp:
        return (f"TP {tp} does not divide the {part.units} {part.name} {part.unit}s of "
                f"{group.name}: vLLM and SGLang split them only evenly")
    return None


def _check_tp(facts: ModelFacts, prefill_tp: int, decode_tp: int) -> None:
    problems = [f"{side} side: {problem}" for g in facts.groups for p in g.parts
                for side, tp in (("prefill", prefill_tp), ("decode", decode_tp))
                for problem in [_split_problem(g, p, tp)] if problem]
    if problems:
        raise ValueError(f"{facts.name} cannot run with prefill TP {prefill_tp} and decode TP "
                         f"{decode_tp}:\n  " + "\n  ".join(problems))


def _num_spec(num_spec: Any) -> int:
    if isinstance(num_spec, bool) or not isinstance(num_spec, int) or num_spec < 0:
        raise ValueError(f"num_spec must be a non-negative int (speculative tokens), not "
                         f"{num_spec!r}")
    return num_spec


# --- layouts --------------------------------------------------------------------------------


def paged_layout(group: Group, part: Part, tp_size: int, tp_rank: int, page_size: int,
                 order: str, dtype: str, ssm_dtype: Optional[str] = None) -> Layout:
    """One rank's layout of a paged part with the engine's page order (``"nhd"`` or ``"hnd"``)
    and page size: :meth:`mori_tp.Layout.nhd` or :meth:`~mori_tp.Layout.hnd` of the part's units
    and unit bytes. An engine that keeps a part some other way (SGLang's indexer page holds every
    token's fp8 keys, then every token's scales) describes it with :class:`mori_tp.Layout`
    directly."""
    if group.storage != "paged":
        raise ValueError(f"{group.name} is kept in one slot per request, not in pages: use "
                         f"conv_state_layouts or state_layout")
    make = {"nhd": Layout.nhd, "hnd": Layout.hnd}.get(order)
    if make is None:
        raise ValueError(f"page order {order!r}: use 'nhd' or 'hnd'")
    return make(part.units, tp_size, tp_rank, page_size,
                part.unit_bytes(dtype, ssm_dtype or dtype))


def _slot_layout(part: Part, tp_size: int, tp_rank: int, head_bytes: int) -> Layout:
    """The plan's view of a slot: one page per slot, each unit's bytes of the slot whole."""
    return Layout.nhd(part.units, tp_size, tp_rank, 1, head_bytes)


def _local_units(part: Part, tp_size: int) -> int:
    return part.units // tp_size if tp_size <= part.units else 1


def _refuse_split(group: Group, tp_size: int, tp_rank: int) -> None:
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, not {value!r}")
    if not tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not below tp_size {tp_size}")
    problems = [problem for p in group.parts
                for problem in [_split_problem(group, p, tp_size)] if problem]
    if problems:
        raise ValueError("; ".join(problems))


def conv_state_layouts(group: Group, tp_size: int, tp_rank: int, orientation: str, dtype: str,
                       *, slot_stride: int, offset: int = 0, per_channel: bool = False,
                       num_spec: int = 0,
                       prefill_tp: Optional[int] = None) -> Dict[str, Layout]:
    """One rank's layout of each part of a conv state slot, by part name.

    A rank's slot holds its channels of every part in the model's order (Mamba2: x, B, C;
    Gated DeltaNet: q, k, v), each part's local units back to back, as vLLM's sharded weight
    loader places them, over ``kernel - 1 + num_spec`` time steps (vLLM's
    ``mamba2_state_shape`` and ``gated_delta_net_state_shape``: ``num_spec`` is the engine's
    speculative tokens, ``--speculative-config``'s ``num_speculative_tokens``, default 0; SGLang
    keeps them elsewhere and sizes the conv state ``kernel - 1``). ``dtype`` is the conv state's
    (vLLM's ``mamba_cache_dtype``: the model's dtype unless set, not the KV cache's).
    ``orientation`` is the engine's and has no default: ``"sd"`` (``(state_len, dim)``, vLLM's
    default) or ``"ds"`` (``(dim, state_len)``, ``VLLM_SSM_CONV_STATE_LAYOUT=DS``).
    ``slot_stride`` (required) is the bytes from one request's slot to the next, as the caller's
    engine allocated them: mori-tp does not guess an engine's allocation (engines pad slots, or
    keep other state in them). ``offset`` is where the conv state starts in the slot (default
    0: first).

    A unit of an ``"sd"`` slot is one time step of its channels (page size = the time steps); of
    a ``"ds"`` slot, all of its channels' time steps (page size 1). Both sides of a pair must
    describe units alike: for a prefill engine of one orientation and a decode engine of the
    other, pass ``per_channel=True`` on both, which makes every channel of every time step its
    own unit (``units * elements`` of them, one element each).

    With one group (``n_groups == 1``) every rank holds B and C whole (vLLM's
    ``extra_groups_for_head_shards``), and per channel each decode rank must still take them
    from exactly one prefill rank: the one REFERENCE.md section 3 names for a unit held whole,
    prefill rank ``d * P / D``. A rank's layouts alone cannot say which, so such a model takes
    ``prefill_tp=P`` (the prefill engine's TP size) on both sides with ``per_channel=True``:
    decode rank ``d`` then pairs only with prefill rank ``d * P / D`` for B and C.

    Raises:
        ValueError: not a conv state group, an unknown orientation, a TP size the engines cannot
            split a part by, a negative ``num_spec``, ``per_channel`` with a part held whole
            and no ``prefill_tp``, or a conv state that does not fit its slot (``offset`` + its
            bytes over ``slot_stride``).
    """
    if group.name != "conv_state" or group.slot_steps is None:
        raise ValueError(f"{group.name} is not a conv state")
    if orientation not in ("sd", "ds"):
        raise ValueError(f"conv state orientation {orientation!r}: use 'sd' ((state_len, dim), "
                         f"vLLM's default) or 'ds' ((dim, state_len))")
    _refuse_split(group, tp_size, tp_rank)
    steps, elem = group.steps(num_spec), dtype_bytes(dtype)
    whole = [p for p in group.parts if p.units == 1]
    if per_channel and whole:
        if prefill_tp is None:
            names = " and ".join(p.name for p in whole)
            raise ValueError(
                f"per_channel: {names} of {group.name} are 1 {whole[0].unit} of "
                f"{whole[0].elements} channels held whole by every rank (n_groups = 1), and "
                f"each decode rank must take them from exactly one prefill rank; pass "
                f"prefill_tp= (the prefill engine's TP size) on both sides")
        if isinstance(prefill_tp, bool) or not isinstance(prefill_tp, int) or prefill_tp < 1:
            raise ValueError(f"prefill_tp must be a positive int, not {prefill_tp!r}")
    widths = [_local_units(p, tp_size) * p.elements for p in group.parts]
    dim = sum(widths)
    own = dim * steps * elem
    stride = _slot_stride(slot_stride, offset, own,
                          f"{dim} channels x {steps} time steps x {elem} B")
    layouts, channel = {}, 0
    for part, width in zip(group.parts, widths):
        local = _local_units(part, tp_size)
        if per_channel:
            units, tp, rank = part.units * part.elements, tp_size, tp_rank
            if part.units == 1:
                # Held whole: prefill_tp copies of the channels, prefill rank p holding copy p
                # and decode rank d copy d * P / D, so that exactly that pair shares them.
                assert prefill_tp is not None
                units, tp, rank = part.elements * prefill_tp, prefill_tp, \
                    tp_rank * prefill_tp // tp_size
            if orientation == "sd":
                token, head_stride, at = dim * elem, elem, channel * elem
            else:
                token, head_stride, at = elem, steps * elem, channel * steps * elem
            layout = Layout(units, tp, rank, steps, elem, stride, offset + at, token,
                            head_stride)
        elif orientation == "sd":
            head = part.elements * elem
            layout = Layout(part.units, tp_size, tp_rank, steps, head, stride,
                            offset + channel * elem, dim * elem, head)
        else:
            head = part.elements * steps * elem
            layout = Layout(part.units, tp_size, tp_rank, 1, head, stride,
                            offset + channel * steps * elem, local * head, head)
        layouts[part.name] = layout
        channel += width
    return layouts


def state_layout(group: Group, tp_size: int, tp_rank: int, ssm_dtype: str, *,
                 slot_stride: int, offset: int = 0) -> Layout:
    """One rank's layout of an SSM or recurrent state slot: its local heads back to back, each
    ``elements`` contiguous (vLLM's ``(heads / tp, head_dim, state_size)`` and ``(v_heads / tp,
    v_dim, k_dim)``), one slot per request ``slot_stride`` bytes apart, starting ``offset``
    bytes into the slot. ``ssm_dtype`` is the state's (vLLM's ``mamba_ssm_cache_dtype``;
    :func:`state_dtypes` gives the engines' defaults).

    ``slot_stride`` is required: it is how the caller's engine allocated its slots, which
    mori-tp does not guess. ``offset`` describes a slot that keeps other state first, such as
    the SSM state after the conv state (REFERENCE.md section 15): pass the conv state's bytes
    (and the same ``slot_stride`` to :func:`conv_state_layouts`).

    Raises:
        ValueError: not an SSM or recurrent state group, a TP size the engines cannot split its
            heads by, or a state that does not fit its slot (``offset`` + its bytes over
            ``slot_stride``).
    """
    if group.name not in ("ssm_state", "recurrent_state"):
        raise ValueError(f"{group.name} is not an SSM or recurrent state")
    _refuse_split(group, tp_size, tp_rank)
    (part,) = group.parts
    head = part.unit_bytes(ssm_dtype, ssm_dtype)
    local = _local_units(part, tp_size)
    own = local * head
    stride = _slot_stride(slot_stride, offset, own, f"{local} heads x {head} B")
    return Layout(part.units, tp_size, tp_rank, 1, head, stride, offset, own, head)


def _slot_stride(slot_stride: Any, offset: Any, own: int, what: str) -> int:
    """Checks the caller's slot stride and offset against the bytes of the state they place."""
    for name, value in (("slot_stride", slot_stride), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int (bytes), not {value!r}")
    if offset + own > slot_stride:
        raise ValueError(f"slot_stride {slot_stride} is smaller than offset {offset} + the "
                         f"state's {own} bytes ({what})")
    return slot_stride


# --- the plan -------------------------------------------------------------------------------


def window_tokens(tokens: int, window: int, prefill_page_size: int,
                  decode_page_size: int) -> int:
    """The tokens a sliding window of ``window`` moves out of a ``tokens``-token sequence. The
    library takes a window's ``first_token`` only on a page of both sides (REFERENCE.md section
    15), so the window starts at ``tokens - window`` rounded down to a multiple of both page
    sizes and moves up to ``lcm - 1`` tokens more than ``window``: 1000 tokens, a window of 128,
    pages of 16 and 64 start at token 832 and move 168 tokens."""
    lcm = math.lcm(max(prefill_page_size, 1), max(decode_page_size, 1))
    return tokens - max(tokens - window, 0) // lcm * lcm


#: vLLM's SSM state dtype for Nemotron-H when neither the engine nor the config names one
#: (``NemotronHForCausalLMConfig.DEFAULT_MAMBA_SSM_CACHE_DTYPE``, vLLM PR #39032), by the
#: architectures that hook applies to.
NEMOTRON_H_SSM_DTYPE = "fp32"
_NEMOTRON_H_ARCHITECTURES = ("NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
                             "NemotronH_Nano_VL_V2")


def _given(text: Optional[str]) -> Optional[str]:
    """A dtype argument: None and ``"auto"`` leave the choice to the default."""
    if text is None or text.strip().lower() == "auto":
        return None
    return dtype_name(text)


def model_dtype(facts: ModelFacts) -> str:
    """The model's dtype: its config's ``torch_dtype`` (or ``dtype``), bf16 when it names none or
    one mori-tp does not know. The KV cache's default, and the conv state's."""
    try:
        return dtype_name(facts.torch_dtype) if facts.torch_dtype else "bf16"
    except ValueError:
        return "bf16"


def state_dtypes(facts: ModelFacts, mamba_cache_dtype: Optional[str] = None,
                 mamba_ssm_cache_dtype: Optional[str] = None) -> Tuple[str, str]:
    """The conv state's and the SSM (or recurrent) state's dtypes, as vLLM chooses them
    (``MambaStateDtypeCalculator``): the conv state in ``mamba_cache_dtype``, by default the
    model's dtype (:func:`model_dtype`), never the KV cache's fp8; the SSM state in
    ``mamba_ssm_cache_dtype``, by default the one the config names (``mamba_ssm_cache_dtype``,
    ``mamba_ssm_dtype``), else fp32 for Nemotron-H (vLLM's ``NemotronHForCausalLMConfig``),
    else the conv state's. ``None`` or ``"auto"`` asks for the default. (SGLang keeps the conv
    state in bf16 and the SSM state in fp32 unless ``SGLANG_MAMBA_CONV_DTYPE`` or
    ``SGLANG_MAMBA_SSM_DTYPE`` (or the config's ``mamba_ssm_dtype``) say otherwise: pass them.)

    Raises:
        ValueError: a dtype mori-tp does not know, given or named by the config.
    """
    conv = _given(mamba_cache_dtype) or model_dtype(facts)
    ssm = _given(mamba_ssm_cache_dtype)
    if ssm is None and facts.ssm_dtype is not None:
        ssm = dtype_name(facts.ssm_dtype)
    if ssm is None and any(a in _NEMOTRON_H_ARCHITECTURES for a in facts.architectures):
        ssm = NEMOTRON_H_SSM_DTYPE
    return conv, ssm or conv


def plan(facts: ModelFacts, prefill_tp: int, decode_tp: int, tokens: int,
         dtype: Optional[str] = None, ssm_dtype: Optional[str] = None,
         prefill_layout: str = "nhd", decode_layout: str = "nhd", prefill_page_size: int = 1,
         decode_page_size: int = 1, *, mamba_cache_dtype: Optional[str] = None,
         mamba_ssm_cache_dtype: Optional[str] = None,
         num_spec: int = 0) -> List[Dict[str, Any]]:
    """What every pair moves of every group, as ``mori-tp plan --config ... --json`` writes it
    under ``"groups"``: per group its layers, storage and parts (units, unit bytes, dtype); under
    ``"pairs"``, per (prefill rank, decode rank) pair that sends some part, each part it shares
    with its action, units and local indices (from :func:`mori_tp.pair_config` of both ranks'
    layouts) and its bytes per token and per request; under ``"replicas"``, the pairs that only
    skip, condensed into runs (``{"decode_rank", "prefill_ranks": [first, end), "parts":
    [{"part", "shared_units", "sent_by"}]}``: consecutive prefill ranks that skip the same units
    for the same senders); per decode rank, what it owns and receives.

    Three dtypes, as vLLM names them: ``dtype`` is the KV cache's (``--kv-cache-dtype``), by
    default the model's (:func:`model_dtype`); ``mamba_cache_dtype`` the conv state's and
    ``mamba_ssm_cache_dtype`` (or its older name ``ssm_dtype``) the SSM and recurrent state's,
    with :func:`state_dtypes`' defaults: an fp8 KV cache leaves the states as they are.
    ``num_spec`` is the engines' speculative tokens (default 0): vLLM keeps a conv state of
    ``kernel - 1 + num_spec`` time steps. A paged part's layouts are
    ``prefill_layout``/``decode_layout`` pages of the given sizes; a slot part's pair configs are
    built on one page per slot (what moves does not depend on the engine's slot layout).

    Raises:
        ValueError: a TP size the engines cannot split a part by (the message names it), a
            dtype mori-tp does not know, ``ssm_dtype`` and ``mamba_ssm_cache_dtype`` that
            disagree, a negative ``num_spec``.
        mori_tp.TopologyError: a TP size that does not fit a part's units (REFERENCE.md section 3).
    """
    if ssm_dtype is not None and mamba_ssm_cache_dtype is not None and \
            _given(ssm_dtype) != _given(mamba_ssm_cache_dtype):
        raise ValueError(f"ssm_dtype {ssm_dtype!r} and mamba_ssm_cache_dtype "
                         f"{mamba_ssm_cache_dtype!r} disagree: give one")
    dtype = _given(dtype) or model_dtype(facts)
    conv_dtype, ssm_dtype = state_dtypes(facts, mamba_cache_dtype,
                                         mamba_ssm_cache_dtype or ssm_dtype)
    num_spec = _num_spec(num_spec)
    _check_tp(facts, prefill_tp, decode_tp)
    paging = {"prefill": (prefill_layout, prefill_page_size),
              "decode": (decode_layout, decode_page_size)}
    out = []
    for g in facts.groups:
        moved = None
        if g.storage == "paged":
            moved = tokens if g.window is None else window_tokens(
                tokens, g.window, prefill_page_size, decode_page_size)
        steps = g.steps(num_spec)
        unit_bytes = [p.unit_bytes(dtype, ssm_dtype, conv_dtype) for p in g.parts]
        per_unit = [b * g.buffers_per_layer * len(g.layers) for b in unit_bytes]

        def layout(i: int, side: str, tp: int, rank: int) -> Layout:
            part = g.parts[i]
            if g.storage == "paged":
                order, size = paging[side]
                return paged_layout(g, part, tp, rank, size, order, dtype, ssm_dtype)
            return _slot_layout(part, tp, rank, unit_bytes[i] * (steps or 1))

        prefill_heads: Dict[int, List[Tuple[int, int]]] = {}
        pairs: List[Dict[str, Any]] = []
        replicas: List[Dict[str, Any]] = []
        ranks = []
        for d in range(decode_tp):
            by_prefill: Dict[int, List[Dict[str, Any]]] = {}
            owned = {}
            for i, part in enumerate(g.parts):
                if i not in prefill_heads:  # the prefill side is checked first, as before
                    prefill_heads[i] = [rank_heads(part.units, prefill_tp, p)
                                        for p in range(prefill_tp)]
                lo, hi = rank_heads(part.units, decode_tp, d)
                owned[part.name] = [lo, hi]
                for p, (plo, phi) in enumerate(prefill_heads[i]):
                    shared = (max(lo, plo), min(hi, phi))
                    if shared[0] >= shared[1]:
                        continue
                    config = pair_config(layout(i, "prefill", prefill_tp, p),
                                         layout(i, "decode", decode_tp, d))
                    sends = config.action is Action.SEND
                    moved_bytes = config.num_heads * per_unit[i] if sends else 0
                    if g.storage == "paged":
                        per_token, per_request = moved_bytes, moved_bytes * moved
                    else:
                        per_token, per_request = None, moved_bytes * steps
                    by_prefill.setdefault(p, []).append({
                        "part": part.name,
                        "action": {Action.SEND: "send", Action.SKIP_REPLICA: "skip_replica",
                                   Action.NOT_PAIRED: "not_paired"}[config.action],
                        "shared_units": list(shared),
                        "sent_by": head_sender(part.units, prefill_tp, decode_tp, d, shared[0]),
                        "first_unit": config.first_head,
                        "num_units": config.num_heads,
                        "src_first_local": config.src_first_local,
                        "dst_first_local": config.dst_first_local,
                        "bytes_per_token": per_token,
                        "bytes_per_request": per_request,
                    })
            rank_token = 0 if g.storage == "paged" else None
            rank_request = 0
            for p in sorted(by_prefill):
                parts = by_prefill[p]
                if not any(x["action"] == "send" for x in parts):
                    # A pair that only skips joins the run of the pairs before it when they
                    # skip the same units for the same senders.
                    skipped = [{"part": x["part"], "shared_units": x["shared_units"],
                                "sent_by": x["sent_by"]} for x in parts]
                    last = replicas[-1] if replicas else None
                    if last is not None and last["decode_rank"] == d and \
                            last["prefill_ranks"][1] == p and last["parts"] == skipped:
                        last["prefill_ranks"][1] = p + 1
                    else:
                        replicas.append({"decode_rank": d, "prefill_ranks": [p, p + 1],
                                         "parts": skipped})
                    continue
                token = (sum(x["bytes_per_token"] for x in parts) if g.storage == "paged"
                         else None)
                request = sum(x["bytes_per_request"] for x in parts)
                pairs.append({"prefill_rank": p, "decode_rank": d, "bytes_per_token": token,
                              "bytes_per_request": request, "parts": parts})
                if rank_token is not None:
                    rank_token += token
                rank_request += request
            ranks.append({"decode_rank": d, "owned_units": owned, "bytes_per_token": rank_token,
                          "bytes_per_request": rank_request})
        out.append({
            "name": g.name,
            "layers": list(g.layers),
            "buffers_per_layer": g.buffers_per_layer,
            "storage": g.storage,
            "window": g.window,
            "slot_steps": steps,
            "tokens_moved": moved,
            "parts": [{"name": p.name, "unit": p.unit, "units": p.units,
                       "unit_bytes": b, "dtype": p.dtype_label(dtype, ssm_dtype, conv_dtype),
                       "held_whole": p.units == 1, "must_divide": p.must_divide}
                      for p, b in zip(g.parts, unit_bytes)],
            "pairs": pairs,
            "replicas": replicas,
            "decode_ranks": ranks,
        })
    return out
