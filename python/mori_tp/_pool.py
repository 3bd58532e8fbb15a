"""Staging pools (REFERENCE.md section 12): one region registered with a transfer engine once,
slots handed out per request. ``mori_tp`` re-exports every public name; import them from there.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Tuple, Union

from . import _ffi
from ._core import _lib, _np, _raise_last, _require_numpy, _unsigned
from ._errors import (
    BackendUnavailableError,
    BufferTooSmallError,
    GpuError,
    InvalidArgumentError,
    PoolFullError,
)


# --- Staging pools: one registered region, a slot per request ---------------------------------


class PoolSlot(NamedTuple):
    """One slot of a :class:`StagingPool`."""

    #: Bytes from the pool's base: what the peer adds to the base it registered.
    offset: int
    #: Bytes granted: the size asked for, rounded up to a multiple of ``min_slot``.
    size: int
    #: ``pool.address + offset``.
    address: int


@dataclass(frozen=True)
class PoolInfo:
    """A pool's region and counters at one moment (:meth:`StagingPool.info`)."""

    base: int
    capacity: int
    min_slot: int
    live_slots: int
    live_bytes: int
    free_bytes: int
    #: The largest slot :meth:`StagingPool.try_alloc` would grant now.
    largest_free: int
    #: The free blocks ``free_bytes`` is split into (at most ``live_slots + 1``).
    free_blocks: int
    #: ``"host"`` or ``"device"``.
    memory: str
    #: Locked in RAM (host memory that mlock accepted; device memory always).
    locked: bool
    #: madvise(MADV_HUGEPAGE) was accepted for the region.
    huge_pages: bool
    #: The errno mlock failed with (EPERM, ENOMEM past RLIMIT_MEMLOCK), or 0.
    lock_errno: int
    #: Calls of :meth:`StagingPool.alloc` waiting now for a slot to be freed (the pool was
    #: full for them).
    waiters: int = 0


_POOL_MEMORY = {"host": _ffi.MORI_TP_POOL_HOST, "device": _ffi.MORI_TP_POOL_DEVICE}

#: Seconds :meth:`StagingPool.alloc` waits for a full pool by default.
DEFAULT_POOL_TIMEOUT = 10.0


class StagingPool:
    """A staging pool (``mori_tp_pool_*``): one region, allocated once and registered with the
    transfer engine once, whose slots are handed out per request and returned afterwards.

    Host memory comes from mmap (2 MiB aligned, huge pages advised, mlock where permitted,
    populated up front); ``memory="device"`` is one hipMalloc on the current device (library
    built with HIP). Slots are multiples of ``min_slot`` bytes (default 64 KiB) from a best-fit
    allocator that coalesces free space and wastes less than ``min_slot`` per slot.
    Thread-safe: :meth:`alloc` waits (with the GIL released) while the pool is full, so
    concurrent requests queue for space instead of failing.

    A :meth:`view` keeps the region mapped, as a numpy array keeps its base alive: :meth:`close`
    while views (or arrays sliced from them) are alive closes the pool at once (every call but
    ``close`` then raises) and unmaps the region when the last of them is dropped; with no view
    alive it unmaps at once.

    Args:
        capacity: bytes of the region, a multiple of ``min_slot``.
        min_slot: the slot unit, a power of two; 0 is 65536.
        memory: ``"host"`` or ``"device"``.

    Raises:
        InvalidArgumentError: a bad shape, or memory the system refuses.
        BackendUnavailableError: device memory without HIP or without a device.
        GpuError: hipMalloc failed.
    """

    def __init__(self, capacity: int, *, min_slot: int = 0, memory: str = "host") -> None:
        where = "StagingPool"
        self._handle = 0
        self._closed = True
        if memory not in _POOL_MEMORY:
            raise InvalidArgumentError(
                f"{where}: memory {memory!r} is not one of {', '.join(map(repr, _POOL_MEMORY))}"
            )
        options = _ffi.MoriTpPoolOptions(
            _unsigned(capacity, "capacity", 64, where),
            _unsigned(min_slot, "min_slot", 64, where),
            _POOL_MEMORY[memory],
            0,
        )
        self._lock = threading.Lock()
        #: Views alive (their ctypes buffers not yet collected), and whether close() left the
        #: destroy to the last of them.
        self._views = 0
        self._destroy_pending = False
        handle = ctypes.c_uint64()
        status = _lib.mori_tp_pool_create(ctypes.byref(options), ctypes.byref(handle))
        if status != _ffi.MORI_OK:
            _raise_last(status)
        self._handle = handle.value
        self._closed = False
        first = self._info()
        #: The region's first byte (register ``(address, capacity)`` with the engine).
        self.address: int = first.base
        self.capacity: int = first.capacity
        self.min_slot: int = first.min_slot
        self.memory: str = memory

    @property
    def handle(self) -> int:
        """The ``MoriTpPool`` handle (dead once closed: every call then raises)."""
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, where: str) -> None:
        """Refuses a call on a pool closed while views kept its region (the library still
        knows the handle until the last view goes, but the pool is closed)."""
        if self._closed:
            raise InvalidArgumentError(
                f"{where}: invalid argument: pool {self._handle} is not a live staging pool "
                f"(closed; its region stays mapped until its last view is dropped)"
            )

    def _slot(self, function: Any, *args: Any) -> Tuple[int, PoolSlot]:
        self._check_open("StagingPool")
        out = _ffi.MoriTpSlot()
        status = function(self._handle, *args, ctypes.byref(out))
        if status != _ffi.MORI_OK:
            return status, PoolSlot(0, 0, 0)
        return status, PoolSlot(out.offset, out.size, out.address or 0)

    def try_alloc(self, size: int) -> Optional[PoolSlot]:
        """A slot of at least ``size`` bytes, or None at once when the pool is full for it
        (MORI_ERR_POOL_FULL). Raises :class:`BufferTooSmallError` for a size no block can ever
        hold."""
        size = _unsigned(size, "size", 64, "StagingPool.try_alloc")
        status, slot = self._slot(_lib.mori_tp_pool_try_alloc, size)
        if status == _ffi.MORI_ERR_POOL_FULL:
            return None
        if status != _ffi.MORI_OK:
            _raise_last(status)
        return slot

    def alloc(self, size: int, timeout: float = DEFAULT_POOL_TIMEOUT) -> PoolSlot:
        """A slot of at least ``size`` bytes, waiting up to ``timeout`` seconds while the pool
        is full (other threads' frees end the wait). Raises :class:`PoolFullError` (a
        :class:`BufferTooSmallError`) after the timeout, and :class:`BufferTooSmallError` at
        once for a size no block can ever hold. ``timeout`` is a finite number of seconds: no
        wait is unbounded (``math.inf`` is refused with :class:`InvalidArgumentError`, as is one
        past ``uint64_t`` milliseconds)."""
        where = "StagingPool.alloc"
        if not timeout >= 0 or timeout == float("inf"):
            raise InvalidArgumentError(f"{where}: timeout {timeout!r} must be a finite number "
                                       ">= 0 seconds (no wait is unbounded)")
        milliseconds = _unsigned(int(timeout * 1000), "timeout", 64, where)
        status, slot = self._slot(_lib.mori_tp_pool_alloc,
                                  _unsigned(size, "size", 64, where), milliseconds)
        if status != _ffi.MORI_OK:
            _raise_last(status)
        return slot

    def free(self, slot: Union[PoolSlot, int]) -> None:
        """Returns a slot (or the slot at an offset). A double free, or an offset where no slot
        starts, raises :class:`InvalidArgumentError` and changes nothing."""
        offset = slot.offset if isinstance(slot, PoolSlot) else slot
        self._check_open("StagingPool.free")
        status = _lib.mori_tp_pool_free(
            self._handle, _unsigned(offset, "offset", 64, "StagingPool.free")
        )
        if status != _ffi.MORI_OK:
            _raise_last(status)

    def info(self) -> PoolInfo:
        """The region and its counters now."""
        self._check_open("StagingPool.info")
        return self._info()

    def _info(self) -> PoolInfo:
        out = _ffi.MoriTpPoolInfo()
        status = _lib.mori_tp_pool_info(self._handle, ctypes.byref(out))
        if status != _ffi.MORI_OK:
            _raise_last(status)
        return PoolInfo(
            out.base or 0, out.capacity, out.min_slot, out.live_slots, out.live_bytes,
            out.free_bytes, out.largest_free, out.free_blocks,
            "device" if out.memory == _ffi.MORI_TP_POOL_DEVICE else "host",
            bool(out.flags & _ffi.MORI_TP_POOL_LOCKED),
            bool(out.flags & _ffi.MORI_TP_POOL_HUGE_PAGES), out.lock_errno, out.waiters,
        )

    def view(self, slot: Optional[PoolSlot] = None) -> "numpy.ndarray":
        """A numpy uint8 array over a slot (or the whole region) of a host pool. The array (and
        any array sliced from it) keeps the region mapped: :meth:`close` defers unmapping until
        the last one is dropped. It does not keep the slot: a freed slot may be handed out
        again."""
        _require_numpy("StagingPool.view")
        self._check_open("StagingPool.view")
        if self.memory != "host":
            raise InvalidArgumentError("StagingPool.view: a device pool is not host memory")
        address, size = (self.address, self.capacity) if slot is None else (slot.address,
                                                                             slot.size)
        buffer = (ctypes.c_uint8 * size).from_address(address)
        with self._lock:
            self._views += 1
        # Every array over the region roots at this buffer; when it is collected the view is
        # gone (the callback holds the pool, so the pool outlives its views).
        weakref.finalize(buffer, self._view_dropped)
        return _np.frombuffer(buffer, dtype=_np.uint8)

    def _view_dropped(self) -> None:
        with self._lock:
            self._views -= 1
            destroy = self._destroy_pending and self._views == 0
            if destroy:
                self._destroy_pending = False
        if destroy and _lib is not None:
            _lib.mori_tp_pool_destroy(self._handle)

    @property
    def live_views(self) -> int:
        """Views (:meth:`view`) not yet collected: while any is, the region stays mapped."""
        return self._views

    def close(self) -> None:
        """Closes the pool and frees its region. Refused (:class:`InvalidArgumentError`)
        while slots are live: free them first, and deregister the region from the engine.
        With views alive (:attr:`live_views`), the pool closes at once but its region stays
        mapped until the last view is dropped, so no view ever reads unmapped memory.
        Closing twice does nothing; any other call on a closed pool raises
        :class:`InvalidArgumentError`."""
        if self._closed:
            return
        with self._lock:
            if self._views:
                info = self._info()
                if info.live_slots:
                    raise InvalidArgumentError(
                        f"StagingPool.close: invalid argument: staging pool: {info.live_slots} "
                        f"slots ({info.live_bytes} bytes) are still allocated; free them "
                        f"before destroying the pool (an engine may still be writing into them)"
                    )
                self._destroy_pending = True
                self._closed = True
                return
            status = _lib.mori_tp_pool_destroy(self._handle)
            if status != _ffi.MORI_OK:
                _raise_last(status)
            self._closed = True

    def __enter__(self) -> "StagingPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # A pool dropped with live slots stays mapped (an engine may still write into it).
        if not getattr(self, "_closed", True) and _lib is not None:
            _lib.mori_tp_pool_destroy(self._handle)

    def __repr__(self) -> str:
        return (f"StagingPool(handle={self._handle}, address=0x{self.address:x}, "
                f"capacity={self.capacity}, min_slot={self.min_slot}, memory={self.memory!r})")
