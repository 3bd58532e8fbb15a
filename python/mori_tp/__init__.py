"""mori_tp: correct KV-cache head slices between prefill and decode engines with different
tensor-parallel sizes, for Python serving stacks.

A thin ctypes binding of ``libmori_tp`` (the C ABI of ``include/mori_tp.h``)::

    import mori_tp

    config = mori_tp.slice_config(
        prefill_tp_size=2, prefill_tp_rank=0, decode_tp_size=8, decode_tp_rank=3,
        total_kv_heads=4, page_size=16,
        src_item_len=16 * 2 * 256, dst_item_len=16 * 1 * 256,
    )
    if config.action is mori_tp.Action.SEND:
        local, remote, sizes = mori_tp.plan_segments(config, src_pages, dst_pages)

The library is found through the ``MORI_TP_LIBRARY`` environment variable (the exact file), then
inside and beside this package directory, then in the crate's ``target/release`` and
``target/debug``. Import fails with ImportError if it is missing, or if its ABI version or
struct layout differs from what this package was written for.

For RDMA transfer engines, a staged request moves a few long segments instead of one per token:
:func:`staging_for` picks the :class:`Staging`, :func:`pack_kvcache` packs on the prefill rank,
:func:`plan_transfer` gives the engine's segments and :func:`unpack_kvcache` unpacks on the
decode rank. :mod:`mori_tp.engines` drives Mooncake, NIXL and MORI-IO with them.

Any page layout (head-major HND pages, padded strides, page sizes that differ between the
sides, a partial last page): each rank describes its pages with a :class:`Layout`
(:meth:`Layout.nhd`, :meth:`Layout.hnd`), :func:`pair_config` pairs two layouts, and a
:class:`Request` names the tokens and each side's pages. :func:`pair_segments`,
:func:`pair_plan`, :func:`send_kvcache_pair`, :func:`pair_staging_for`,
:func:`pack_kvcache_pair` and :func:`unpack_kvcache_pair` take them::

    prefill = mori_tp.Layout.hnd(total_kv_heads=4, tp_size=2, tp_rank=0, page_size=16,
                                 head_bytes=256)
    decode = mori_tp.Layout.hnd(total_kv_heads=4, tp_size=8, tp_rank=1, page_size=64,
                                head_bytes=256)
    pair = mori_tp.pair_config(prefill, decode)
    request = mori_tp.Request(src_pages, dst_pages, num_tokens)
    local, remote, sizes = mori_tp.pair_segments(pair, request)

A hybrid or quantized model carries several kinds of state per sequence (full and
sliding-window KV, a per-token indexer record, scales, Mamba state slots): each is a
:class:`Group` (a pair config, a request, a staging mode, buffers), and a list of groups is one
request for :func:`groups_info`, :func:`groups_segments`, :func:`send_kvcache_groups`,
:func:`pack_kvcache_groups` and :func:`unpack_kvcache_groups`. :func:`pp_layers` maps the
layers between pipeline stages that the two engines split differently.

Page indices may be lists (or any sequence) of ints, ``array.array('i')``, or numpy integer
arrays; ``array.array('i')`` and C-contiguous numpy int32 arrays are passed to the library by
address, without a copy. numpy is optional: only ``as_arrays=True`` output, numpy staging
regions and :mod:`mori_tp.engines` need it.

The copying functions take their buffers as addresses, numpy arrays or C-contiguous device
tensors (:data:`BufferLike`: DLPack producers such as torch and CuPy tensors, and objects with
``__cuda_array_interface__``), whose byte length caps the capacity; and a stream as an int or
an object carrying one (:data:`StreamLike`). Device memory needs a GPU backend (``"cuda"``,
``"hip"``) or ``"auto"``: the host backend cannot tell a device address from a host one.
python/README.md ("Device tensors") gives the rules and the stream's precedence.

Every failure raises a :class:`MoriError` subclass whose message names the offending values.
A refused call has changed nothing: every input is validated before the first byte moves. The
one exception is :class:`GpuError`, a HIP runtime failure in the middle of a copy, after which
copies issued before it may have landed.
"""

# This file only re-exports: the code lives in the modules below, which import one another
# one way (_ffi, _errors and _tensors below _core; _core below _pool and _pair; _pair below
# _groups).
from __future__ import annotations

from . import _ffi, _tensors
from ._core import (
    __version__,
    _BACKENDS,
    _lib,
    _pages_arg,
    _raise_last,
    ABI_VERSION,
    Action,
    BackendUnavailableError,
    BufferLike,
    BufferTooSmallError,
    check_transfer,
    CopyRect,
    GpuError,
    gpu_counters,
    InternalError,
    InvalidArgumentError,
    LayoutMismatchError,
    library_path,
    library_version,
    MoriError,
    NullPointerError,
    OutOfBoundsError,
    pack_kvcache,
    PageIndices,
    plan,
    plan_segments,
    plan_transfer,
    PoolFullError,
    RankMemory,
    send_kvcache,
    slice_config,
    rank_heads,
    head_sender,
    SliceConfig,
    SliceOverflowError,
    Staging,
    staging_for,
    staging_len,
    StagingRegion,
    StreamLike,
    TopologyError,
    unpack_kvcache,
)
from ._pool import PoolInfo, PoolSlot, StagingPool
from ._pair import (
    check_pair_transfer,
    Layout,
    pack_kvcache_pair,
    pair_config,
    pair_plan,
    pair_segments,
    pair_staging_for,
    pair_staging_len,
    PairConfig,
    Request,
    send_kvcache_pair,
    unpack_kvcache_pair,
)
from ._groups import (
    check_groups_transfer,
    Group,
    GroupInfo,
    groups_info,
    groups_segments,
    GroupsTotal,
    LayerRange,
    pack_kvcache_groups,
    pp_layers,
    send_kvcache_groups,
    unpack_kvcache_groups,
)

__all__ = [
    "ABI_VERSION",
    "Action",
    "BackendUnavailableError",
    "BufferLike",
    "BufferTooSmallError",
    "CopyRect",
    "GpuError",
    "Group",
    "GroupInfo",
    "GroupsTotal",
    "InternalError",
    "InvalidArgumentError",
    "LayerRange",
    "Layout",
    "LayoutMismatchError",
    "MoriError",
    "NullPointerError",
    "OutOfBoundsError",
    "PageIndices",
    "PairConfig",
    "PoolFullError",
    "PoolInfo",
    "PoolSlot",
    "RankMemory",
    "Request",
    "SliceConfig",
    "SliceOverflowError",
    "Staging",
    "StagingPool",
    "StagingRegion",
    "StreamLike",
    "TopologyError",
    "check_groups_transfer",
    "check_pair_transfer",
    "check_transfer",
    "gpu_counters",
    "groups_info",
    "groups_segments",
    "library_path",
    "library_version",
    "pack_kvcache",
    "pack_kvcache_groups",
    "pack_kvcache_pair",
    "pair_config",
    "pair_plan",
    "pair_segments",
    "pair_staging_for",
    "pair_staging_len",
    "plan",
    "plan_segments",
    "plan_transfer",
    "pp_layers",
    "send_kvcache",
    "send_kvcache_groups",
    "send_kvcache_pair",
    "slice_config",
    "rank_heads",
    "head_sender",
    "staging_for",
    "staging_len",
    "unpack_kvcache",
    "unpack_kvcache_groups",
    "unpack_kvcache_pair",
]
