"""The uniform API (REFERENCE.md sections 4 to 6) and the helpers every module of the package
shares: the loaded library, its errors, page lists, output arrays, buffers and backends.
``mori_tp`` re-exports every public name; import them from there.
"""


from __future__ import annotations

import array
import ctypes
import enum
import operator
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    NamedTuple,
    NoReturn,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from . import _ffi, _tensors
from ._errors import (
    BackendUnavailableError,
    BufferTooSmallError,
    GpuError,
    InternalError,
    InvalidArgumentError,
    LayoutMismatchError,
    MoriError,
    NullPointerError,
    OutOfBoundsError,
    PoolFullError,
    SliceOverflowError,
    TopologyError,
    error_for,
)

try:  # numpy is optional: used when the caller passes numpy arrays or asks for array output.
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None  # type: ignore[assignment]

if TYPE_CHECKING:  # pragma: no cover
    import numpy


_lib, _library_path = _ffi.load()

#: The MORI_TP_ABI_VERSION this package speaks; the loaded library was checked to match.
ABI_VERSION: int = _ffi.ABI_VERSION

#: Path of the libmori_tp that was loaded.
library_path: str = str(_library_path)

_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1

if array.array("i").itemsize != 4 or array.array("Q").itemsize != 8:  # pragma: no cover
    raise ImportError("mori_tp: needs array typecodes 'i' of 4 bytes and 'Q' of 8 bytes")

#: Page indices: a sequence of ints, an ``array.array('i')``, or a 1-D numpy integer array.
PageIndices = Union[Sequence[int], "array.array[int]", "numpy.ndarray"]

#: One buffer of a copying call: its address as an int (``tensor.data_ptr()``), a C-contiguous
#: numpy array, or a C-contiguous tensor with ``__dlpack__`` / ``__dlpack_device__`` (torch,
#: CuPy, JAX) or ``__cuda_array_interface__``. An array or tensor gives its byte length, which
#: caps (and by default is) the call's capacity.
BufferLike = Union[int, "numpy.ndarray", Any]

#: A stream: a ``hipStream_t`` / ``cudaStream_t`` as an int, or an object carrying one (a
#: ``torch.cuda.Stream``'s ``cuda_stream``, a CuPy ``Stream``'s ``ptr``, ``__cuda_stream__()``,
#: or the stream a tensor's ``__cuda_array_interface__`` carries); None: see
#: :func:`send_kvcache`.
StreamLike = Optional[Any]


def library_version() -> str:
    """The loaded library's version (``mori_tp_version()``), e.g. ``"0.1.0"``."""
    return _lib.mori_tp_version().decode()


__version__: str = library_version()


class Action(enum.IntEnum):
    """What a (prefill rank, decode rank) pair does (``MoriTpAction``). Only SEND moves bytes."""

    #: The two ranks share no KV head.
    NOT_PAIRED = 0
    #: The prefill rank is the one that sends the heads it shares with the decode rank.
    SEND = 1
    #: The ranks share heads, but another prefill rank (a replica) sends them.
    SKIP_REPLICA = 2


def _raise_last(status: int) -> NoReturn:
    """Raises the exception for a failing status with this thread's last library message."""
    message = _lib.mori_tp_last_error_message().decode("utf-8", "replace")
    raise error_for(status, message)


def _unsigned(value: Any, name: str, bits: int, where: str) -> int:
    """``value`` as an int that fits ``uint<bits>_t``: ctypes would silently wrap it otherwise."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: {name} must be an int, not {type(value).__name__}") from None
    if not 0 <= number < (1 << bits):
        raise InvalidArgumentError(
            f"{where}: {name} {number} does not fit in uint{bits}_t (0..{(1 << bits) - 1})"
        )
    return number


def _action(value: Any, where: str) -> Action:
    """``value`` as an :class:`Action`; a number outside the enum is refused here, since the
    frozen config would otherwise hold something that is not an Action."""
    if isinstance(value, Action):
        return value
    number = operator.index(value)
    try:
        return Action(number)
    except ValueError:
        raise InvalidArgumentError(
            f"{where}: action {number} is not an Action (0 NOT_PAIRED, 1 SEND, 2 SKIP_REPLICA)"
        ) from None


_U32_FIELDS = ("page_size", "first_head", "num_heads")
_U64_FIELDS = (
    "src_item_len",
    "dst_item_len",
    "bytes_per_token_src",
    "bytes_per_token_dst",
    "src_head_slice_offset",
    "dst_head_slice_offset",
    "heads_bytes_per_token_to_send",
)


@dataclass(frozen=True)
class SliceConfig:
    """What one (prefill rank, decode rank) pair moves inside every token
    (``MoriTpSliceConfig``). Immutable; get one from :func:`slice_config`.

    A config built or edited by hand (for example with ``dataclasses.replace``) is re-validated
    by every function that takes one, and refused if its fields disagree.
    """

    #: SEND, SKIP_REPLICA or NOT_PAIRED.
    action: Action
    #: Tokens per page.
    page_size: int
    #: Global index of the first KV head moved (0 when not SEND).
    first_head: int
    #: KV heads moved per token (0 when not SEND).
    num_heads: int
    #: Bytes of one source page (``page_size * bytes_per_token_src``).
    src_item_len: int
    #: Bytes of one destination page.
    dst_item_len: int
    #: Bytes of one source token: the source row pitch.
    bytes_per_token_src: int
    #: Bytes of one destination token: the destination row pitch.
    bytes_per_token_dst: int
    #: Byte offset of the slice inside a source token (0 when not SEND).
    src_head_slice_offset: int
    #: Byte offset of the slice inside a destination token (0 when not SEND).
    dst_head_slice_offset: int
    #: Slice width in bytes, ``num_heads * bytes_per_head`` (0 when not SEND).
    heads_bytes_per_token_to_send: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", _action(self.action, "SliceConfig"))
        for names, bits in ((_U32_FIELDS, 32), (_U64_FIELDS, 64)):
            for name in names:
                value = _unsigned(getattr(self, name), name, bits, "SliceConfig")
                object.__setattr__(self, name, value)

    def _as_c(self) -> _ffi.MoriTpSliceConfig:
        return _ffi.MoriTpSliceConfig(
            int(self.action),
            self.page_size,
            self.first_head,
            self.num_heads,
            self.src_item_len,
            self.dst_item_len,
            self.bytes_per_token_src,
            self.bytes_per_token_dst,
            self.src_head_slice_offset,
            self.dst_head_slice_offset,
            self.heads_bytes_per_token_to_send,
        )


class CopyRect(NamedTuple):
    """One strided 2D copy (``MoriCopyRect``, the arguments of one ``hipMemcpy2DAsync``):
    ``height`` rows of ``width`` bytes, row ``r`` read at ``src_offset + r * src_pitch`` and
    written at ``dst_offset + r * dst_pitch``. Offsets are relative to each buffer's base."""

    src_offset: int
    dst_offset: int
    src_pitch: int
    dst_pitch: int
    width: int
    height: int


def rank_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> Tuple[int, int]:
    """The heads rank ``tp_rank`` of an engine of TP size ``tp_size`` holds, as ``(first, end)``
    (REFERENCE.md section 3; ``mori_tp_rank_heads``).

    Raises:
        InvalidArgumentError: ``tp_size`` 0, ``tp_rank`` not below it, a value that does not fit
            ``uint32_t``.
        TopologyError: ``total_kv_heads`` 0, or it and ``tp_size`` divide neither way.
    """
    where = "rank_heads"
    first, count = ctypes.c_uint32(), ctypes.c_uint32()
    status = _lib.mori_tp_rank_heads(
        _unsigned(total_kv_heads, "total_kv_heads", 32, where),
        _unsigned(tp_size, "tp_size", 32, where),
        _unsigned(tp_rank, "tp_rank", 32, where),
        ctypes.byref(first),
        ctypes.byref(count),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return first.value, first.value + count.value


def head_sender(total_kv_heads: int, prefill_tp_size: int, decode_tp_size: int,
                decode_tp_rank: int, head: int) -> int:
    """The prefill rank that sends ``head`` to decode rank ``decode_tp_rank``, which holds it
    (REFERENCE.md section 3; ``mori_tp_head_sender``): the rank whose :func:`slice_config` with
    that decode rank is ``Action.SEND`` for the head.

    Raises:
        InvalidArgumentError: a zero TP size, a rank or head out of range, a head the decode
            rank does not hold, a value that does not fit ``uint32_t``.
        TopologyError: ``total_kv_heads`` 0, or it and a TP size divide neither way.
    """
    where = "head_sender"
    sender = ctypes.c_uint32()
    status = _lib.mori_tp_head_sender(
        _unsigned(total_kv_heads, "total_kv_heads", 32, where),
        _unsigned(prefill_tp_size, "prefill_tp_size", 32, where),
        _unsigned(decode_tp_size, "decode_tp_size", 32, where),
        _unsigned(decode_tp_rank, "decode_tp_rank", 32, where),
        _unsigned(head, "head", 32, where),
        ctypes.byref(sender),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return sender.value


def slice_config(
    *,
    prefill_tp_size: int,
    prefill_tp_rank: int,
    decode_tp_size: int,
    decode_tp_rank: int,
    total_kv_heads: int,
    page_size: int,
    src_item_len: int,
    dst_item_len: int,
) -> SliceConfig:
    """The slice prefill rank ``prefill_tp_rank`` moves to decode rank ``decode_tp_rank``.

    Args:
        prefill_tp_size: P, the prefill engine's tensor-parallel size.
        prefill_tp_rank: p, the sending prefill rank (< P).
        decode_tp_size: D, the decode engine's tensor-parallel size.
        decode_tp_rank: d, the receiving decode rank (< D).
        total_kv_heads: H, the model's KV heads before TP (``num_key_value_heads``; 1 for MLA
            and MQA). Each TP size must divide H or be a multiple of it.
        page_size: tokens per page, the same on both sides.
        src_item_len: bytes of one page of one layer buffer on rank p.
        dst_item_len: bytes of one page of one layer buffer on rank d.

    Returns:
        The pair's :class:`SliceConfig`. Exactly one prefill rank gets ``Action.SEND`` for each
        (decode rank, head); the others get SKIP_REPLICA or NOT_PAIRED and move nothing.

    Raises:
        InvalidArgumentError: a zero size or length, a rank out of range, a value that does not
            fit its C type.
        TopologyError: H and a TP size divide neither way, or H is 0.
        LayoutMismatchError: an item length that does not split into page_size tokens of whole
            heads, or bytes per head that differ between the sides (dtype or head_dim differ).
    """
    where = "slice_config"
    params = _ffi.MoriTpSliceParams(
        _unsigned(prefill_tp_size, "prefill_tp_size", 32, where),
        _unsigned(prefill_tp_rank, "prefill_tp_rank", 32, where),
        _unsigned(decode_tp_size, "decode_tp_size", 32, where),
        _unsigned(decode_tp_rank, "decode_tp_rank", 32, where),
        _unsigned(total_kv_heads, "total_kv_heads", 32, where),
        _unsigned(page_size, "page_size", 32, where),
        _unsigned(src_item_len, "src_item_len", 64, where),
        _unsigned(dst_item_len, "dst_item_len", 64, where),
    )
    out = _ffi.MoriTpSliceConfig()
    status = _lib.mori_tp_slice_config(ctypes.byref(params), ctypes.byref(out))
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return SliceConfig(
        Action(out.action),
        out.page_size,
        out.first_head,
        out.num_heads,
        out.src_item_len,
        out.dst_item_len,
        out.bytes_per_token_src,
        out.bytes_per_token_dst,
        out.src_head_slice_offset,
        out.dst_head_slice_offset,
        out.heads_bytes_per_token_to_send,
    )


def _first_outside_int32(values: Any, name: str) -> OutOfBoundsError:
    for position, value in enumerate(values):
        number = operator.index(value)
        if not _INT32_MIN <= number <= _INT32_MAX:
            return OutOfBoundsError(
                f"{name}[{position}] = {number} does not fit in int32 (page indices are int32_t)"
            )
    return OutOfBoundsError(f"{name}: a page index does not fit in int32")


def _numpy_pages(pages: "numpy.ndarray", name: str) -> Tuple[int, int, Any]:
    if pages.ndim != 1:
        raise InvalidArgumentError(f"{name} must be one-dimensional, not of shape {pages.shape}")
    if pages.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, not {pages.dtype}")
    if pages.dtype != _np.int32 or not pages.flags.c_contiguous:
        # Checked before converting, because the conversion would wrap large values silently.
        if pages.dtype.itemsize >= 4 and pages.size:
            outside = pages > _INT32_MAX
            if pages.dtype.kind == "i":
                outside |= pages < _INT32_MIN
            if outside.any():
                first = int(_np.flatnonzero(outside)[0])
                raise OutOfBoundsError(
                    f"{name}[{first}] = {int(pages[first])} does not fit in int32 "
                    "(page indices are int32_t)"
                )
        pages = _np.ascontiguousarray(pages, dtype=_np.int32)
    return pages.__array_interface__["data"][0], len(pages), pages


def _pages_arg(pages: PageIndices, name: str) -> Tuple[int, int, Any]:
    """(address, length, owner) of ``pages`` as contiguous int32; ``owner`` keeps the memory
    alive. ``array.array('i')`` and contiguous numpy int32 arrays are used in place."""
    if _np is not None and isinstance(pages, _np.ndarray):
        return _numpy_pages(pages, name)
    if isinstance(pages, (str, bytes, bytearray)):
        # array.array would read bytes as raw int32 values.
        raise TypeError(f"{name} must be a sequence of ints, not {type(pages).__name__}")
    if not (isinstance(pages, array.array) and pages.typecode == "i"):
        try:
            pages = array.array("i", pages)
        except OverflowError:
            raise _first_outside_int32(pages, name) from None
        except TypeError as error:
            raise TypeError(f"{name} must be a sequence of ints: {error}") from None
    address, length = pages.buffer_info()
    return address, length, pages


def _page_pairs(
    src_pages: PageIndices, dst_pages: PageIndices, where: str
) -> Tuple[int, int, int, Tuple[Any, Any]]:
    src_address, src_len, src_owner = _pages_arg(src_pages, f"{where}: src_pages")
    dst_address, dst_len, dst_owner = _pages_arg(dst_pages, f"{where}: dst_pages")
    if src_len != dst_len:
        raise InvalidArgumentError(
            f"{where}: {src_len} source pages but {dst_len} destination pages "
            "(they are paired one to one)"
        )
    return src_address, dst_address, src_len, (src_owner, dst_owner)


def _c_config(config: SliceConfig, where: str) -> _ffi.MoriTpSliceConfig:
    if not isinstance(config, SliceConfig):
        raise TypeError(f"{where}: config must be a SliceConfig, not {type(config).__name__}")
    return config._as_c()


def _fill(call: Callable[[Optional[int], int, Any], int],
          allocate: Callable[[int], Tuple[Any, Any]],
          upper_bound: Optional[int] = None) -> Tuple[Any, int]:
    """Runs a plan function, ``call(out, capacity, out_len_ref)``, into ``allocate(n)``'s
    buffer; returns ``(buffer, entries)``.

    With an ``upper_bound`` on the entries (for allocators whose buffers cost nothing until
    written, such as ``numpy.empty``) one call into a buffer that large does; otherwise a size
    query comes first, so that the buffer is exactly as large as the plan.
    """
    needed = ctypes.c_size_t()
    if upper_bound is not None and upper_bound <= _SPECULATIVE_ENTRIES:
        capacity = upper_bound
    else:
        status = call(None, 0, ctypes.byref(needed))
        if status not in (_ffi.MORI_OK, _ffi.MORI_ERR_BUFFER_TOO_SMALL):
            _raise_last(status)
        capacity = needed.value
    out, address = allocate(capacity)
    status = call(address if capacity else None, capacity, ctypes.byref(needed))
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return out, needed.value


def _plan_into(function: Any, config: SliceConfig, src_pages: PageIndices,
               dst_pages: PageIndices, allocate: Any, where: str,
               upper_bound: Optional[Callable[[int], int]] = None) -> Tuple[Any, int]:
    """:func:`_fill` for a uniform plan function of ``(config, src, dst, num_pages, ...)``;
    ``upper_bound(num_pages)`` bounds its entries."""
    c_config = _c_config(config, where)
    src, dst, num_pages, _owners = _page_pairs(src_pages, dst_pages, where)
    return _fill(
        lambda out, capacity, needed: function(ctypes.byref(c_config), src, dst, num_pages, out,
                                               capacity, needed),
        allocate, None if upper_bound is None else upper_bound(num_pages),
    )


def _trimmed(out: "numpy.ndarray", count: int) -> "numpy.ndarray":
    """The first ``count`` rows, in an array of their own when the bound reserved more (a
    copy of the few entries actually written, so the reservation is released)."""
    return out if len(out) == count else out[:count].copy()


# Above this many entries the exact size is asked for first instead of reserving the bound.
_SPECULATIVE_ENTRIES = 1 << 24


def _require_numpy(where: str) -> None:
    if _np is None:
        raise ImportError(
            f"{where}(as_arrays=True) needs numpy, which is not installed "
            "(pip install numpy, or use the default list output)"
        )


def _numpy_allocate(columns: int) -> Callable[[int], Tuple[Any, Any]]:
    def allocate(count: int) -> Tuple[Any, Any]:
        # np.empty costs nothing per entry until the library writes it.
        out = _np.empty((count, columns), dtype=_np.uint64)
        return out, out.__array_interface__["data"][0]

    return allocate


def _words_allocate(columns: int) -> Callable[[int], Tuple[Any, Any]]:
    def allocate(count: int) -> Tuple[Any, Any]:
        # Entries of ``columns`` uint64_t fields (MoriCopyRect: 6, MoriSegment: 3) are
        # ``columns * count`` 'Q' items, written in place.
        words = array.array("Q", [0]) * (columns * count)
        return words, words.buffer_info()[0]

    return allocate


#: ``fill(allocate, bounded)``: runs a plan function into ``allocate(n)``'s buffer (reserving its
#: bound on the entries first when ``bounded``); returns ``(buffer, entries)``.
_Fill = Callable[[Callable[[int], Tuple[Any, Any]], bool], Tuple[Any, int]]


def _rects_out(fill: _Fill, as_arrays: bool, where: str) -> Any:
    """A plan's rects as a list of :class:`CopyRect`, or with ``as_arrays`` one ``(n, 6)``
    uint64 array (the bound reserved, then trimmed)."""
    if as_arrays:
        _require_numpy(where)
        rects, count = fill(_numpy_allocate(6), True)
        return _trimmed(rects, count)
    rects, _ = fill(_words_allocate(6), False)
    fields = iter(rects.tolist())
    return list(map(CopyRect._make, zip(*[fields] * 6)))


def _segments_out(fill: _Fill, as_arrays: bool, where: str) -> Tuple[Any, Any, Any]:
    """A segment list as ``(local_offsets, remote_offsets, sizes)``: lists, or with
    ``as_arrays`` the three columns of one ``(n, 3)`` uint64 array (strided views, no copy)."""
    if as_arrays:
        _require_numpy(where)
        segments, count = fill(_numpy_allocate(3), True)
        segments = _trimmed(segments, count)
        return segments[:, 0], segments[:, 1], segments[:, 2]
    segments, _ = fill(_words_allocate(3), False)
    view = memoryview(segments)
    return view[0::3].tolist(), view[1::3].tolist(), view[2::3].tolist()


def plan(
    config: SliceConfig,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    *,
    as_arrays: bool = False,
) -> Union[List[CopyRect], "numpy.ndarray"]:
    """The strided 2D copies of one request: one :class:`CopyRect` per maximal run of pages.

    Page ``src_pages[i]`` of the prefill rank goes to page ``dst_pages[i]`` of the decode rank.
    Adjacent pairs where both indices go up by one form a run; a run of n pages is one rect of
    ``n * page_size`` rows. Empty unless ``config.action`` is SEND (the pages are still checked).

    Args:
        config: from :func:`slice_config`.
        src_pages, dst_pages: paired page indices (see :data:`PageIndices`).
        as_arrays: return one numpy ``uint64`` array of shape ``(n, 6)`` instead of a list, its
            columns in :class:`CopyRect` field order (needs numpy). No Python object per rect.

    Raises:
        InvalidArgumentError: page lists of different lengths, or inconsistent config fields.
        OutOfBoundsError: a negative page index, or one that does not fit in int32.
        SliceOverflowError, LayoutMismatchError: a hand-edited config that does not fit.
        ImportError: ``as_arrays=True`` without numpy installed.
    """
    def fill(allocate: Any, bounded: bool) -> Tuple[Any, int]:
        # A plan has at most one rect per page.
        return _plan_into(_lib.mori_tp_plan, config, src_pages, dst_pages, allocate, "plan",
                          upper_bound=(lambda pages: pages) if bounded else None)

    return _rects_out(fill, as_arrays, "plan")


def plan_segments(
    config: SliceConfig,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    *,
    as_arrays: bool = False,
) -> Tuple[Any, Any, Any]:
    """The same bytes as :func:`plan`, as contiguous copies for batch-write transfer APIs.

    One segment per token row of each run, except that when the slice is a whole token on both
    sides (the pair moves every head of both ranks) a run of pages is one segment.

    Args:
        config: from :func:`slice_config`.
        src_pages, dst_pages: paired page indices (see :data:`PageIndices`).
        as_arrays: return numpy ``uint64`` arrays instead of lists (needs numpy). The library
            writes the segments straight into one ``(n, 3)`` array and the three results are
            its columns (strided views, no copy): use this to do arithmetic on the offsets, for
            example ``base_ptr + local_offsets``, without building Python ints.

    Returns:
        ``(local_offsets, remote_offsets, sizes)``: byte offsets into the source buffer, byte
        offsets into the destination buffer and lengths, relative to each buffer's base. The
        same for every layer's K and V buffer: add each buffer's base address.

    Raises:
        InvalidArgumentError, OutOfBoundsError, SliceOverflowError, LayoutMismatchError: as
            for :func:`plan`.
        ImportError: ``as_arrays=True`` without numpy installed.
    """
    def fill(allocate: Any, bounded: bool) -> Tuple[Any, int]:
        # At most one segment per token row; contiguous plans need one per run, fewer still.
        rows = config.page_size if bounded else 0
        return _plan_into(_lib.mori_tp_plan_segments, config, src_pages, dst_pages, allocate,
                          "plan_segments",
                          upper_bound=(lambda pages: pages * rows) if bounded else None)

    return _segments_out(fill, as_arrays, "plan_segments")


_BACKENDS = {
    "auto": _ffi.MORI_BACKEND_AUTO,
    "host": _ffi.MORI_BACKEND_HOST,
    "hip": _ffi.MORI_BACKEND_HIP,
    "cuda": _ffi.MORI_BACKEND_CUDA,
}


def gpu_counters(backend: str) -> Dict[str, int]:
    """What the GPU backend ``"cuda"`` or ``"hip"`` did in this process
    (``mori_tp_gpu_counters_get``): ``kernel_launches``, and ``fallbacks``, the calls that chose or
    asked for the copy kernel but took the per-rect copies, with the same count per reason
    (``fallbacks_unloadable``, ``fallbacks_busy``, ``fallbacks_context``, ``fallbacks_capture``,
    ``fallbacks_memory``) and ``load_failures`` of the kernel. Loads no driver; all zeros before
    the backend's first use. Raises BackendUnavailableError when the backend is not built in,
    InvalidArgumentError for another backend."""
    where = "gpu_counters"
    if backend not in ("cuda", "hip"):
        raise InvalidArgumentError(f"{where}: backend {backend!r} is not 'cuda' or 'hip'")
    out = _ffi.MoriTpGpuCounters()
    status = _lib.mori_tp_gpu_counters_get(_BACKENDS[backend], ctypes.byref(out))
    if status != 0:
        _raise_last(status)
    return {name: int(getattr(out, name)) for name, _ in _ffi.MoriTpGpuCounters._fields_}


def _pointer_array(pointers: Sequence[int], name: str, where: str) -> Any:
    values = [_unsigned(p, f"{name}[{i}]", 64, where) for i, p in enumerate(pointers)]
    return (ctypes.c_void_p * len(values))(*values)


def _backend_name(backend: Any, where: str) -> str:
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise InvalidArgumentError(
            f"{where}: backend {backend!r} is not one of {', '.join(map(repr, _BACKENDS))}"
        )
    return backend


def _copy_call(
    where: str,
    backend: str,
    stream: Any,
    synchronize: bool,
    copy_kernel: Optional[bool],
    max_blocks: Optional[int],
    operands: Sequence[Tuple[str, Any, bool, bool]],
    extra: Sequence[Tuple[str, "_tensors.Buffer"]] = (),
) -> Tuple[List["_tensors.Operand"], _ffi.MoriSendOptions]:
    """Checks a copying call's backend, resolves its buffers (``(name, value, writable,
    single)`` each: addresses, numpy arrays, DLPack and ``__cuda_array_interface__`` tensors)
    and its stream, and builds its MoriSendOptions. The operands hold what keeps the tensors'
    memory alive: keep them until the C call returns."""
    name = _backend_name(backend, where)
    resolved, chosen = _tensors.resolve(where, name, stream, operands, extra)
    if copy_kernel is not None and not isinstance(copy_kernel, bool):
        raise TypeError(f"{where}: copy_kernel must be None, True or False, not {copy_kernel!r}")
    path = {None: 0, True: _ffi.MORI_SEND_COPY_KERNEL, False: _ffi.MORI_SEND_MEMCPY2D}
    flags = (_ffi.MORI_SEND_SYNCHRONIZE if synchronize else 0) | path[copy_kernel]
    if max_blocks is not None:
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int):
            raise TypeError(f"{where}: max_blocks must be None or an int, not {max_blocks!r}")
        if not 1 <= max_blocks <= _ffi.MORI_SEND_MAX_BLOCKS_LIMIT:
            raise InvalidArgumentError(
                f"{where}: max_blocks {max_blocks} is outside "
                f"1..{_ffi.MORI_SEND_MAX_BLOCKS_LIMIT} (the most copy-kernel blocks one call may "
                "use; None for no budget)")
        flags |= max_blocks << _ffi.MORI_SEND_MAX_BLOCKS_SHIFT
    return resolved, _ffi.MoriSendOptions(_BACKENDS[name], flags, chosen)


def _capacity(operand: "_tensors.Operand", given: Optional[int], name: str,
              where: str) -> int:
    """Each buffer's capacity: ``given``, which must fit uint64 and exceed no tensor's bytes;
    by default the smallest tensor's bytes (refused when a buffer is a bare address)."""
    if given is not None:
        given = _unsigned(given, name, 64, where)
    capacity = operand.capacity(given, name, where)
    return 0 if capacity is None else capacity


def _address_array(operand: "_tensors.Operand") -> Any:
    addresses = operand.addresses
    return (ctypes.c_void_p * len(addresses))(*addresses)


def _kv_buffers(src: "_tensors.Operand", dst: "_tensors.Operand", src_capacity: Optional[int],
                dst_capacity: Optional[int],
                where: str) -> Tuple[_ffi.MoriKvBuffers, Tuple[Any, Any]]:
    """The MoriKvBuffers of a send, and the two pointer arrays it points into (keep them alive
    for the call)."""
    if len(src.addresses) != len(dst.addresses):
        raise InvalidArgumentError(
            f"{where}: {len(src.addresses)} source buffers but {len(dst.addresses)} destination "
            "buffers (they are paired one to one)"
        )
    src_array, dst_array = _address_array(src), _address_array(dst)
    buffers = _ffi.MoriKvBuffers(
        ctypes.cast(src_array, ctypes.POINTER(ctypes.c_void_p)),
        ctypes.cast(dst_array, ctypes.POINTER(ctypes.c_void_p)),
        len(src_array),
        _capacity(src, src_capacity, "src_capacity", where),
        _capacity(dst, dst_capacity, "dst_capacity", where),
    )
    return buffers, (src_array, dst_array)


def _region(operand: "_tensors.Operand", capacity: Optional[int], where: str) -> Tuple[int, int]:
    """(address, capacity) of a staging region: an address (then ``staging_capacity`` is
    required), a numpy array or a tensor (by default its bytes, and never more)."""
    return operand.addresses[0], _capacity(operand, capacity, "staging_capacity", where)


def send_kvcache(
    config: SliceConfig,
    src_ptrs: Sequence[BufferLike],
    dst_ptrs: Sequence[BufferLike],
    *,
    src_capacity: Optional[int] = None,
    dst_capacity: Optional[int] = None,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    backend: str = "auto",
    stream: StreamLike = None,
    synchronize: bool = False,
    copy_kernel: Optional[bool] = None,
    max_blocks: Optional[int] = None,
) -> None:
    """Copies one request's slice: every rect of the plan, from each ``src_ptrs[i]`` to
    ``dst_ptrs[i]``.

    Everything is validated before the first byte moves: a call that raises wrote nothing. A
    config that is not SEND passes the same checks and moves nothing.

    Args:
        config: from :func:`slice_config`.
        src_ptrs: the prefill rank's buffers (K of each layer, then V of each layer; MLA: one
            latent buffer per layer), each a :data:`BufferLike`: an address such as
            ``tensor.data_ptr()``, a numpy array, or a C-contiguous device tensor (DLPack or
            ``__cuda_array_interface__``: torch, CuPy).
        dst_ptrs: the matching buffers of the decode rank, in the same order; written, so a
            read-only array or tensor is refused.
        src_capacity: bytes in each source buffer; every source page must end within it.
            Default: the smallest source tensor's bytes (required when a buffer is an address);
            never more than a tensor's bytes.
        dst_capacity: bytes in each destination buffer, as ``src_capacity``.
        src_pages, dst_pages: paired page indices (see :data:`PageIndices`).
        backend: ``"auto"`` (a GPU backend when built in and a device is present, else host),
            ``"host"`` (CPU copies: host memory; it cannot tell a device address from a host
            one, so pick a GPU backend or AUTO for device memory) or a GPU backend: ``"hip"``
            (AMD GPUs) or ``"cuda"`` (NVIDIA GPUs, the CUDA driver API); each runs the copy
            kernel or one 2D copy per rect (see ``copy_kernel``). A DLPack tensor in memory the
            backend does not reach is refused.
        stream: a :data:`StreamLike`: a ``hipStream_t`` / ``cudaStream_t`` as an int, or an
            object carrying one (``torch.cuda.Stream``, a CuPy ``Stream``, a tensor whose
            ``__cuda_array_interface__`` carries a stream). None: the stream the buffers'
            ``__cuda_array_interface__`` carry (they must agree), else the null stream.
            DLPack producers are told the stream and order their pending work before it. The
            host backend takes no stream.
        synchronize: wait for the copies before returning (GPU backends; host copies always
            have). Without it, keep the buffers alive until the stream has run the copies.
        copy_kernel: which copy path a GPU backend takes. None (the default, flags 0): one
            copy-kernel launch for the whole call where the kernel can surely run and the call
            has at least 2 (buffer, rect) copies, else one 2D memcpy per (buffer, rect)
            (REFERENCE.md section 7 says when). True (MORI_SEND_COPY_KERNEL): the kernel, and
            every buffer must then be memory the GPU can address. False (MORI_SEND_MEMCPY2D):
            one 2D memcpy per (buffer, rect). Host copies ignore it.
        max_blocks: the SM budget, the most copy-kernel blocks (of 256 threads) the call may
            launch, 1 to 65535 (MORI_SEND_MAX_BLOCKS): a pack that overlaps attention then
            leaves the other SMs to it. None (the default): the persistent grid, at most the
            blocks the device runs at once. Bounds the kernel only: refused together with
            ``copy_kernel=False``; host copies ignore it.

    Raises:
        NullPointerError: a buffer address is 0.
        InvalidArgumentError: buffer or page lists of different lengths, an unknown backend, a
            stream with host copies, a value that does not fit its C type; a tensor that is not
            C-contiguous, read-only where it is written, smaller than the capacity given, in
            memory the backend does not reach, or buffers whose interfaces carry different
            streams (each message names the buffer and its values).
        TypeError: a buffer or stream of a type not listed above; a capacity missing for an
            address.
        OutOfBoundsError: a negative page index, or a page that ends past its capacity.
        BackendUnavailableError: a GPU backend requested but not built in, or no device.
        GpuError: the GPU runtime failed.
    """
    where = "send_kvcache"
    c_config = _c_config(config, where)
    (src_op, dst_op), options = _copy_call(
        where, backend, stream, synchronize, copy_kernel, max_blocks,
        [("src_ptrs", src_ptrs, False, False), ("dst_ptrs", dst_ptrs, True, False)])
    buffers, _arrays = _kv_buffers(src_op, dst_op, src_capacity, dst_capacity, where)
    src, dst, num_pages, _owners = _page_pairs(src_pages, dst_pages, where)
    status = _lib.mori_tp_kvcache_send(
        ctypes.byref(c_config),
        ctypes.byref(buffers),
        src,
        dst,
        num_pages,
        ctypes.byref(options),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)


# --- Staged transfers: pack, one coalesced segment list, unpack -------------------------------


class Staging(enum.IntEnum):
    """Which sides of a transfer go through a dense staging region (``MoriTpStaging``).

    A staged side holds each buffer's slice as ``num_pages * page_size`` consecutive slices of
    ``heads_bytes_per_token_to_send`` bytes, buffer ``b`` at ``b * staging_len(...)`` of the
    region, so the transport moves a few long segments instead of one per token.
    """

    #: Pages to pages: :func:`plan_transfer` equals :func:`plan_segments`.
    NONE = 0
    #: The prefill rank packs into its staging region; segments go from it to the decode pages.
    SRC = 1
    #: Segments go from the prefill pages into a staging region on the decode rank, which
    #: unpacks it.
    DST = 2
    #: Both: one segment of ``staging_len`` bytes per buffer.
    BOTH = 3

    @property
    def packs(self) -> bool:
        """Whether the prefill rank packs (SRC or BOTH) before the transport moves anything."""
        return self in (Staging.SRC, Staging.BOTH)

    @property
    def unpacks(self) -> bool:
        """Whether the decode rank unpacks (DST or BOTH) after the transport is done."""
        return self in (Staging.DST, Staging.BOTH)


def _staging_value(staging: Any, where: str) -> int:
    """``staging`` as a uint32 for the C call. A number outside the enum is passed through, so
    that the library refuses it with its own message (MORI_ERR_INVALID_ARGUMENT)."""
    return _unsigned(staging, "staging", 32, where)


def staging_for(config: SliceConfig) -> Staging:
    """The staging that gives the transport the fewest segments for this pair: each side whose
    token slot is wider than the slice is staged. NONE when the pair is not SEND.

    It depends on the config alone, so the prefill and the decode rank of a pair compute the
    same answer without exchanging anything.
    """
    c_config = _c_config(config, "staging_for")
    out = ctypes.c_uint32()
    status = _lib.mori_tp_staging_for(ctypes.byref(c_config), ctypes.byref(out))
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return Staging(out.value)


def staging_len(config: SliceConfig, num_pages: int) -> int:
    """Bytes one buffer occupies in a staging region for a request of ``num_pages`` page pairs:
    ``num_pages * page_size * heads_bytes_per_token_to_send`` (0 when the pair is not SEND). A
    staging region for ``n`` buffers needs ``n * staging_len(config, num_pages)`` bytes.

    Raises:
        InvalidArgumentError: the length overflows uint64, or num_pages is negative.
    """
    where = "staging_len"
    c_config = _c_config(config, where)
    out = ctypes.c_uint64()
    status = _lib.mori_tp_staging_len(
        ctypes.byref(c_config), _unsigned(num_pages, "num_pages", 64, where), ctypes.byref(out)
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)
    return out.value


def plan_transfer(
    config: SliceConfig,
    staging: Union[Staging, int],
    src_pages: PageIndices,
    dst_pages: PageIndices,
    *,
    as_arrays: bool = False,
) -> Tuple[Any, Any, Any]:
    """The transport's segments for one request with the given staging, as
    ``(local_offsets, remote_offsets, sizes)`` like :func:`plan_segments`.

    Offsets are relative to each buffer's base: on an unstaged side that is the page buffer, on
    a staged side ``staging_region + b * staging_len(config, len(src_pages))`` for buffer ``b``.
    The same list applies to every buffer. NONE gives :func:`plan_segments` itself; SRC or DST
    one segment per run of the other side's pages when that side's token is exactly the slice
    (else one per token); BOTH one segment of ``staging_len`` bytes.

    Args:
        config: from :func:`slice_config`.
        staging: a :class:`Staging` (or its value).
        src_pages, dst_pages: paired page indices (see :data:`PageIndices`).
        as_arrays: numpy ``uint64`` columns instead of lists, as for :func:`plan_segments`.

    Raises:
        InvalidArgumentError: an unknown staging value, page lists of different lengths, or
            inconsistent config fields.
        OutOfBoundsError, SliceOverflowError, LayoutMismatchError: as for :func:`plan`.
        ImportError: ``as_arrays=True`` without numpy installed.
    """
    where = "plan_transfer"
    value = _staging_value(staging, where)

    def function(c_config: Any, *rest: Any) -> int:
        return _lib.mori_tp_plan_transfer(c_config, value, *rest)

    def fill(allocate: Any, bounded: bool) -> Tuple[Any, int]:
        # At most one segment per token row, as for plan_segments.
        rows = config.page_size if isinstance(config, SliceConfig) else 0
        return _plan_into(function, config, src_pages, dst_pages, allocate, where,
                          upper_bound=(lambda pages: pages * rows) if bounded else None)

    return _segments_out(fill, as_arrays, where)


class RankMemory(NamedTuple):
    """One rank's memory for a request (``MoriTpMemory``): how many page buffers, the bytes in
    each, and the bytes of the staging region or slot the request may use (0: none)."""

    num_buffers: int
    capacity: int
    staging_capacity: int = 0

    def _as_c(self, name: str, where: str) -> _ffi.MoriTpMemory:
        return _ffi.MoriTpMemory(
            _unsigned(self.num_buffers, f"{name}.num_buffers", 64, where),
            _unsigned(self.capacity, f"{name}.capacity", 64, where),
            _unsigned(self.staging_capacity, f"{name}.staging_capacity", 64, where),
        )


def check_transfer(
    config: SliceConfig,
    staging: Union[Staging, int],
    src_pages: PageIndices,
    dst_pages: PageIndices,
    *,
    prefill: RankMemory,
    decode: RankMemory,
) -> None:
    """Checks a transfer against the memory both ranks registered, before an engine gets its
    segments (an engine copies whatever it is given): the config and pages as
    :func:`plan_transfer` checks them, equal buffer counts, every page within its side's buffer
    capacity (staged or not), and each staged side's staging region holding
    ``num_buffers * staging_len`` bytes.

    Raises:
        InvalidArgumentError: buffer counts differ, an unknown staging value, a bad config.
        OutOfBoundsError: a page is negative or ends past its side's capacity.
        BufferTooSmallError: a staged side's region is smaller than the request needs.
    """
    where = "check_transfer"
    c_config = _c_config(config, where)
    value = _staging_value(staging, where)
    c_prefill = RankMemory(*prefill)._as_c("prefill", where)
    c_decode = RankMemory(*decode)._as_c("decode", where)
    src, dst, num_pages, _owners = _page_pairs(src_pages, dst_pages, where)
    status = _lib.mori_tp_check_transfer(
        ctypes.byref(c_config), value, src, dst, num_pages,
        ctypes.byref(c_prefill), ctypes.byref(c_decode),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)


#: A staging region: its address as an int, a C-contiguous numpy array, or a C-contiguous
#: device tensor (DLPack or ``__cuda_array_interface__``); an array or tensor gives its size.
StagingRegion = Any


def pack_kvcache(
    config: SliceConfig,
    src_ptrs: Sequence[BufferLike],
    staging: StagingRegion,
    *,
    src_capacity: Optional[int] = None,
    src_pages: PageIndices,
    staging_capacity: Optional[int] = None,
    backend: str = "auto",
    stream: StreamLike = None,
    synchronize: bool = False,
    copy_kernel: Optional[bool] = None,
    max_blocks: Optional[int] = None,
) -> None:
    """Prefill side of a staged transfer (SRC or BOTH): copies the slice of every token of
    every buffer into the staging region, buffer ``b`` at ``b * staging_len(config,
    len(src_pages))``.

    Everything is checked before the first byte moves; a call that raises wrote nothing. A
    config that is not SEND is checked the same way and moves nothing.

    Args:
        config: from :func:`slice_config`.
        src_ptrs: the prefill rank's buffers (addresses, arrays or tensors), as for
            :func:`send_kvcache`.
        staging: the staging region: an address, or a writable C-contiguous numpy array or
            device tensor.
        src_capacity: bytes in each source buffer (default: the smallest tensor's bytes), as
            for :func:`send_kvcache`.
        src_pages: the request's source pages, in request order.
        staging_capacity: bytes of the staging region (default for an array or tensor: its
            bytes, and never more); it must hold ``len(src_ptrs) * staging_len(config,
            len(src_pages))`` bytes.
        backend, stream, synchronize, copy_kernel: as for :func:`send_kvcache`.

    Raises:
        BufferTooSmallError: the staging region is smaller than the request needs (the message
            names both sizes).
        NullPointerError, InvalidArgumentError, OutOfBoundsError, BackendUnavailableError,
            GpuError, TypeError: as for :func:`send_kvcache`.
    """
    where = "pack_kvcache"
    c_config = _c_config(config, where)
    (src_op, region_op), options = _copy_call(
        where, backend, stream, synchronize, copy_kernel, max_blocks,
        [("src_ptrs", src_ptrs, False, False), ("staging", staging, True, True)])
    region, capacity = _region(region_op, staging_capacity, where)
    pointers = _address_array(src_op)
    pages, num_pages, _owner = _pages_arg(src_pages, f"{where}: src_pages")
    status = _lib.mori_tp_kvcache_pack(
        ctypes.byref(c_config),
        ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p)),
        len(pointers),
        _capacity(src_op, src_capacity, "src_capacity", where),
        pages,
        num_pages,
        region,
        capacity,
        ctypes.byref(options),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)


def unpack_kvcache(
    config: SliceConfig,
    staging: StagingRegion,
    dst_ptrs: Sequence[BufferLike],
    *,
    dst_capacity: Optional[int] = None,
    dst_pages: PageIndices,
    staging_capacity: Optional[int] = None,
    backend: str = "auto",
    stream: StreamLike = None,
    synchronize: bool = False,
    copy_kernel: Optional[bool] = None,
    max_blocks: Optional[int] = None,
) -> None:
    """Decode side of a staged transfer (DST or BOTH): copies the staging region into the
    slice of every token of every buffer, once the transport has filled the region.

    Everything is checked before the first byte moves; a call that raises wrote nothing. A
    config that is not SEND is checked the same way and moves nothing.

    Args:
        config: from :func:`slice_config` (the same pair the prefill rank planned with).
        staging: the staging region: an address, or a C-contiguous numpy array or device
            tensor.
        dst_ptrs: the decode rank's buffers (addresses, writable arrays or tensors), as for
            :func:`send_kvcache`.
        dst_capacity: bytes in each destination buffer (default: the smallest tensor's bytes).
        dst_pages: the request's destination pages, in request order.
        staging_capacity: bytes of the staging region (default for an array or tensor: its
            bytes, and never more).
        backend, stream, synchronize, copy_kernel: as for :func:`send_kvcache`.

    Raises:
        BufferTooSmallError: the staging region is smaller than the request needs.
        NullPointerError, InvalidArgumentError, OutOfBoundsError, BackendUnavailableError,
            GpuError, TypeError: as for :func:`send_kvcache`.
    """
    where = "unpack_kvcache"
    c_config = _c_config(config, where)
    (region_op, dst_op), options = _copy_call(
        where, backend, stream, synchronize, copy_kernel, max_blocks,
        [("staging", staging, False, True), ("dst_ptrs", dst_ptrs, True, False)])
    region, capacity = _region(region_op, staging_capacity, where)
    pointers = _address_array(dst_op)
    pages, num_pages, _owner = _pages_arg(dst_pages, f"{where}: dst_pages")
    status = _lib.mori_tp_kvcache_unpack(
        ctypes.byref(c_config),
        region,
        capacity,
        ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p)),
        len(pointers),
        _capacity(dst_op, dst_capacity, "dst_capacity", where),
        pages,
        num_pages,
        ctypes.byref(options),
    )
    if status != _ffi.MORI_OK:
        _raise_last(status)
