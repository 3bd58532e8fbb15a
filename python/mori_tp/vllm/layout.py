"""The parts of the vLLM connector that need no vLLM: the layout of a registered KV view, pair
actions, and what the side channel carries (re-exported by :mod:`mori_tp.vllm`)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import mori_tp
from mori_tp import Action, InvalidArgumentError, Layout, LayoutMismatchError



def local_heads(total_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds: ``H / T`` when ``T <= H``, else 1 (vLLM replicates a head over
    ``T / H`` ranks: ``ModelConfig.get_num_kv_heads`` is ``max(1, H // T)`` in vLLM 0.34.0)."""
    return max(1, total_kv_heads // tp_size)


def view_layout(layer: str, shape: Sequence[int], strides: Sequence[int], element_size: int, *,
                num_heads: int, num_states: int, content_bytes: int, total_kv_heads: int,
                tp_size: int, tp_rank: int) -> Layout:
    """The :class:`mori_tp.Layout` of one layer's KV cache view as vLLM 0.34.0 registers it.

    vLLM 0.34.0 hands a connector one view per layer, ``[B, H, N, C]``: blocks, head slots,
    states (token slots) and content, where one cell of C holds a head's K and V of one token
    (``vllm/v1/kv_cache_interface.py``: ``create_kv_cache_views`` "View a flat int8 buffer as
    one 4D [B, H, N, C] view per layer"; ``AttentionSpec.state_content_size_bytes`` is
    ``(head_size + head_size_v) * dtype size``), in the physical order of the group's
    ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``). MoRIIO reads the same view the same way
    (``moriio_layout.py``, ``get_layer_head_layout``: ``block_stride = stride[0]``,
    ``head_stride = stride[1]``, ``token_stride = stride[2]`` times the element size). So the
    layout is taken from the tensor's strides, not assumed: a page is a block
    (``page_stride = stride[0] * element_size``), a token slot a state, a head a head slot, and
    one head of one token ``C`` bytes.

    ``num_heads``, ``num_states`` and ``content_bytes`` are the layer's ``KVCacheSpec``
    (``num_heads``, ``num_states``, ``state_content_size_bytes``): the view must agree with
    them, and the head slots must be this rank's share of ``total_kv_heads``.

    Raises:
        LayoutMismatchError: a view that is not ``[B, H, N, C]`` of the spec's sizes, or whose
            head count is not this rank's share; the message names the layer and the numbers.
    """
    dims = tuple(int(s) for s in shape)
    steps = tuple(int(s) for s in strides)
    where = f"mori_tp.vllm: layer {layer}"
    if len(dims) != 4 or len(steps) != 4:
        raise LayoutMismatchError(
            f"{where}: the KV cache view has shape {dims} (strides {steps}); mori-tp takes "
            "vLLM's per-layer [blocks, heads, states, content] view (vLLM 0.34.0's "
            "create_kv_cache_views)")
    blocks, heads, states, content = dims
    if (heads, states, content * element_size) != (num_heads, num_states, content_bytes):
        raise LayoutMismatchError(
            f"{where}: the view {dims} of {element_size}-byte elements disagrees with its KV "
            f"cache spec: {num_heads} head slots, {num_states} states, {content_bytes} content "
            f"bytes")
    if steps[3] != 1:
        raise LayoutMismatchError(
            f"{where}: the content axis has stride {steps[3]} elements; one head of one token "
            "must be one contiguous run")
    want = local_heads(total_kv_heads, tp_size)
    if heads != want:
        raise LayoutMismatchError(
            f"{where}: {heads} head slots on TP rank {tp_rank} of {tp_size}, but {total_kv_heads} "
            f"KV heads give each rank {want} (packed head slots, num_head_slots, are not "
            "supported)")
    return Layout(total_kv_heads=total_kv_heads, tp_size=tp_size, tp_rank=tp_rank,
                  page_size=states, head_bytes=content * element_size,
                  page_stride=steps[0] * element_size, offset=0,
                  token_stride=steps[2] * element_size, head_stride=steps[1] * element_size)


def view_extent(shape: Sequence[int], strides: Sequence[int], element_size: int) -> int:
    """Bytes from a view's first element to just past its last: what one buffer spans."""
    last = sum((int(n) - 1) * int(s) for n, s in zip(shape, strides))
    return (last + 1) * element_size


def pair_actions(prefill: Layout, decode_layouts: Sequence[Layout]) -> List[Action]:
    """The action of prefill rank ``prefill`` towards each decode rank, by mori-tp's ownership
    rule (:func:`mori_tp.pair_config`): SEND to exactly the decode ranks whose heads this rank
    is the first holder of, SKIP_REPLICA where another prefill rank sends, NOT_PAIRED where
    they share no head."""
    return [mori_tp.pair_config(prefill, d).action for d in decode_layouts]


def layout_to_wire(layout: Layout) -> Dict[str, int]:
    return {name: getattr(layout, name) for name in Layout.__dataclass_fields__}


def layout_from_wire(data: Dict[str, Any]) -> Layout:
    try:
        return Layout(**{name: int(data[name]) for name in Layout.__dataclass_fields__})
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidArgumentError(f"mori_tp.vllm: a peer sent a malformed layout {data!r}: "
                                   f"{error}") from None


def request_id_for(request_id: str, prefill_rank: int) -> str:
    """The id one (request, prefill rank) stream carries in mori-tp's protocol: a decode rank
    receives a request from several prefill ranks when prefill's TP is larger, and a Receiver
    holds one stream per id."""
    return f"{request_id}@p{prefill_rank}"
