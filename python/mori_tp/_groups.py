"""A request of several groups and pipeline layer maps: :class:`Group` and the functions over a
list of groups (``mori_tp_groups_*``, ``mori_*_kvcache_groups`` and ``mori_tp_pp_layers`` in
``include/mori_tp.h``).

A hybrid or quantized model keeps several kinds of state per sequence: full-attention KV pages,
sliding-window pages, a per-token record every rank holds whole (DeepSeek V3.2's indexer
cache), per-(token, head) scales, per-request state slots whose parts are sharded differently
(a Mamba2 conv state's x, B and C). Each is a :class:`Group`: a :class:`PairConfig` of its own
two layouts, a :class:`Request` of its own pages (for a state slot: the slot index), a staging
mode and its buffers. A list of groups is one request: one segment list, one staging region per
side, one send, pack or unpack.

Built on ``_core`` and ``_pair``; ``mori_tp`` re-exports every public name: use them from
``mori_tp``. The library checks everything and names the group in every refusal; Python checks
only what ctypes would otherwise get wrong silently (an int that does not fit its C type, a
pointer list whose length is not the group's buffer count).
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

from ._core import (
    BufferLike,
    InvalidArgumentError,
    Staging,
    StagingRegion,
    StreamLike,
    _capacity,
    _copy_call,
    _ffi,
    _fill,
    _lib,
    _pointer_array,
    _raise_last,
    _region,
    _segments_out,
    _tensors,
    _unsigned,
)
from ._pair import PairConfig, Request, pair_staging_for


@dataclass(frozen=True, eq=False)
class Group:
    """One group of a request of several groups (``MoriTpGroup``): one kind of state of a
    sequence with its own pair config, pages, staging mode and buffers.

    Args:
        config: the group's :class:`PairConfig` (from :func:`pair_config` of its two layouts).
        request: its :class:`Request`: the tokens and each side's pages. A per-request state
            slot is a request of one page per side (the slot index), whose layouts have
            ``page_stride`` = the slot stride and ``offset`` = where the part starts in the slot.
        staging: how its bytes move through a transfer engine; default
            :func:`pair_staging_for` of ``config``. Both ranks must use the same.
        first_token: where the request's token 0 sits in the sequence: 0, or a sliding
            window's first token, which must be a multiple of both page sizes (the library
            refuses any other with the start rounded down in its message).
        num_buffers: the group's buffers per rank; default the length of ``src_ptrs`` (or of
            ``dst_ptrs``).
        src_ptrs, dst_ptrs: the buffers on each rank, or None where the call does not read
            them (planning reads neither; a pack reads ``src_ptrs`` of groups that stage the
            prefill side, an unpack ``dst_ptrs`` of groups that stage the decode side, a send
            both). Groups may share buffers (the parts of one state slot). Each is an address,
            a numpy array or a C-contiguous device tensor (:data:`BufferLike`); the group keeps
            their addresses (the fields hold ints) and keeps the arrays and tensors alive.
            DLPack tensors are exported once, here, for the null stream; the stream a call
            picks from ``__cuda_array_interface__`` streams is checked at the call, as is the
            memory a backend reaches. A read-only ``dst_ptrs`` tensor is refused here.
        src_capacity, dst_capacity: bytes in each buffer of each side. Default: the smallest
            tensor's bytes on that side when every buffer is an array or tensor, else 0; never
            more than a tensor's bytes.
    """

    config: PairConfig
    request: Request
    staging: Optional[Union[Staging, int]] = None
    first_token: int = 0
    num_buffers: Optional[int] = None
    src_ptrs: Optional[Sequence[BufferLike]] = None
    dst_ptrs: Optional[Sequence[BufferLike]] = None
    src_capacity: Optional[int] = None
    dst_capacity: Optional[int] = None

    def __post_init__(self) -> None:
        where = "Group"
        if not isinstance(self.config, PairConfig):
            raise TypeError(f"{where}: config must be a PairConfig, not "
                            f"{type(self.config).__name__}")
        if not isinstance(self.request, Request):
            raise TypeError(f"{where}: request must be a Request, not "
                            f"{type(self.request).__name__}")
        staging = pair_staging_for(self.config) if self.staging is None else self.staging
        try:
            staging = Staging(staging)
        except ValueError:
            # Passed through: the library refuses it with the values it accepts.
            staging = _unsigned(staging, "staging", 32, where)
        object.__setattr__(self, "staging", staging)
        object.__setattr__(self, "first_token",
                           _unsigned(self.first_token, "first_token", 64, where))
        resolved = {name: _tensors.resolve_now(getattr(self, name), name, name == "dst_ptrs",
                                               where)
                    for name in ("src_ptrs", "dst_ptrs") if getattr(self, name) is not None}
        count = self.num_buffers
        if count is None:
            if not resolved:
                raise TypeError(f"{where}: give num_buffers, or src_ptrs or dst_ptrs")
            count = len(next(iter(resolved.values())).addresses)
        count = _unsigned(count, "num_buffers", 64, where)
        object.__setattr__(self, "num_buffers", count)
        tensors = []
        for name, operand in resolved.items():
            if len(operand.addresses) != count:
                # The library would read num_buffers entries from a shorter array.
                raise InvalidArgumentError(
                    f"{where}: {name} has {len(operand.addresses)} entries for num_buffers "
                    f"{count}"
                )
            object.__setattr__(self, name, tuple(operand.addresses))
            tensors += operand.named_tensors()
        for side in ("src", "dst"):
            name, given = f"{side}_capacity", getattr(self, f"{side}_capacity")
            operand = resolved.get(f"{side}_ptrs")
            if operand is None:
                capacity = 0 if given is None else _unsigned(given, name, 64, where)
            elif given is None and operand.first_address is not None:
                capacity = 0  # addresses: the caller's capacity, 0 until given
            else:
                capacity = _capacity(operand, given, name, where)
            object.__setattr__(self, name, capacity)
        # The arrays and tensors behind the addresses (kept alive with the group), for the
        # stream and device checks of each call.
        object.__setattr__(self, "_arrays", tuple(tensors))

    def __repr__(self) -> str:
        return (f"Group(staging={self.staging!r}, first_token={self.first_token}, "
                f"num_buffers={self.num_buffers}, request={self.request!r}, "
                f"config={self.config!r})")


class GroupInfo(NamedTuple):
    """Where one group sits in its request (``MoriTpGroupInfo``)."""

    #: Index of its first segment in :func:`groups_segments`'s list.
    first_segment: int
    #: Its segments, each applied to every one of its buffers.
    num_segments: int
    #: Bytes one of its buffers moves (and stages on a staged side).
    staging_len: int
    #: Where its part starts in the prefill rank's staging region for the request (0 unless
    #: its staging is SRC or BOTH): buffer ``b`` at ``src_staging_offset + b * staging_len``.
    src_staging_offset: int
    #: The same in the decode rank's region (0 unless DST or BOTH).
    dst_staging_offset: int


class GroupsTotal(NamedTuple):
    """What a whole request of groups needs (``MoriTpGroupsTotal``)."""

    #: Entries of the request's segment list.
    num_segments: int
    #: Segments a transfer engine copies: each group's segments times its buffers.
    transfer_segments: int
    #: Bytes the request moves.
    bytes: int
    #: Bytes of the prefill rank's staging region for the request.
    src_staging_bytes: int
    #: Bytes of the decode rank's.
    dst_staging_bytes: int


class LayerRange(NamedTuple):
    """The layers a prefill and a decode pipeline stage share (``MoriTpLayerRange``): layers
    ``first_layer .. first_layer + num_layers - 1``; layer ``first_layer + i`` is local layer
    ``prefill_first_local + i`` of the prefill stage and ``decode_first_local + i`` of the
    decode stage."""

    first_layer: int
    num_layers: int
    prefill_first_local: int
    decode_first_local: int

    def layers(self) -> List[Tuple[int, int, int]]:
        """``(layer, prefill local index, decode local index)`` of every shared layer."""
        return [(self.first_layer + i, self.prefill_first_local + i,
                 self.decode_first_local + i) for i in range(self.num_layers)]


def _c_groups(groups: Sequence[Group], where: str) -> Tuple[Any, List[Any]]:
    """The ``MoriTpGroup`` array of ``groups`` and the objects it points into (keep them alive
    for the call)."""
    keep: List[Any] = []
    array = (_ffi.MoriTpGroup * len(groups))()
    for i, group in enumerate(groups):
        if not isinstance(group, Group):
            raise TypeError(f"{where}: groups[{i}] must be a Group, not {type(group).__name__}")
        c_request = group.request._as_c()
        keep.append(group.request)
        pointers = []
        for name in ("src_ptrs", "dst_ptrs"):
            values = getattr(group, name)
            if values is None:
                pointers.append(None)
                continue
            c_array = _pointer_array(values, name, where)
            keep.append(c_array)
            pointers.append(ctypes.cast(c_array, ctypes.POINTER(ctypes.c_void_p)))
        array[i] = _ffi.MoriTpGroup(
            group.config._as_c(), int(group.staging), 0, group.first_token, c_request,
            _ffi.MoriKvBuffers(pointers[0], pointers[1], group.num_buffers, group.src_capacity,
                               group.dst_capacity),
        )
    return array, keep


def groups_info(groups: Sequence[Group]) -> Tuple[List[GroupInfo], GroupsTotal]:
    """Validates a request of groups and says where each sits in it: its range of
    :func:`groups_segments`, the bytes each of its buffers moves, where its part starts in each
    side's staging region; and the request's totals. On each side, the groups that stage it own
    ``num_buffers * staging_len`` bytes each, back to back in group order. Both ranks get the
    same answer (the decode rank sizes its staging slot with ``total.dst_staging_bytes``).

    Raises:
        InvalidArgumentError: a config edited by hand, an unknown staging value, page counts
            other than ``ceil(num_tokens / page_size)``, a first_token that is not a multiple of
            both page sizes; the message starts with the group's index (``group 2: ...``).
        TopologyError, LayoutMismatchError: a group's invalid layout.
        OutOfBoundsError, NullPointerError: a negative page index; a missing page list.
    """
    where = "groups_info"
    array, _keep = _c_groups(groups, where)
    out = (_ffi.MoriTpGroupInfo * len(groups))()
    total = _ffi.MoriTpGroupsTotal()
    status = _lib.mori_tp_groups_info(array, len(groups), out, ctypes.byref(total))
    if status != _ffi.MORI_OK:
        _raise_last(status)
    infos = [GroupInfo(o.first_segment, o.num_segments, o.staging_len, o.src_staging_offset,
                       o.dst_staging_offset) for o in out]
    return infos, GroupsTotal(total.num_segments, total.transfer_segments, total.bytes,
                              total.src_staging_bytes, total.dst_staging_bytes)


def groups_segments(groups: Sequence[Group], *,
                    as_arrays: bool = False) -> Tuple[Any, Any, Any]:
    """Every group's transport segments, group after group, as ``(local_offsets,
    remote_offsets, sizes)`` (lists, or numpy ``uint64`` columns with ``as_arrays``). Group
    ``g``'s are entries ``first_segment .. first_segment + num_segments - 1`` of its
    :class:`GroupInfo`; their offsets are relative to each of its buffers' bases: the buffer
    on an unstaged side, ``region + staging offset + b * staging_len`` on a staged side.

    Raises:
        as :func:`groups_info`.
    """
    where = "groups_segments"
    array, _keep = _c_groups(groups, where)
    bound = sum(g.request.num_tokens * g.config.num_heads for g in groups)

    def fill(allocate: Any, bounded: bool) -> Tuple[Any, int]:
        return _fill(
            lambda out, capacity, needed: _lib.mori_tp_groups_segments(
                array, len(groups), out, capacity, needed),
            allocate, bound if bounded else None,
        )

    return _segments_out(fill, as_arrays, where)


def check_groups_transfer(groups: Sequence[Group], *, src_staging_capacity: int = 0,
                          dst_staging_capacity: int = 0) -> None:
    """Checks a request of groups against the memory both ranks registered, before a transfer
    engine gets its segments: each group as :func:`groups_info` checks it, every page of every
    group (staged side or not) within that side's capacity, and each rank's staging region for
    the request (``*_staging_capacity`` bytes) holding the bytes its groups stage there.

    Raises:
        the errors of :func:`groups_info`; OutOfBoundsError for a page past its capacity;
        BufferTooSmallError for a staging region too small (the message names both numbers).
    """
    where = "check_groups_transfer"
    array, _keep = _c_groups(groups, where)
    status = _lib.mori_tp_check_groups_transfer(
        array, len(groups), _unsigned(src_staging_capacity, "src_staging_capacity", 64, where),
        _unsigned(dst_staging_capacity, "dst_staging_capacity", 64, where),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)


def _tensors_of(groups: Sequence[Group]) -> List[Tuple[str, Any]]:
    """The arrays and tensors of every group, named by group, for a call's checks."""
    return [(f"group {i} {name}", buffer) for i, group in enumerate(groups)
            if isinstance(group, Group) for name, buffer in getattr(group, "_arrays", ())]


def send_kvcache_groups(groups: Sequence[Group], *, backend: str = "auto",
                        stream: StreamLike = None, synchronize: bool = False,
                        copy_kernel: Optional[bool] = None,
                        max_blocks: Optional[int] = None) -> None:
    """Copies every group of a request page to page (whatever its staging mode), as
    :func:`send_kvcache_pair` copies a pair: every group needs ``src_ptrs`` and ``dst_ptrs``.
    Everything is checked before the first byte moves: a call that raises wrote nothing.

    Raises:
        the errors of :func:`groups_info` and of :func:`send_kvcache_pair`, each naming its
        group.
    """
    where = "send_kvcache_groups"
    array, _keep = _c_groups(groups, where)
    _, options = _copy_call(where, backend, stream, synchronize, copy_kernel, max_blocks, [],
                            _tensors_of(groups))
    status = _lib.mori_tp_groups_send(array, len(groups), ctypes.byref(options))
    if status != _ffi.MORI_OK:
        _raise_last(status)


def pack_kvcache_groups(groups: Sequence[Group], staging: StagingRegion, *,
                        staging_capacity: Optional[int] = None, backend: str = "auto",
                        stream: StreamLike = None, synchronize: bool = False,
                        copy_kernel: Optional[bool] = None,
                        max_blocks: Optional[int] = None) -> None:
    """Prefill side of a staged request of groups: packs every group whose staging is SRC or
    BOTH into its part of ``staging`` (the request's region: an address, or a writable
    C-contiguous numpy array or device tensor), as :func:`pack_kvcache_pair` packs a pair.
    Groups that stage nothing here are checked and skipped. Nothing is written unless
    everything is valid.

    Raises:
        the errors of :func:`groups_info` and of :func:`pack_kvcache_pair`;
        BufferTooSmallError when the region holds less than ``total.src_staging_bytes``.
    """
    where = "pack_kvcache_groups"
    array, _keep = _c_groups(groups, where)
    (region_op,), options = _copy_call(where, backend, stream, synchronize, copy_kernel,
                                       max_blocks, [("staging", staging, True, True)],
                                       _tensors_of(groups))
    region, capacity = _region(region_op, staging_capacity, where)
    status = _lib.mori_tp_groups_pack(array, len(groups), region, capacity,
                                           ctypes.byref(options))
    if status != _ffi.MORI_OK:
        _raise_last(status)


def unpack_kvcache_groups(groups: Sequence[Group], staging: StagingRegion, *,
                          staging_capacity: Optional[int] = None, backend: str = "auto",
                          stream: StreamLike = None, synchronize: bool = False,
                          copy_kernel: Optional[bool] = None,
                          max_blocks: Optional[int] = None) -> None:
    """Decode side of a staged request of groups: once every segment has landed, unpacks every
    group whose staging is DST or BOTH from its part of ``staging`` onto its pages, as
    :func:`unpack_kvcache_pair` unpacks a pair. Groups that stage nothing here are checked and
    skipped.

    Raises:
        as :func:`pack_kvcache_groups`, with the decode side in place of the prefill side.
    """
    where = "unpack_kvcache_groups"
    array, _keep = _c_groups(groups, where)
    (region_op,), options = _copy_call(where, backend, stream, synchronize, copy_kernel,
                                       max_blocks, [("staging", staging, False, True)],
                                       _tensors_of(groups))
    region, capacity = _region(region_op, staging_capacity, where)
    status = _lib.mori_tp_groups_unpack(array, len(groups), region, capacity,
                                             ctypes.byref(options))
    if status != _ffi.MORI_OK:
        _raise_last(status)


def _layer_counts(partition: Sequence[int], name: str, where: str) -> Any:
    try:
        values = [operator.index(v) for v in partition]
    except TypeError:
        raise TypeError(f"{where}: {name} must be a sequence of ints") from None
    counts = [_unsigned(v, f"{name}[{i}]", 32, where) for i, v in enumerate(values)]
    return (ctypes.c_uint32 * len(counts))(*counts)


def pp_layers(prefill_layers: Sequence[int], decode_layers: Sequence[int], prefill_stage: int,
              decode_stage: int) -> LayerRange:
    """The layers prefill pipeline stage ``prefill_stage`` and decode stage ``decode_stage``
    share, when the engines split the model's layers into stages differently: each partition
    lists the layers of each stage in order (``[10, 12, 10]``: layers 0-9, 10-21, 22-31). The
    result says which layers, and each one's local index on both sides (how each engine numbers
    its per-layer buffers); ``num_layers`` is 0 for stages that share none.

    Raises:
        InvalidArgumentError: an empty partition, a stage of 0 layers, partitions that hold
            different numbers of layers, a stage out of range (the message names the side, the
            partitions and the numbers).
    """
    where = "pp_layers"
    prefill = _layer_counts(prefill_layers, "prefill_layers", where)
    decode = _layer_counts(decode_layers, "decode_layers", where)
    out = _ffi.MoriTpLayerRange()
    status = _lib.mori_tp_pp_layers(
        prefill, len(prefill), decode, len(decode),
        _unsigned(prefill_stage, "prefill_stage", 32, where),
        _unsigned(decode_stage, "decode_stage", 32, where), ctypes.byref(out),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return LayerRange(out.first_layer, out.num_layers, out.prefill_first_local,
                      out.decode_first_local)
