"""Requests as the engines move them: registered memory (:class:`KvMemory`), a request's
plan (:func:`plan_request`, :class:`RequestPlan`), its unpacking, and what a send returns
(re-exported by :mod:`mori_tp.engines`)."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import mori_tp
from mori_tp import (
    InvalidArgumentError,
    PageIndices,
    PairConfig,
    Request,
    SliceConfig,
    Staging,
)

try:
    import numpy as np
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mori_tp.engines needs numpy (pip install numpy); the core mori_tp package does not"
    ) from _error

# The notification protocol's tokens (protocol.py needs nothing from this module).
from .protocol import check_token  # noqa: E402



#: Buffer ranges: a list of ``(first, end)`` pairs, each a half-open range of buffer indices
#: (buffer ``b``'s staged bytes sit at ``b * staging_len``, so a range is one contiguous part of
#: a staging region).
BufferRanges = Sequence[Tuple[int, int]]


def _int(value: Any, name: str, where: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: {name} must be an int, not {type(value).__name__}") from None
    if not 0 <= number < (1 << 64):
        raise InvalidArgumentError(f"{where}: {name} {number} does not fit in uint64_t")
    return number


@dataclass(frozen=True)
class KvMemory:
    """One rank's KV cache as a transfer engine sees it: the base address of every buffer (K of
    each layer, then V of each layer; MLA: one latent buffer per layer), the bytes in each, and
    a staging region for staged requests (address 0 and capacity 0 when it has none).

    Register it with the engine once (``memory = transport.register(memory)``, which returns
    it stamped with the transport's registration ``epoch``). For a staging pool,
    register the whole pool and pass per request a copy whose staging field is the slot the
    request uses (``dataclasses.replace(memory, staging=slot, staging_capacity=slot_len)``).
    """

    #: Base address of each buffer, in ``MoriKvBuffers`` order.
    buffers: Tuple[int, ...]
    #: Bytes in each buffer.
    capacity: int
    #: Address of the staging region (0: none).
    staging: int = 0
    #: Bytes of the staging region.
    staging_capacity: int = 0
    #: The registration this memory belongs to (0: none): the owning transport's epoch, which
    #: ``register`` stamps; a plan against it is refused once the peer announces another
    #: (:mod:`mori_tp.engines.faults`).
    epoch: int = 0

    def __post_init__(self) -> None:
        where = "KvMemory"
        buffers = tuple(_int(b, f"buffers[{i}]", where) for i, b in enumerate(self.buffers))
        object.__setattr__(self, "buffers", buffers)
        for name in ("capacity", "staging", "staging_capacity", "epoch"):
            object.__setattr__(self, name, _int(getattr(self, name), name, where))
        if self.staging_capacity and not self.staging:
            raise InvalidArgumentError(
                f"{where}: staging_capacity {self.staging_capacity} with no staging address"
            )

    def regions(self) -> List[Tuple[int, int]]:
        """``(address, length)`` of every region an engine must register: each buffer, then
        the staging region if there is one."""
        regions = [(address, self.capacity) for address in self.buffers]
        if self.staging_capacity:
            regions.append((self.staging, self.staging_capacity))
        return regions

    def rank_memory(self) -> mori_tp.RankMemory:
        """The buffer count and capacities the library checks a request against."""
        return mori_tp.RankMemory(len(self.buffers), self.capacity, self.staging_capacity)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-friendly form for the handshake; :meth:`from_dict` reads it back."""
        return {
            "buffers": list(self.buffers),
            "capacity": self.capacity,
            "staging": self.staging,
            "staging_capacity": self.staging_capacity,
            "epoch": self.epoch,
        }

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "KvMemory":
        return cls(tuple(data["buffers"]), data["capacity"], data.get("staging", 0),
                   data.get("staging_capacity", 0), data.get("epoch", 0))


@dataclass(frozen=True)
class SendResult:
    """What one :meth:`send` moved and how long each part took."""

    #: The staging the request used (a request of several groups: each group's, in order).
    staging: Union[Staging, Tuple[Staging, ...]]
    #: Segments handed to the engine (all buffers).
    segments: int
    #: Bytes handed to the engine.
    bytes: int
    #: Engine calls made (more than one when a list is split to fit the engine's limits).
    calls: int
    #: Seconds spent packing on the prefill rank (0 unless SRC or BOTH).
    pack_seconds: float
    #: Seconds from the first engine call until the engine reported every segment done.
    write_seconds: float
    #: Engine-specific handles the receiver may need (MORI-IO transfer ids); empty otherwise.
    transfer_ids: Tuple[int, ...] = field(default=())
    #: Chunks the request was written in (a pipelined or streamed send; 1 otherwise).
    chunks: int = 1


@dataclass(frozen=True)
class RequestPlan:
    """One request of one (prefill rank, decode rank) pair, ready for an engine: get it from
    :func:`plan_request`. Segment offsets are per buffer; :meth:`addresses` applies them to
    every buffer's base on both sides. A plan of a :class:`~mori_tp.PairConfig` carries its
    :class:`~mori_tp.Request` (``request``), and :meth:`pack` uses the pair functions."""

    #: A SliceConfig (whole pages of one size, token-major) or a PairConfig (any layout).
    config: Union[SliceConfig, PairConfig]
    staging: Staging
    #: The request's page lists (int32); with a PairConfig, those of ``request``.
    src_pages: "np.ndarray"
    dst_pages: "np.ndarray"
    #: The prefill rank's memory (this process) and the decode rank's (the peer).
    local: KvMemory
    remote: KvMemory
    #: Bytes each buffer occupies in a staging region (0 when not SEND).
    staging_len: int
    #: One buffer's segments: offsets from that buffer's base on each side, and lengths.
    src_offsets: "np.ndarray"
    dst_offsets: "np.ndarray"
    lengths: "np.ndarray"
    #: The Request of a PairConfig plan; None with a SliceConfig.
    request: Optional[Request] = None
    #: The request's token, when the decode rank sent one with the slot and pages
    #: (``Receiver.expect`` draws it): a :class:`Streamer` puts it in every notification.
    token: Optional[str] = field(default=None, repr=False)

    @property
    def num_buffers(self) -> int:
        return len(self.local.buffers)

    @property
    def segments(self) -> int:
        """Segments handed to the engine, all buffers together."""
        return len(self.lengths) * self.num_buffers

    @property
    def bytes(self) -> int:
        """Bytes moved, all buffers together."""
        return int(self.lengths.sum()) * self.num_buffers

    @property
    def bytes_per_buffer(self) -> int:
        """Bytes moved per buffer."""
        return int(self.lengths.sum())

    def src_bases(self, buffers: Optional[BufferRanges] = None) -> "np.ndarray":
        """Each buffer's source base: its page buffer, or its part of the local staging region
        when the prefill rank packs (only the buffers in ``buffers`` when given)."""
        return self._bases(self.local, self.staging.packs, buffers)

    def dst_bases(self, buffers: Optional[BufferRanges] = None) -> "np.ndarray":
        """Each buffer's destination base: its page buffer, or its part of the decode rank's
        staging region when the decode rank unpacks (only the buffers in ``buffers``)."""
        return self._bases(self.remote, self.staging.unpacks, buffers)

    def _bases(self, memory: KvMemory, staged: bool,
               buffers: Optional[BufferRanges]) -> "np.ndarray":
        chosen = np.asarray(buffer_indices(buffers, self.num_buffers), dtype=np.uint64)
        if staged:
            return np.uint64(memory.staging) + chosen * np.uint64(self.staging_len)
        return np.asarray(memory.buffers, dtype=np.uint64)[chosen.astype(np.intp)]

    def addresses(self, buffers: Optional[BufferRanges] = None
                  ) -> Tuple["np.ndarray", "np.ndarray", "np.ndarray"]:
        """``(src, dst, lengths)``: absolute addresses of every segment of every buffer, buffer
        by buffer, as numpy uint64 arrays (what batch-write APIs take). With ``buffers`` (a list
        of ``(first, end)`` ranges), only those buffers' segments, in that order."""
        src_bases = self.src_bases(buffers)
        src = (src_bases[:, None] + self.src_offsets[None, :]).ravel()
        dst = (self.dst_bases(buffers)[:, None] + self.dst_offsets[None, :]).ravel()
        return src, dst, np.tile(self.lengths, len(src_bases))

    def pack(self, backend: str = "auto", stream: Optional[int] = None,
             synchronize: bool = True, buffers: Optional[BufferRanges] = None) -> float:
        """Packs the local buffers into the local staging region when the staging is SRC or
        BOTH (else does nothing); returns the seconds it took. Transports call it in send().
        With ``buffers``, packs only those ranges of buffers: range ``(b0, b1)`` lands at
        ``[b0 * staging_len, b1 * staging_len)`` of the region, as in a whole pack."""
        if not self.staging.packs:
            return 0.0
        start = time.perf_counter()
        for first, end in _ranges(buffers, self.num_buffers):
            # Range (b0, b1) is one contiguous part of the region: a pack of those buffers.
            region = self.local.staging + first * self.staging_len
            capacity = (end - first) * self.staging_len
            if isinstance(self.config, PairConfig):
                mori_tp.pack_kvcache_pair(
                    self.config, self.staging, self.local.buffers[first:end], region,
                    src_capacity=self.local.capacity, request=self.request,
                    staging_capacity=capacity,
                    backend=backend, stream=stream, synchronize=synchronize,
                )
                continue
            mori_tp.pack_kvcache(
                self.config, self.local.buffers[first:end], region,
                src_capacity=self.local.capacity, src_pages=self.src_pages,
                staging_capacity=capacity,
                backend=backend, stream=stream, synchronize=synchronize,
            )
        return time.perf_counter() - start


def plan_request(
    config: Union[SliceConfig, PairConfig],
    request: Union[Request, PageIndices],
    dst_pages: Optional[PageIndices] = None,
    *,
    local: KvMemory,
    remote: KvMemory,
    staging: Optional[Union[Staging, int]] = None,
    token: Optional[str] = None,
) -> RequestPlan:
    """Plans one request of one pair for a transfer engine, on the prefill rank.

    Checks, before anything moves: the two sides have the same number of buffers; every page
    ends within its side's capacity; each staged side's region holds ``num_buffers *
    staging_len`` bytes. Nothing is packed or written here (see the transports' ``send``).

    Args:
        config: the pair's :class:`~mori_tp.SliceConfig`, or its :class:`~mori_tp.PairConfig`
            for any page layout.
        request: with a PairConfig, the :class:`~mori_tp.Request`; with a SliceConfig, the
            source pages, and ``dst_pages`` the paired destination pages.
        dst_pages: with a SliceConfig only.
        local: the prefill rank's :class:`KvMemory` (this process).
        remote: the decode rank's :class:`KvMemory`, from the handshake.
        staging: a :class:`~mori_tp.Staging`; default :func:`mori_tp.staging_for` (with a
            PairConfig :func:`mori_tp.pair_staging_for`), which the decode rank computes the
            same way. If you choose another, tell the receiver.
        token: the request's token, from the decode rank with the slot and pages (its
            ``Receiver.expect`` drew it), for a :class:`Streamer` to carry in every
            notification (:mod:`mori_tp.engines.protocol`).

    Raises:
        InvalidArgumentError: buffer counts differ, page lists differ in length (SliceConfig)
            or do not cover the request's tokens (PairConfig), an unknown staging value, a bad
            config, a token that is not one.
        OutOfBoundsError: a page is negative or ends past its side's capacity.
        BufferTooSmallError: a staging region is missing or smaller than the request needs.
        TypeError: a Request with a SliceConfig, page lists with a PairConfig.
    """
    if not isinstance(local, KvMemory) or not isinstance(remote, KvMemory):
        raise TypeError("plan_request: local and remote must be KvMemory")
    if token is not None:
        check_token(token, "plan_request")
    # The library checks the staging value, the pages, both sides' capacities and staging
    # regions and the buffer counts, with messages that name the values.
    memory = {"prefill": local.rank_memory(), "decode": remote.rank_memory()}
    if isinstance(config, PairConfig):
        if dst_pages is not None:
            raise TypeError("plan_request: with a PairConfig, pass one Request (it holds both "
                            "page lists), not dst_pages")
        chosen = mori_tp.pair_staging_for(config) if staging is None else staging
        mori_tp.check_pair_transfer(config, request, chosen, **memory)
        offsets = mori_tp.pair_segments(config, request, chosen, as_arrays=True)
        length = mori_tp.pair_staging_len(config, request.num_tokens)
        src_pages, dst_pages, pair_request = request.src_pages, request.dst_pages, request
    else:
        if dst_pages is None or isinstance(request, Request):
            raise TypeError("plan_request: with a SliceConfig, pass src_pages and dst_pages "
                            "(a Request goes with a PairConfig)")
        chosen = mori_tp.staging_for(config) if staging is None else staging
        mori_tp.check_transfer(config, chosen, request, dst_pages, **memory)
        offsets = mori_tp.plan_transfer(config, chosen, request, dst_pages, as_arrays=True)
        src_pages, pair_request = request, None
        length = mori_tp.staging_len(config, len(src_pages))
    return RequestPlan(
        config, _staging(chosen, "plan_request"), np.asarray(src_pages, dtype=np.int32),
        np.asarray(dst_pages, dtype=np.int32), local, remote, length,
        *(np.ascontiguousarray(column) for column in offsets), request=pair_request,
        token=token,
    )


def unpack_request(
    config: Union[SliceConfig, PairConfig],
    request: Union[Request, PageIndices],
    *,
    memory: KvMemory,
    staging: Optional[Union[Staging, int]] = None,
    backend: str = "auto",
    stream: Optional[int] = None,
    synchronize: bool = True,
    buffers: Optional[BufferRanges] = None,
) -> Staging:
    """The decode rank's part of a request, after the engine has delivered every segment:
    unpacks its staging region into its page buffers when the staging is DST or BOTH (else
    there is nothing to do). Returns the staging used.

    Args:
        config: the pair's config (the decode rank computes the same one as the prefill rank):
            a SliceConfig, or a PairConfig.
        request: with a PairConfig, the :class:`~mori_tp.Request` (both page lists); with a
            SliceConfig, the request's destination pages, in request order.
        memory: this decode rank's :class:`KvMemory`, whose staging field is the region the
            prefill rank wrote (the same slot it was told at handshake or per request).
        staging: the staging the prefill rank used; default :func:`mori_tp.staging_for` (with a
            PairConfig :func:`mori_tp.pair_staging_for`).
        backend, stream, synchronize: as for :func:`mori_tp.unpack_kvcache`.
        buffers: only these ``(first, end)`` ranges of buffers (a chunk of a pipelined or
            streamed request); range ``(b0, b1)`` is read from ``[b0 * staging_len,
            b1 * staging_len)`` of the region.
    """
    pair = isinstance(config, PairConfig)
    if staging is None:
        staging = mori_tp.pair_staging_for(config) if pair else mori_tp.staging_for(config)
    chosen = _staging(staging, "unpack_request")
    if not chosen.unpacks:
        return chosen
    ranges = _ranges(buffers, len(memory.buffers))
    length = 0
    if buffers is not None:
        length = (mori_tp.pair_staging_len(config, request.num_tokens) if pair
                  else mori_tp.staging_len(config, len(request)))
    for first, end in ranges:
        if buffers is None:
            region, capacity = memory.staging, memory.staging_capacity
        else:
            # The part of the region the whole request would give these buffers, clipped to
            # the region so that a region too small is refused by the library with its sizes.
            offset = min(first * length, memory.staging_capacity)
            region = memory.staging + offset
            capacity = min((end - first) * length, memory.staging_capacity - offset)
        if pair:
            mori_tp.unpack_kvcache_pair(
                config, chosen, region, memory.buffers[first:end], dst_capacity=memory.capacity,
                request=request, staging_capacity=capacity,
                backend=backend, stream=stream, synchronize=synchronize,
            )
            continue
        mori_tp.unpack_kvcache(
            config, region, memory.buffers[first:end], dst_capacity=memory.capacity,
            dst_pages=request, staging_capacity=capacity,
            backend=backend, stream=stream, synchronize=synchronize,
        )
    return chosen



def _ranges(buffers: Optional[BufferRanges], num_buffers: int) -> List[Tuple[int, int]]:
    """``buffers`` checked against ``num_buffers`` (None: all of them, as one range)."""
    if buffers is None:
        return [(0, num_buffers)]
    out = []
    for item in buffers:
        try:
            first, end = (operator.index(v) for v in item)
        except (TypeError, ValueError):
            raise TypeError(f"buffer range {item!r} is not a (first, end) pair of ints") from None
        if not 0 <= first < end <= num_buffers:
            raise InvalidArgumentError(
                f"buffer range ({first}, {end}) is empty or outside the {num_buffers} buffers"
            )
        out.append((first, end))
    return out


def buffer_indices(buffers: Optional[BufferRanges], num_buffers: int) -> List[int]:
    """The buffer indices of ``buffers``, in order (None: every buffer)."""
    return [b for first, end in _ranges(buffers, num_buffers) for b in range(first, end)]


def _staging(value: Any, where: str) -> Staging:
    try:
        return Staging(value)
    except ValueError:
        raise InvalidArgumentError(
            f"{where}: staging {value!r} is not a Staging (0 NONE, 1 SRC, 2 DST, 3 BOTH)"
        ) from None
