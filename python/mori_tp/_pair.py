"""Any page layout, page sizes that differ, partial pages: :class:`Layout`, :class:`PairConfig`,
:class:`Request` and the functions over them (``mori_tp_layout_*``, ``mori_tp_pair_*``,
``mori_tp_check_pair_transfer`` in ``include/mori_tp.h``).

Built on the helpers of ``_core``; ``mori_tp`` re-exports every public name: use them from
``mori_tp``. Everything the library checks is left to it, so that each refusal
carries the library's message; Python checks only what ctypes would otherwise get wrong
silently (an int that does not fit its C type, a page index outside int32).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

from ._core import (
    Action,
    BufferLike,
    CopyRect,
    PageIndices,
    RankMemory,
    Staging,
    StagingRegion,
    StreamLike,
    _action,
    _address_array,
    _capacity,
    _copy_call,
    _ffi,
    _fill,
    _kv_buffers,
    _lib,
    _pages_arg,
    _raise_last,
    _rects_out,
    _region,
    _segments_out,
    _staging_value,
    _unsigned,
)

if TYPE_CHECKING:  # pragma: no cover
    import numpy

_LAYOUT_BITS = {name: 32 if ctype is ctypes.c_uint32 else 64
                for name, ctype in _ffi.MoriTpLayout._fields_}


@dataclass(frozen=True)
class Layout:
    """Where one rank keeps each (token slot, head) of a page of a KV buffer
    (``MoriTpLayout``); each rank describes itself, and a connector exchanges layouts at
    handshake (``dataclasses.asdict(layout)`` and ``Layout(**fields)``).

    Local head ``j`` of slot ``t`` of page ``p`` of a buffer is the ``head_bytes`` bytes at
    ``p * page_stride + offset + t * token_stride + j * head_stride``, where ``j`` counts the
    rank's own heads (``total_kv_heads // tp_size`` of them when ``tp_size <= total_kv_heads``,
    else 1). :meth:`nhd` and :meth:`hnd` make the two layouts serving engines use; build one by
    hand (or with ``dataclasses.replace``) for padded strides, an offset, or heads that each hold
    their own run of pages. The library validates a layout in :func:`pair_config` and in every
    function that takes a :class:`PairConfig`; the header's ``MoriTpLayout`` documents the rules.
    """

    #: H: the model's KV heads before TP (1 for MLA or MQA, or for a record every rank holds
    #: whole).
    total_kv_heads: int
    #: This side's TP size.
    tp_size: int
    #: This rank, < tp_size.
    tp_rank: int
    #: Token slots per page.
    page_size: int
    #: Bytes of one head of one token slot: head_dim * dtype bytes.
    head_bytes: int
    #: Bytes from page i to page i + 1 of a buffer.
    page_stride: int
    #: Bytes from a page's start to slot 0, local head 0.
    offset: int
    #: Bytes from slot t to slot t + 1 within a page.
    token_stride: int
    #: Bytes from local head j to local head j + 1 within a slot.
    head_stride: int

    def __post_init__(self) -> None:
        for name, bits in _LAYOUT_BITS.items():
            object.__setattr__(self, name, _unsigned(getattr(self, name), name, bits, "Layout"))

    @classmethod
    def nhd(cls, total_kv_heads: int, tp_size: int, tp_rank: int, page_size: int,
            head_bytes: int) -> "Layout":
        """The token-major layout of one rank, offset 0, as SGLang and vLLM's FlashAttention
        backend keep KV: ``head_stride = head_bytes``, ``token_stride = L * head_bytes``,
        ``page_stride = page_size * L * head_bytes`` for the rank's ``L`` local heads.

        Raises:
            InvalidArgumentError: a zero tp_size, page_size or head_bytes, tp_rank >= tp_size,
                a page stride that overflows 64 bits, a value that does not fit its C type.
            TopologyError: total_kv_heads is 0, or it and tp_size divide neither way.
        """
        return cls._made(_lib.mori_tp_layout_nhd, "Layout.nhd", total_kv_heads, tp_size,
                         tp_rank, page_size, head_bytes)

    @classmethod
    def hnd(cls, total_kv_heads: int, tp_size: int, tp_rank: int, page_size: int,
            head_bytes: int) -> "Layout":
        """The head-major layout of one rank, offset 0, as vLLM keeps KV with NIXL and on
        ROCm: ``token_stride = head_bytes``, ``head_stride = page_size * head_bytes``,
        ``page_stride = L * page_size * head_bytes``. Raises as :meth:`nhd`."""
        return cls._made(_lib.mori_tp_layout_hnd, "Layout.hnd", total_kv_heads, tp_size,
                         tp_rank, page_size, head_bytes)

    @classmethod
    def _made(cls, function: Any, where: str, total_kv_heads: int, tp_size: int, tp_rank: int,
              page_size: int, head_bytes: int) -> "Layout":
        out = _ffi.MoriTpLayout()
        status = function(
            _unsigned(total_kv_heads, "total_kv_heads", 32, where),
            _unsigned(tp_size, "tp_size", 32, where),
            _unsigned(tp_rank, "tp_rank", 32, where),
            _unsigned(page_size, "page_size", 32, where),
            _unsigned(head_bytes, "head_bytes", 64, where),
            ctypes.byref(out),
        )
        if status != _ffi.MORI_OK:
            _raise_last(status)
        return cls._from_c(out)

    @classmethod
    def _from_c(cls, c_layout: _ffi.MoriTpLayout) -> "Layout":
        return cls(*(getattr(c_layout, name) for name in _LAYOUT_BITS))

    def _as_c(self) -> _ffi.MoriTpLayout:
        return _ffi.MoriTpLayout(*(getattr(self, name) for name in _LAYOUT_BITS))


@dataclass(frozen=True)
class PairConfig:
    """What a prefill rank and a decode rank move between their layouts
    (``MoriTpPairConfig``). Immutable; get one from :func:`pair_config`.

    Every function that takes one derives it again from ``src`` and ``dst`` and refuses
    (InvalidArgumentError) one whose other fields differ or whose ``reserved`` is not 0.
    """

    #: SEND, SKIP_REPLICA or NOT_PAIRED, by the same ownership rule as :func:`slice_config`.
    action: Action
    #: Global index of the first KV head moved (0 unless SEND).
    first_head: int
    #: KV heads moved per token (0 unless SEND).
    num_heads: int
    #: Local index of first_head among the prefill rank's heads (0 unless SEND).
    src_first_local: int
    #: Local index of first_head among the decode rank's heads (0 unless SEND).
    dst_first_local: int
    #: 0.
    reserved: int
    #: The prefill rank's layout, as given.
    src: Layout
    #: The decode rank's layout, as given.
    dst: Layout

    def __post_init__(self) -> None:
        where = "PairConfig"
        object.__setattr__(self, "action", _action(self.action, where))
        for name in ("first_head", "num_heads", "src_first_local", "dst_first_local",
                     "reserved"):
            object.__setattr__(self, name, _unsigned(getattr(self, name), name, 32, where))
        for name in ("src", "dst"):
            if not isinstance(getattr(self, name), Layout):
                raise TypeError(f"{where}: {name} must be a Layout, not "
                                f"{type(getattr(self, name)).__name__}")

    @classmethod
    def _from_c(cls, c_config: _ffi.MoriTpPairConfig) -> "PairConfig":
        return cls(Action(c_config.action), c_config.first_head, c_config.num_heads,
                   c_config.src_first_local, c_config.dst_first_local, c_config.reserved,
                   Layout._from_c(c_config.src), Layout._from_c(c_config.dst))

    def _as_c(self) -> _ffi.MoriTpPairConfig:
        return _ffi.MoriTpPairConfig(int(self.action), self.first_head, self.num_heads,
                                     self.src_first_local, self.dst_first_local, self.reserved,
                                     self.src._as_c(), self.dst._as_c())


@dataclass(frozen=True, eq=False)
class Request:
    """One request (``MoriTpRequest``): tokens ``0 .. num_tokens - 1`` of a sequence. Token
    ``k`` is slot ``k % page_size`` of page ``pages[k // page_size]`` on each side, with that
    side's page size, so each side lists ``ceil(num_tokens / page_size)`` pages. Only tokens
    below ``num_tokens`` move: the slots after them in a partial last page are never written.

    The page lists are :data:`PageIndices`; they are kept as ``array.array('i')`` or numpy
    int32 (an ``array.array('i')`` or C-contiguous int32 array given is kept as it is, not
    copied). The library checks the page counts against ``num_tokens`` in every call.
    """

    #: The prefill rank's pages, in request order.
    src_pages: PageIndices
    #: The decode rank's pages, in request order.
    dst_pages: PageIndices
    #: N: the request's tokens; 0 is an empty request.
    num_tokens: int

    def __post_init__(self) -> None:
        where = "Request"
        for name in ("src_pages", "dst_pages"):
            _, _, pages = _pages_arg(getattr(self, name), f"{where}: {name}")
            object.__setattr__(self, name, pages)
        object.__setattr__(self, "num_tokens",
                           _unsigned(self.num_tokens, "num_tokens", 64, where))

    def __repr__(self) -> str:
        return (f"Request(src_pages={[int(p) for p in self.src_pages]}, "
                f"dst_pages={[int(p) for p in self.dst_pages]}, num_tokens={self.num_tokens})")

    def _as_c(self) -> _ffi.MoriTpRequest:
        # The page arrays are already int32: these return them, with their current address.
        src, num_src, _ = _pages_arg(self.src_pages, "Request: src_pages")
        dst, num_dst, _ = _pages_arg(self.dst_pages, "Request: dst_pages")
        return _ffi.MoriTpRequest(src, num_src, dst, num_dst, self.num_tokens)


def _c_pair(config: PairConfig, where: str) -> _ffi.MoriTpPairConfig:
    if not isinstance(config, PairConfig):
        raise TypeError(f"{where}: config must be a PairConfig, not {type(config).__name__}")
    return config._as_c()


def _c_request(request: Request, where: str) -> _ffi.MoriTpRequest:
    if not isinstance(request, Request):
        raise TypeError(f"{where}: request must be a Request, not {type(request).__name__}")
    return request._as_c()


def pair_config(prefill: Layout, decode: Layout) -> PairConfig:
    """What prefill rank ``prefill.tp_rank`` moves to decode rank ``decode.tp_rank``: the
    action and heads by the ownership rule (as :func:`slice_config`), and where the first moved
    head sits among each rank's local heads. Page sizes, strides and offsets may differ between
    the sides.

    Raises:
        InvalidArgumentError: a zero size, a rank out of range, a layout whose extent overflows
            64 bits (the message names the factors).
        TopologyError: a side's H and TP size divide neither way, H is 0, or the two layouts'
            total_kv_heads differ.
        LayoutMismatchError: a layout's heads, slots or pages overlap (the message names the
            fields), or the two head_bytes differ (dtype or head_dim).
    """
    where = "pair_config"
    for name, layout in (("prefill", prefill), ("decode", decode)):
        if not isinstance(layout, Layout):
            raise TypeError(f"{where}: {name} must be a Layout, not {type(layout).__name__}")
    c_prefill, c_decode = prefill._as_c(), decode._as_c()
    out = _ffi.MoriTpPairConfig()
    status = _lib.mori_tp_pair_config(ctypes.byref(c_prefill), ctypes.byref(c_decode),
                                      ctypes.byref(out))
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return PairConfig._from_c(out)


def _elements(config: PairConfig, request: Request) -> int:
    """The request's (token, moved head) elements: no segment list or plan has more entries."""
    return request.num_tokens * config.num_heads


def pair_segments(
    config: PairConfig,
    request: Request,
    staging: Union[Staging, int] = Staging.NONE,
    *,
    as_arrays: bool = False,
) -> Tuple[Any, Any, Any]:
    """The transport's segments for one request and staging mode, as ``(local_offsets,
    remote_offsets, sizes)`` like :func:`plan_transfer`: what an RDMA engine copies, for every
    buffer, from the prefill rank to the decode rank.

    Offsets are relative to each buffer's base: on an unstaged side its page buffer, on a
    staged side ``region + b * pair_staging_len(config, request.num_tokens)`` for buffer ``b``.
    The same list applies to every buffer. The library takes the request's elements (one head
    of one token) token-major or head-major in chunks of a page (either side's) or of the whole
    request, whichever gives the fewest segments: an HND page holding exactly the moved heads is
    one segment, and so is a run of such pages. BOTH is one segment per buffer.

    Args:
        config: from :func:`pair_config`.
        request: the :class:`Request`.
        staging: a :class:`Staging` (or its value); default NONE, pages to pages.
        as_arrays: numpy ``uint64`` columns instead of lists, as for :func:`plan_segments`.

    Raises:
        InvalidArgumentError: an unknown staging value; page counts other than
            ``ceil(num_tokens / page_size)`` (the message names the count, N and the page
            size); a config whose fields differ from its layouts'.
        TopologyError, LayoutMismatchError: an invalid layout, as for :func:`pair_config`.
        OutOfBoundsError: a negative page index, or, with heads outside pages, a page past its
            head's run.
        ImportError: ``as_arrays=True`` without numpy installed.
    """
    where = "pair_segments"
    c_config, c_request = _c_pair(config, where), _c_request(request, where)
    value = _staging_value(staging, where)

    def fill(allocate: Any, bounded: bool) -> Tuple[Any, int]:
        return _fill(
            lambda out, capacity, needed: _lib.mori_tp_pair_segments(
                ctypes.byref(c_config), ctypes.byref(c_request), value, out, capacity, needed),
            allocate, _elements(config, request) if bounded else None,
        )

    return _segments_out(fill, as_arrays, where)


def pair_plan(
    config: PairConfig,
    request: Request,
    *,
    as_arrays: bool = False,
) -> Union[List[CopyRect], "numpy.ndarray"]:
    """The page-to-page 2D copies of one request (one ``hipMemcpy2DAsync`` each): the segments
    of an order (as :func:`pair_segments` defines them, with NONE), grouped greedily into
    :class:`CopyRect` runs of equal width whose offsets advance by constant, true pitches. The
    order is, among those whose segments are fewest, the one whose rects are fewest (the first
    on a tie), so never more rects than segments.

    Args:
        config, request: as for :func:`pair_segments`.
        as_arrays: one numpy ``uint64`` array of shape ``(n, 6)`` instead of a list, as for
            :func:`plan`.

    Raises:
        as :func:`pair_segments`.
    """
    where = "pair_plan"
    c_config, c_request = _c_pair(config, where), _c_request(request, where)

    def fill(allocate: Any, bounded: bool) -> Tuple[Any, int]:
        return _fill(
            lambda out, capacity, needed: _lib.mori_tp_pair_plan(
                ctypes.byref(c_config), ctypes.byref(c_request), out, capacity, needed),
            allocate, _elements(config, request) if bounded else None,
        )

    return _rects_out(fill, as_arrays, where)


def pair_staging_for(config: PairConfig) -> Staging:
    """The staging that gives the transport the fewest segments for this pair, from the config
    alone, so that both ranks agree without exchanging pages. NONE when the pair is not SEND,
    or when both sides hold exactly the moved heads in the same order; otherwise each side that
    holds anything else (or in another order) is staged, preferring to stage one side.

    Raises:
        InvalidArgumentError, TopologyError, LayoutMismatchError: a config as
            :func:`pair_segments` refuses it.
    """
    c_config = _c_pair(config, "pair_staging_for")
    out = ctypes.c_uint32()
    status = _lib.mori_tp_pair_staging_for(ctypes.byref(c_config), ctypes.byref(out))
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return Staging(out.value)


def pair_staging_len(config: PairConfig, num_tokens: int) -> int:
    """Bytes one buffer occupies in a staging region for a request of ``num_tokens`` tokens:
    ``num_tokens * num_heads * head_bytes`` (0 unless SEND). A region for ``n`` buffers needs
    ``n * pair_staging_len(config, num_tokens)`` bytes; buffer ``b``'s part starts at
    ``b * pair_staging_len(config, num_tokens)``.

    Raises:
        InvalidArgumentError: the length overflows uint64, num_tokens is negative, or a config
            as :func:`pair_segments` refuses it.
    """
    where = "pair_staging_len"
    c_config = _c_pair(config, where)
    out = ctypes.c_uint64()
    status = _lib.mori_tp_pair_staging_len(
        ctypes.byref(c_config), _unsigned(num_tokens, "num_tokens", 64, where),
        ctypes.byref(out),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return out.value


def check_pair_transfer(
    config: PairConfig,
    request: Request,
    staging: Union[Staging, int],
    *,
    prefill: RankMemory,
    decode: RankMemory,
) -> None:
    """Checks a pair transfer against the memory both ranks registered, before an engine gets
    its segments (an engine copies whatever it is given): the config and request as
    :func:`pair_segments` checks them, equal buffer counts, every page (staged side or not)
    within its side's buffer capacity, and each staged side's staging region holding
    ``num_buffers * pair_staging_len`` bytes.

    Raises:
        InvalidArgumentError: buffer counts differ, an unknown staging value, a bad config or
            page counts.
        OutOfBoundsError: a page is negative or ends past its side's capacity.
        BufferTooSmallError: a staged side's region is smaller than the request needs (the
            message names the side and both numbers).
    """
    where = "check_pair_transfer"
    c_config, c_request = _c_pair(config, where), _c_request(request, where)
    value = _staging_value(staging, where)
    c_prefill = RankMemory(*prefill)._as_c("prefill", where)
    c_decode = RankMemory(*decode)._as_c("decode", where)
    status = _lib.mori_tp_check_pair_transfer(
        ctypes.byref(c_config), ctypes.byref(c_request), value,
        ctypes.byref(c_prefill), ctypes.byref(c_decode),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)


def send_kvcache_pair(
    config: PairConfig,
    src_ptrs: Sequence[BufferLike],
    dst_ptrs: Sequence[BufferLike],
    *,
    src_capacity: Optional[int] = None,
    dst_capacity: Optional[int] = None,
    request: Request,
    backend: str = "auto",
    stream: StreamLike = None,
    synchronize: bool = False,
    copy_kernel: Optional[bool] = None,
    max_blocks: Optional[int] = None,
) -> None:
    """Copies one request between any two layouts: for every buffer, every token below
    ``request.num_tokens`` and every moved head, the prefill rank's bytes of that head land on
    the decode rank's; no other destination byte changes.

    Everything is validated before the first byte moves: a call that raises wrote nothing. A
    config that is not SEND passes the same checks and moves nothing.

    Args:
        config: from :func:`pair_config`.
        src_ptrs, dst_ptrs: both ranks' buffers (addresses, numpy arrays or C-contiguous
            device tensors), as for :func:`send_kvcache`.
        src_capacity, dst_capacity: bytes in each buffer; every page must end within them.
            Default: the smallest tensor's bytes on that side (required with addresses).
        request: the :class:`Request`.
        backend, stream, synchronize, copy_kernel: as for :func:`send_kvcache`.

    Raises:
        the errors of :func:`pair_segments` and of :func:`send_kvcache`.
    """
    where = "send_kvcache_pair"
    c_config, c_request = _c_pair(config, where), _c_request(request, where)
    (src_op, dst_op), options = _copy_call(
        where, backend, stream, synchronize, copy_kernel, max_blocks,
        [("src_ptrs", src_ptrs, False, False), ("dst_ptrs", dst_ptrs, True, False)])
    buffers, _arrays = _kv_buffers(src_op, dst_op, src_capacity, dst_capacity, where)
    status = _lib.mori_tp_pair_send(ctypes.byref(c_config), ctypes.byref(buffers),
                                         ctypes.byref(c_request), ctypes.byref(options))
    if status != _ffi.MORI_OK:
        _raise_last(status)


def pack_kvcache_pair(
    config: PairConfig,
    staging_mode: Union[Staging, int],
    src_ptrs: Sequence[BufferLike],
    staging: StagingRegion,
    *,
    src_capacity: Optional[int] = None,
    request: Request,
    staging_capacity: Optional[int] = None,
    backend: str = "auto",
    stream: StreamLike = None,
    synchronize: bool = False,
    copy_kernel: Optional[bool] = None,
    max_blocks: Optional[int] = None,
) -> None:
    """Prefill side of a staged pair transfer (SRC or BOTH): copies the moved heads of every
    token of every buffer into the staging region, buffer ``b`` at ``b *
    pair_staging_len(config, request.num_tokens)``, in the region's order for
    ``staging_mode``. Both ranks pass the request's mode: it fixes that order.

    Everything is checked before the first byte moves; a call that raises wrote nothing.

    Args:
        config: from :func:`pair_config`.
        staging_mode: SRC or BOTH (anything else is refused by the library).
        src_ptrs: the prefill rank's buffers (addresses, arrays or tensors), as for
            :func:`send_kvcache`.
        staging: the staging region: an address, or a writable C-contiguous numpy array or
            device tensor.
        src_capacity: bytes in each source buffer (default: the smallest tensor's bytes).
        request: the :class:`Request` (both page lists are checked).
        staging_capacity: bytes of the region (default for an array or tensor: its bytes, and
            never more); it must hold
            ``len(src_ptrs) * pair_staging_len(config, request.num_tokens)`` bytes.
        backend, stream, synchronize, copy_kernel: as for :func:`send_kvcache`.

    Raises:
        InvalidArgumentError: a staging_mode other than SRC or BOTH; the errors of
            :func:`pair_segments` and of :func:`pack_kvcache`.
        BufferTooSmallError: the region is smaller than the request needs.
    """
    where = "pack_kvcache_pair"
    c_config, c_request = _c_pair(config, where), _c_request(request, where)
    mode = _unsigned(staging_mode, "staging_mode", 32, where)
    (src_op, region_op), options = _copy_call(
        where, backend, stream, synchronize, copy_kernel, max_blocks,
        [("src_ptrs", src_ptrs, False, False), ("staging", staging, True, True)])
    region, capacity = _region(region_op, staging_capacity, where)
    pointers = _address_array(src_op)
    status = _lib.mori_tp_pair_pack(
        ctypes.byref(c_config), mode,
        ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p)), len(pointers),
        _capacity(src_op, src_capacity, "src_capacity", where), ctypes.byref(c_request),
        region, capacity, ctypes.byref(options),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)


def unpack_kvcache_pair(
    config: PairConfig,
    staging_mode: Union[Staging, int],
    staging: StagingRegion,
    dst_ptrs: Sequence[BufferLike],
    *,
    dst_capacity: Optional[int] = None,
    request: Request,
    staging_capacity: Optional[int] = None,
    backend: str = "auto",
    stream: StreamLike = None,
    synchronize: bool = False,
    copy_kernel: Optional[bool] = None,
    max_blocks: Optional[int] = None,
) -> None:
    """Decode side of a staged pair transfer (DST or BOTH): copies the staging region onto the
    moved heads of every token of every buffer, once the transport has written every segment
    of :func:`pair_segments` with the same mode. Only tokens below ``request.num_tokens`` are
    written.

    Args:
        config: from :func:`pair_config` (the decode rank derives the same one).
        staging_mode: DST or BOTH (anything else is refused by the library).
        staging: the staging region: an address, or a C-contiguous numpy array or device
            tensor.
        dst_ptrs: the decode rank's buffers (addresses, writable arrays or tensors).
        dst_capacity: bytes in each destination buffer (default: the smallest tensor's bytes).
        request: the :class:`Request` (both page lists are checked).
        staging_capacity: bytes of the region (default for an array or tensor: its bytes, and
            never more).
        backend, stream, synchronize, copy_kernel: as for :func:`send_kvcache`.

    Raises:
        as :func:`pack_kvcache_pair`, with dst in place of src.
    """
    where = "unpack_kvcache_pair"
    c_config, c_request = _c_pair(config, where), _c_request(request, where)
    mode = _unsigned(staging_mode, "staging_mode", 32, where)
    (region_op, dst_op), options = _copy_call(
        where, backend, stream, synchronize, copy_kernel, max_blocks,
        [("staging", staging, False, True), ("dst_ptrs", dst_ptrs, True, False)])
    region, capacity = _region(region_op, staging_capacity, where)
    pointers = _address_array(dst_op)
    status = _lib.mori_tp_pair_unpack(
        ctypes.byref(c_config), mode, region, capacity,
        ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p)), len(pointers),
        _capacity(dst_op, dst_capacity, "dst_capacity", where), ctypes.byref(c_request),
        ctypes.byref(options),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)
