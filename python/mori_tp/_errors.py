"""The exceptions of mori_tp: one class per MORI_ERR_* status class of the C ABI."""

from __future__ import annotations

from typing import Dict, Optional, Type


class MoriError(Exception):
    """A mori_tp call failed.

    Attributes:
        code: the MoriStatus value (``MORI_ERR_*``, REFERENCE.md section 8).
        message: the library's message, which names the offending values, e.g.
            ``"mori_tp_slice_config: layout mismatch: decode side: bytes_per_head 128 !=
            prefill side bytes_per_head 256 (dtype or head_dim differ; ...)"``.

    Catch a subclass to handle one status class, or ``MoriError`` for all of them.
    """

    #: The MoriStatus name of this class, e.g. ``"MORI_ERR_TOPOLOGY"``.
    status: str = "MORI_ERR_UNKNOWN"
    code: int

    def __init__(self, message: str, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        elif not hasattr(self, "code"):
            raise TypeError("MoriError needs a status code")


class NullPointerError(MoriError):
    """MORI_ERR_NULL_POINTER: a required pointer (for example a buffer address) is 0."""

    status = "MORI_ERR_NULL_POINTER"
    code = 1


class InvalidArgumentError(MoriError):
    """MORI_ERR_INVALID_ARGUMENT: a field is out of range (zero TP size, page size or item
    length; rank >= TP size; unknown backend; a value that does not fit its C type),
    inconsistent config fields, or page or buffer lists of different lengths; a staging pool's
    misuse (a double free, an offset that starts no slot, a closed pool), or a stream's (a layer
    submitted twice or never)."""

    status = "MORI_ERR_INVALID_ARGUMENT"
    code = 2


class TopologyError(MoriError):
    """MORI_ERR_TOPOLOGY: total_kv_heads and a TP size divide neither way, or
    total_kv_heads is 0."""

    status = "MORI_ERR_TOPOLOGY"
    code = 3


class LayoutMismatchError(MoriError):
    """MORI_ERR_LAYOUT_MISMATCH: an item length is not a multiple of the page size, bytes per
    token is not a multiple of the heads per rank, or the sides disagree on bytes per head
    (dtype or head_dim differ)."""

    status = "MORI_ERR_LAYOUT_MISMATCH"
    code = 4


class SliceOverflowError(MoriError):
    """MORI_ERR_SLICE_OVERFLOW: a head slice would not fit inside its token slot (only a
    hand-edited config can cause it)."""

    status = "MORI_ERR_SLICE_OVERFLOW"
    code = 5


class OutOfBoundsError(MoriError):
    """MORI_ERR_OUT_OF_BOUNDS: a page index is negative, does not fit in int32, or its page
    ends past the buffer capacity."""

    status = "MORI_ERR_OUT_OF_BOUNDS"
    code = 6


class BufferTooSmallError(MoriError):
    """MORI_ERR_BUFFER_TOO_SMALL: a staging region is smaller than the request needs
    (:func:`~mori_tp.pack_kvcache`, :func:`~mori_tp.unpack_kvcache`,
    :func:`mori_tp.engines.plan_request`; the message names both sizes), or a slot larger than
    a :class:`~mori_tp.StagingPool`'s capacity, which no wait can grant. The plan functions
    size their outputs first, so from them it would mean a bug in mori_tp; please report it.
    A pool that is only full now raises :class:`PoolFullError`, a subclass."""

    status = "MORI_ERR_BUFFER_TOO_SMALL"
    code = 7


class BackendUnavailableError(MoriError):
    """MORI_ERR_BACKEND_UNAVAILABLE: the requested copy backend is not built into the loaded
    library, or it has no device."""

    status = "MORI_ERR_BACKEND_UNAVAILABLE"
    code = 8


class GpuError(MoriError):
    """MORI_ERR_GPU: the GPU runtime failed; the message names the HIP error, buffer and
    rect. Copies issued before the failure may have landed."""

    status = "MORI_ERR_GPU"
    code = 9


class InternalError(MoriError):
    """MORI_ERR_PANIC: an internal error (a bug in mori-tp) was caught at the C boundary;
    please report the message."""

    status = "MORI_ERR_PANIC"
    code = 10


class PoolFullError(BufferTooSmallError):
    """MORI_ERR_POOL_FULL (11): a :class:`~mori_tp.StagingPool` had no free block for the slot
    when ``alloc``'s timeout ran out; worth retrying once other requests free their slots (the
    message names the block needed, the largest free block and how long it waited).
    ``try_alloc`` returns None instead. A subclass of :class:`BufferTooSmallError`, which a
    full pool raised before this code existed, so ``except BufferTooSmallError`` still
    catches it."""

    status = "MORI_ERR_POOL_FULL"
    code = 11


#: The exception class of each MoriStatus failure code.
ERROR_CLASSES: Dict[int, Type[MoriError]] = {
    cls.code: cls
    for cls in (
        NullPointerError,
        InvalidArgumentError,
        TopologyError,
        LayoutMismatchError,
        SliceOverflowError,
        OutOfBoundsError,
        BufferTooSmallError,
        BackendUnavailableError,
        GpuError,
        InternalError,
        PoolFullError,
    )
}


def error_for(code: int, message: str) -> MoriError:
    """The exception for a failure status: its class's, or a plain MoriError for a code this
    package does not know (a newer library)."""
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        return MoriError(message or f"unknown mori_tp status {code}", code)
    return cls(message)
