"""An SGLang plugin that gives SGLang's mori disaggregation backend mori-tp's head arithmetic.

Tested against SGLang 0.5.23 (REFERENCE.md, "SGLang's mori backend"). SGLang discovers it through
its own plugin mechanism: the entry point ``mori_tp = "mori_tp.sglang:register"`` in the group
``sglang.srt.plugins`` (pyproject.toml), which ``sglang.srt.plugins.load_plugins()`` runs in every
SGLang process (engine, scheduler, data-parallel controller) before the engine starts, and whose
``HookRegistry`` hooks it then applies. ``SGLANG_PLUGINS`` (a comma-separated list of plugin names)
restricts which plugins load; leave ``mori_tp`` in it. Nothing in SGLang is patched on disk.

It replaces three functions (``HookType.REPLACE``, and ``AROUND`` for the helper):

- ``sglang.srt.disaggregation.mori.conn.MoriKVManager._build_tp_slice_config(peer_info)``: on a
  prefill rank, for one decode rank (``peer_info.decode_tp_rank`` of ``decode_tp_size``), SGLang
  computes a ``TPSliceConfig``: each side's bytes per token (item length / page size), the byte
  offset of the moved heads inside a source and a destination token and their width, from
  ``compute_head_slice_params`` and ``bytes_per_token_dst // max(1, H // decode_tp_size)``
  bytes per head. Every prefill rank it is asked by sends, replicas included. Replaced by
  :func:`mori_tp.slice_config` (REFERENCE.md section 3): the same fields, plus mori-tp's action,
  so a replica pair (``Action.SKIP_REPLICA``) and an unpaired one move nothing. Layouts SGLang's
  rank mapping cannot serve are refused (below).
- ``...MoriKVManager._build_tp_slice_transfer_plan(kv_indices, dst_indices, tp_cfg)``: SGLang
  makes one ``(local offset, remote offset, size)`` write per token slot of every page pair
  (``page * item_len + slot * bytes_per_token + head offset``, the first
  ``min(len(kv_indices), len(dst_indices))`` pages). Replaced by :func:`mori_tp.plan_segments`
  on the config above: the same bytes (a run of pages is one write when the slice is the whole
  token on both sides), and no writes at all unless the pair is SEND.
- ``sglang.srt.disaggregation.common.staging_buffer.compute_head_slice_params(src_attn_tp_size,
  dst_attn_tp_size, src_tp_rank, dst_tp_rank, total_kv_heads)``: SGLang's shared helper (also
  used by its Mooncake and NIXL backends and the staging buffer) returns ``(src_head_start,
  num_heads, dst_head_start, num_heads)``, local head indices on each side. Replaced by mori-tp's
  pair for a SEND pair (``src_first_local``, ``num_heads``, ``dst_first_local``); its signature
  cannot say "send nothing", so for a replica or unpaired pair SGLang's own values are returned
  unchanged (the mori path does not call it once the slice config is replaced).

Refusals, before anything moves, as :class:`mori_tp.MoriError` subclasses whose message names
the values (SGLang's ``MoriKVManager._transfer_worker`` catches it, marks the request failed and
sends the decode rank the reason ``transfer worker raised: TopologyError("...")``):

- :class:`mori_tp.TopologyError`: prefill and decode attention-TP sizes where neither divides
  the other (prefill TP 6, decode TP 4). mori-tp itself pairs such layouts (REFERENCE.md
  section 3), but SGLang 0.5.23's decode side (``CommonKVManager._resolve_rank_mapping``) picks
  the prefill ranks it pulls from, and how many responses it waits for, by integer division
  (``P // D``, ``D // P``): it pulls from ranks that do not hold its heads and never asks others,
  so no prefill-side arithmetic can deliver the right bytes. Also: a model whose KV heads and a
  TP size divide neither way (mori-tp's own refusal).
- :class:`mori_tp.LayoutMismatchError`: item lengths that do not split into whole heads, or
  bytes per head that differ between the sides (dtype or head_dim differ), from
  :func:`mori_tp.slice_config`.
- :class:`mori_tp.InvalidArgumentError`: ``kv_args.total_kv_head_num`` unset (SGLang's fallback,
  ``kv_head_num * tp_size``, is wrong once the TP size exceeds the head count).

SGLang is imported only when :func:`register` or a replacement runs: ``import mori_tp`` and
``import mori_tp.sglang`` work without it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable, Dict, Tuple

import mori_tp

__all__ = [
    "CONN",
    "HELPER",
    "TARGETS",
    "build_tp_slice_config",
    "build_tp_slice_transfer_plan",
    "compute_head_slice_params",
    "register",
]

#: SGLang's mori backend module.
CONN = "sglang.srt.disaggregation.mori.conn"
#: SGLang's module with the shared head-slice helper.
HELPER = "sglang.srt.disaggregation.common.staging_buffer"


def _refuse_ratio(where: str, prefill_tp: int, decode_tp: int) -> None:
    """Raises TopologyError when neither TP size divides the other (SGLang's rank mapping). A
    size of 0 is left to mori_tp.slice_config, which refuses it (InvalidArgumentError)."""
    if prefill_tp <= 0 or decode_tp <= 0 or prefill_tp % decode_tp == 0 or decode_tp % prefill_tp == 0:
        return
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    raise mori_tp.TopologyError(
        f"{where}: prefill attention TP size {prefill_tp} and decode attention TP size "
        f"{decode_tp} divide neither way: SGLang's decode side "
        f"(CommonKVManager._resolve_rank_mapping) picks the prefill ranks it pulls from by "
        f"integer division ({big} // {small} = {big // small}), so some decode heads would come "
        f"from ranks that do not hold them, or from none; choose TP sizes where one is a "
        f"multiple of the other"
    )


def _total_kv_heads(kv_args: Any, where: str) -> int:
    heads = getattr(kv_args, "total_kv_head_num", 0) or 0
    if heads <= 0:
        raise mori_tp.InvalidArgumentError(
            f"{where}: kv_args.total_kv_head_num is {heads!r}: the model's KV heads before TP "
            f"are needed (SGLang's fallback, kv_head_num * tp_size, is wrong when the TP size "
            f"exceeds the head count)"
        )
    return int(heads)


def build_tp_slice_config(self: Any, peer_info: Any) -> Any:
    """Replaces ``MoriKVManager._build_tp_slice_config`` (see the module docstring): a
    ``TPSliceConfig`` with mori-tp's offsets and width, and the :class:`mori_tp.SliceConfig`
    itself as its ``mori_tp`` attribute (whose ``action`` says whether to send).

    Raises:
        TopologyError, LayoutMismatchError, InvalidArgumentError: as the module docstring says.
    """
    from sglang.srt.disaggregation.mori.conn import TPSliceConfig

    where = "mori_tp.sglang: MoriKVManager._build_tp_slice_config"
    prefill_tp = int(self.attn_tp_size)
    decode_tp = int(peer_info.decode_tp_size)
    _refuse_ratio(where, prefill_tp, decode_tp)
    config = mori_tp.slice_config(
        prefill_tp_size=prefill_tp,
        prefill_tp_rank=int(self.kv_args.engine_rank) % prefill_tp,
        decode_tp_size=decode_tp,
        decode_tp_rank=int(peer_info.decode_tp_rank) % decode_tp,
        total_kv_heads=_total_kv_heads(self.kv_args, where),
        page_size=int(self.kv_args.page_size),
        src_item_len=int(self.kv_args.kv_item_lens[0]),
        dst_item_len=int(peer_info.dst_kv_item_len),
    )
    tp_cfg = TPSliceConfig(
        page_size=config.page_size,
        src_item_len=config.src_item_len,
        dst_item_len=config.dst_item_len,
        bytes_per_token_src=config.bytes_per_token_src,
        bytes_per_token_dst=config.bytes_per_token_dst,
        src_head_slice_offset=config.src_head_slice_offset,
        dst_head_slice_offset=config.dst_head_slice_offset,
        heads_bytes_per_token_to_send=config.heads_bytes_per_token_to_send,
    )
    tp_cfg.mori_tp = config
    return tp_cfg


def build_tp_slice_transfer_plan(self: Any, kv_indices: Any, dst_indices: Any,
                                 tp_cfg: Any) -> Any:
    """Replaces ``MoriKVManager._build_tp_slice_transfer_plan`` (see the module docstring): the
    ``BatchTransferPlan`` of :func:`mori_tp.plan_segments`, empty unless the pair is SEND. Like
    SGLang's, it pairs the first ``min(len(kv_indices), len(dst_indices))`` pages.

    Raises:
        InvalidArgumentError: ``tp_cfg`` was not made by :func:`build_tp_slice_config`.
        OutOfBoundsError: a negative page index, or one outside int32.
    """
    import numpy as np
    from sglang.srt.disaggregation.mori.conn import BatchTransferPlan

    config = getattr(tp_cfg, "mori_tp", None)
    if not isinstance(config, mori_tp.SliceConfig):
        raise mori_tp.InvalidArgumentError(
            "mori_tp.sglang: MoriKVManager._build_tp_slice_transfer_plan: the TPSliceConfig "
            "carries no mori_tp.SliceConfig (it was not made by the mori_tp plugin's "
            "_build_tp_slice_config)"
        )
    limit = min(len(kv_indices), len(dst_indices))
    if config.action is not mori_tp.Action.SEND or limit == 0:
        return BatchTransferPlan([], [], [])
    local, remote, sizes = mori_tp.plan_segments(
        config, np.asarray(kv_indices[:limit]), np.asarray(dst_indices[:limit]),
        as_arrays=True)
    return BatchTransferPlan(local.tolist(), remote.tolist(), sizes.tolist())


def _heads(total_kv_heads: int, tp: int) -> int:
    return total_kv_heads // tp if tp <= total_kv_heads else 1


def compute_head_slice_params(original: Callable[..., Tuple[int, int, int, int]],
                              src_attn_tp_size: int, dst_attn_tp_size: int, src_tp_rank: int,
                              dst_tp_rank: int,
                              total_kv_heads: int) -> Tuple[int, int, int, int]:
    """Replaces ``staging_buffer.compute_head_slice_params`` (an ``AROUND`` hook, which gets
    SGLang's original first): ``(src_first_local, num_heads, dst_first_local, num_heads)`` of
    mori-tp's pair when it is SEND; SGLang's own result for a replica or unpaired pair (the
    signature has no "send nothing").

    Raises:
        TopologyError: the TP sizes divide neither way, or the heads and a TP size.
    """
    where = "mori_tp.sglang: compute_head_slice_params"
    prefill_tp, decode_tp, heads = int(src_attn_tp_size), int(dst_attn_tp_size), int(
        total_kv_heads)
    _refuse_ratio(where, prefill_tp, decode_tp)
    # One byte per head, one slot per page: the config's byte offsets are then local indices.
    for name, tp in (("src_attn_tp_size", prefill_tp), ("dst_attn_tp_size", decode_tp)):
        if tp <= 0 or heads <= 0 or (heads % tp and tp % heads):
            # mori-tp's own refusal and message.
            mori_tp.slice_config(prefill_tp_size=prefill_tp, prefill_tp_rank=0,
                                 decode_tp_size=decode_tp, decode_tp_rank=0,
                                 total_kv_heads=heads, page_size=1, src_item_len=1,
                                 dst_item_len=1)
    config = mori_tp.slice_config(
        prefill_tp_size=prefill_tp, prefill_tp_rank=int(src_tp_rank) % prefill_tp,
        decode_tp_size=decode_tp, decode_tp_rank=int(dst_tp_rank) % decode_tp,
        total_kv_heads=heads, page_size=1, src_item_len=_heads(heads, prefill_tp),
        dst_item_len=_heads(heads, decode_tp))
    if config.action is not mori_tp.Action.SEND:
        return original(src_attn_tp_size, dst_attn_tp_size, src_tp_rank, dst_tp_rank,
                        total_kv_heads)
    return (config.src_head_slice_offset, config.num_heads, config.dst_head_slice_offset,
            config.num_heads)


#: The hooks :func:`register` registers: target -> (hook, HookType name).
TARGETS: Dict[str, Tuple[Callable[..., Any], str]] = {
    f"{CONN}.MoriKVManager._build_tp_slice_config": (build_tp_slice_config, "REPLACE"),
    f"{CONN}.MoriKVManager._build_tp_slice_transfer_plan": (build_tp_slice_transfer_plan,
                                                             "REPLACE"),
    f"{HELPER}.compute_head_slice_params": (compute_head_slice_params, "AROUND"),
}


def register() -> None:
    """The plugin's entry point: registers the hooks of :data:`TARGETS` with SGLang's
    ``HookRegistry`` (``load_plugins`` applies them). The mori backend's two are registered only
    where AMD's ``mori`` module is importable (else SGLang's import of the backend would fail and
    log an error in every process that does not use it)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    mori = "mori" in sys.modules or importlib.util.find_spec("mori") is not None
    for target, (hook, kind) in TARGETS.items():
        if target.startswith(CONN) and not mori:
            continue
        HookRegistry.register(target, hook, HookType[kind])
