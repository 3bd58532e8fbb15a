"""Pipelined and layer-wise streamed requests, for any transport with notifications (Mooncake,
NIXL): the engine-neutral part of moving a request in chunks.

A chunk is a set of buffer ranges ``(first, end)``. Buffer ``b``'s staged bytes sit at
``b * staging_len`` of a staging region, so a range is one contiguous part of each region, its
pack is a pack of those buffers into that part, and its segments are the request's per-buffer
list applied to those buffers (:meth:`RequestPlan.addresses` with ``buffers``). Nothing here
depends on how a plan computed its segments.

Prefill rank (:class:`Streamer`, one per transport)::

    streamer = Streamer(transport)
    # Whole request, pipelined: pack chunk i+1 while chunk i is written and the decode rank
    # unpacks chunk i-1.
    result = streamer.send(peer, plan, "req-17")
    # Layer by layer, behind prefill compute:
    stream = streamer.open(peer, plan, "req-18", layers=num_layers)
    for layer in range(num_layers):
        run_layer(layer)
        stream.submit(layer, ready=layer_event)   # a torch.cuda.Event, a hipEvent_t (int),
                                                  # a callable, or None
    stream.seal()                                 # after the last layer: the count is final
    result = stream.wait()

Decode rank (:class:`Receiver`, one per transport)::

    receiver = Receiver(transport).start()
    incoming = receiver.expect("req-17", config, dst_pages, memory=slot_memory,
                               num_buffers=num_buffers)
    receiver.wait(incoming)          # every chunk landed and unpacked; or TransferError

Protocol (ASCII notifications, delivered by the engine after the data they follow):
``mori-tp/1 <request> chunk <index> <ranges>`` after each chunk's data, with `` sealed <count>``
appended to the last one when the sender has sealed by then, else a separate
``mori-tp/1 <request> sealed <count>``; ``mori-tp/1 <request> abort <reason>`` when the sender
fails. ``<ranges>`` is ``first-end`` pairs joined by commas. The receiver unpacks each chunk as
it arrives (staging DST or BOTH), and completes the request once it is sealed, every chunk
below the count has arrived and every buffer has arrived exactly once. A chunk index or a
buffer that arrives twice, or a seal whose count disagrees with what arrived, fails the
request with an error that names them; a request that makes no progress for ``timeout``
seconds (default :data:`DEFAULT_TIMEOUT`) fails naming what is missing. Nothing waits forever.

Chunk size (:func:`chunk_ranges`): ``min(num_buffers, cap, bytes // MIN_CHUNK_BYTES)``
chunks (at least 1) of whole buffers, as even as buffers allow, where ``cap`` is half the host's
cores, at least 2 and at most ``MAX_AUTO_CHUNKS``: 2 chunks from 8 MiB up on two cores. With ``n`` chunks the stages that are not the bottleneck are hidden but for about
``1/n`` of their time, and each chunk costs one engine call, one notification and two thread
wake-ups (about 0.3 ms, measured on 2026-12-01); REFERENCE.md section 13 gives the measurement
behind the constants, and BENCHMARKS.md's ``engines-staged`` table the latest run.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import mori_tp
from mori_tp import (
    BackendUnavailableError,
    GpuError,
    InvalidArgumentError,
    PageIndices,
    SliceConfig,
    Staging,
)

from . import (
    BufferRanges,
    KvMemory,
    RequestPlan,
    SendResult,
    TransferError,
    _ranges,
    _staging,
    buffer_indices,
    unpack_request,
)
from .faults import TransferTimeoutError, about, planned_epoch

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_AUTO_CHUNKS",
    "MIN_CHUNK_BYTES",
    "Incoming",
    "Receiver",
    "RequestStream",
    "Streamer",
    "chunk_ranges",
    "hip_event_synchronize",
    "layer_buffers",
]

#: Seconds any wait of this module lasts at most unless told otherwise: a stream's wait, a
#: receiver's wait, one engine write, and a request that makes no progress.
DEFAULT_TIMEOUT = 60.0
#: No automatic chunk is smaller than this: each chunk costs about 0.3 ms here (an engine call,
#: a notification, two thread wake-ups), which smaller chunks do not win back (measured on
#: 2026-12-01; REFERENCE.md section 13).
MIN_CHUNK_BYTES = 4 << 20
#: At most this many automatic chunks, and at most half the host's cores: overlapped stages need
#: cores of their own (on two cores 2 chunks were best in half the cases measured on 2026-12-01,
#: 4 and 16 in none; REFERENCE.md section 13).
MAX_AUTO_CHUNKS = 8

PROTOCOL = "mori-tp/1"


def chunk_ranges(num_buffers: int, bytes_per_buffer: int,
                 chunks: Optional[int] = None) -> List[Tuple[int, int]]:
    """The buffer ranges of a pipelined request: ``chunks`` ranges of whole buffers (default:
    the rule in the module docs), as even as the buffers allow, in buffer order."""
    if num_buffers <= 0:
        return []
    if chunks is None:
        total = num_buffers * max(bytes_per_buffer, 0)
        cap = max(2, min(MAX_AUTO_CHUNKS, (os.cpu_count() or 2) // 2))
        chunks = min(num_buffers, cap, max(1, total // MIN_CHUNK_BYTES))
    if not 1 <= chunks <= num_buffers:
        raise InvalidArgumentError(
            f"chunk_ranges: {chunks} chunks of {num_buffers} buffers (1 to {num_buffers})"
        )
    bounds = [num_buffers * i // chunks for i in range(chunks + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(chunks)]


def layer_buffers(num_buffers: int, num_layers: int) -> Callable[[int], List[Tuple[int, int]]]:
    """Which buffers hold layer ``l``: buffer ``l`` when there is one buffer per layer (MLA),
    buffers ``l`` and ``num_layers + l`` when there are two (K of each layer, then V of each
    layer: the MoriKvBuffers order)."""
    if num_layers <= 0 or num_buffers not in (num_layers, 2 * num_layers):
        raise InvalidArgumentError(
            f"layer_buffers: {num_buffers} buffers are neither one nor two per layer for "
            f"{num_layers} layers; pass buffer ranges to submit() instead"
        )
    per_layer = num_buffers // num_layers

    def buffers(layer: int) -> List[Tuple[int, int]]:
        if not 0 <= layer < num_layers:
            raise InvalidArgumentError(f"layer {layer} is outside the {num_layers} layers")
        return [(layer + k * num_layers, layer + k * num_layers + 1) for k in range(per_layer)]

    return buffers


def _merged(indices: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted buffer indices as maximal ranges."""
    out: List[Tuple[int, int]] = []
    for b in sorted(indices):
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


def _check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not request_id or len(request_id) > 200 or any(
            c.isspace() or not c.isprintable() for c in request_id):
        raise InvalidArgumentError(
            f"request id {request_id!r} must be 1-200 printable characters without spaces"
        )
    return request_id


def chunk_message(request_id: str, index: int, ranges: BufferRanges,
                  sealed: Optional[int] = None) -> bytes:
    text = f"{PROTOCOL} {request_id} chunk {index} " + ",".join(f"{a}-{b}" for a, b in ranges)
    if sealed is not None:
        text += f" sealed {sealed}"
    return text.encode()


def seal_message(request_id: str, count: int) -> bytes:
    return f"{PROTOCOL} {request_id} sealed {count}".encode()


def abort_message(request_id: str, reason: str) -> bytes:
    reason = " ".join(reason.split())[:300]
    return f"{PROTOCOL} {request_id} abort {reason}".encode("ascii", "replace")


@dataclass(frozen=True)
class Message:
    """A parsed notification of this protocol."""

    request_id: str
    #: "chunk", "sealed" or "abort".
    kind: str
    index: int = -1
    ranges: Tuple[Tuple[int, int], ...] = ()
    sealed: Optional[int] = None
    reason: str = ""


def parse_message(message: bytes) -> Optional[Message]:
    """The protocol message in ``message``, or None when it is not one (another user's
    notification). A malformed message of this protocol is kind "malformed"."""
    try:
        words = message.decode("ascii").split(" ")
    except UnicodeDecodeError:
        return None
    if len(words) < 3 or words[0] != PROTOCOL:
        return None
    request_id, kind = words[1], words[2]
    try:
        if kind == "chunk" and len(words) in (5, 7):
            ranges = tuple(tuple(int(v) for v in part.split("-"))
                           for part in words[4].split(","))
            if any(len(r) != 2 for r in ranges) or (len(words) == 7 and words[5] != "sealed"):
                raise ValueError
            sealed = int(words[6]) if len(words) == 7 else None
            return Message(request_id, kind, int(words[3]), ranges, sealed)  # type: ignore
        if kind == "sealed" and len(words) == 4:
            return Message(request_id, kind, sealed=int(words[3]))
        if kind == "abort":
            return Message(request_id, kind, reason=" ".join(words[3:]))
    except ValueError:
        pass
    return Message(request_id, "malformed", reason=repr(message))


# --- the prefill side ----------------------------------------------------------------------


#: Where :func:`hip_event_synchronize` looks for HIP's runtime, in order: the loader's search
#: path, then ``$ROCM_PATH/lib`` and ``/opt/rocm/lib``.
HIP_RUNTIME_NAMES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")

_hip_sync_lock = threading.Lock()
_hip_sync: Optional[Callable[[int], int]] = None


def _load_hip_runtime() -> Any:
    """HIP's runtime (libamdhip64) through ctypes, or BackendUnavailableError naming where it
    looked."""
    tried = []
    roots = [os.environ.get("ROCM_PATH", ""), "/opt/rocm"]
    candidates = list(HIP_RUNTIME_NAMES) + [os.path.join(root, "lib", "libamdhip64.so")
                                            for root in roots if root]
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError as error:
            tried.append(f"{name} ({error})")
    raise BackendUnavailableError(
        "a hipEvent_t as ready= needs HIP's runtime (libamdhip64), which could not be loaded: "
        "tried " + "; ".join(tried) + ". Install ROCm or set ROCM_PATH, or pass an object "
        "with synchronize() (a torch.cuda.Event) or a callable instead")


def hip_event_synchronize(event: int) -> None:
    """Blocks until a ``hipEvent_t`` (its handle as an int) has completed:
    ``hipEventSynchronize`` from libamdhip64, loaded once with ctypes (:data:`HIP_RUNTIME_NAMES`).

    Raises:
        BackendUnavailableError: libamdhip64 cannot be loaded, or has no hipEventSynchronize.
        GpuError: hipEventSynchronize failed (its hipError_t in the message).
        InvalidArgumentError: a null handle.
    """
    global _hip_sync
    if not event:
        raise InvalidArgumentError("ready: a hipEvent_t of 0 is a null event")
    with _hip_sync_lock:
        if _hip_sync is None:
            runtime = _load_hip_runtime()
            try:
                function = runtime.hipEventSynchronize
            except AttributeError:
                raise BackendUnavailableError(
                    f"the HIP runtime {getattr(runtime, '_name', runtime)!r} has no "
                    "hipEventSynchronize") from None
            function.argtypes = [ctypes.c_void_p]
            function.restype = ctypes.c_int
            _hip_sync = function
        sync = _hip_sync
    status = sync(event)
    if status != 0:
        raise GpuError(f"hipEventSynchronize(0x{event:x}) failed: hipError_t {status}")


def _wait_ready(ready: Any) -> None:
    """Blocks until a layer's data is ready: None (now), an object with a ``synchronize()``
    method (a torch.cuda.Event; on ROCm it wraps a hipEvent), a ``hipEvent_t`` handle as an int
    (:func:`hip_event_synchronize`), or a callable."""
    if ready is None:
        return
    if hasattr(ready, "synchronize"):
        ready.synchronize()
    elif isinstance(ready, int) and not isinstance(ready, bool):
        hip_event_synchronize(ready)
    elif callable(ready):
        ready()
    else:
        raise TypeError(f"ready must be None, a callable, a hipEvent_t (int) or have "
                        f"synchronize(), not {ready!r}")


class RequestStream:
    """One request in flight from this rank: chunks submitted as they become ready, written in
    order by the :class:`Streamer`'s threads. Get one from :meth:`Streamer.open`."""

    def __init__(self, streamer: "Streamer", peer: Any, plan: RequestPlan, request_id: str,
                 layers: Optional[int], backend: str, stream: Optional[int],
                 timeout: float, release: Optional[Callable[[], None]] = None) -> None:
        self._streamer = streamer
        self.peer = peer
        self.plan = plan
        self.request_id = _check_request_id(request_id)
        self.num_layers = layers
        self._layer = layer_buffers(plan.num_buffers, layers) if layers is not None else None
        self.backend = backend
        self.stream = stream
        self.timeout = timeout
        self._lock = threading.Lock()
        self._submitted = [False] * plan.num_buffers
        self._chunks = 0
        self._sealed: Optional[int] = None
        self._seal_sent = False
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._carrier: Optional[Tuple[int, int]] = None
        #: Chunks queued for the packing thread and not yet handed to the writing thread.
        self._in_packing = 0
        #: Chunks and seals submitted whose writing thread has not finished with them: while
        #: any is, the streamer may still read the local memory (the staging slot).
        self._busy = 0
        self._release = release
        #: Set once ``release`` has run (or would have: a stream without one), see released.
        self._released = threading.Event()
        #: Why the slot was kept instead of released (an engine that may still read it).
        self.kept: Optional[str] = None
        self.pack_seconds = 0.0
        self.write_seconds = 0.0
        self.segments = 0
        self.bytes = 0
        self.calls = 0
        self.started = time.perf_counter()

    # -- what the caller does --

    def submit(self, layers: Union[int, Sequence[int], None] = None, *,
               buffers: Optional[BufferRanges] = None, ready: Any = None,
               pack_here: bool = False) -> int:
        """Queues one chunk: ``layers`` (a layer or several; needs ``layers=`` at open) or
        ``buffers`` (ranges). Packing waits for ``ready`` (None: ready now; a callable; an
        object with ``synchronize()``, such as the layer's torch.cuda.Event; or a raw
        ``hipEvent_t`` handle as an int, synchronized with ``hipEventSynchronize`` from
        libamdhip64, loaded with ctypes: :func:`hip_event_synchronize`) on the streamer's
        thread, so this returns at once; with ``pack_here`` it waits and packs on the calling
        thread instead (one thread handoff fewer per chunk, for a caller that has nothing else
        to do, as :meth:`Streamer.send`). Returns the chunk's index.

        Raises InvalidArgumentError, changing nothing, for a buffer already submitted (a layer
        submitted twice), a stream already sealed, or ranges outside the buffers; the error of
        an earlier chunk (TransferError) once the stream has failed.
        """
        if (layers is None) == (buffers is None):
            raise TypeError("submit: pass layers or buffers, not both or neither")
        if layers is not None:
            if self._layer is None:
                raise InvalidArgumentError(
                    f"submit: request {self.request_id} was opened without layers=; pass "
                    "buffers=[(first, end), ...]")
            chosen = [layers] if isinstance(layers, int) else list(layers)
            indices = [b for layer in chosen for a, e in self._layer(layer) for b in range(a, e)]
        else:
            indices = buffer_indices(buffers, self.plan.num_buffers)
        with self._lock:
            if self._error is not None:
                raise TransferError(f"request {self.request_id} failed: {self._error}")
            if self._sealed is not None:
                raise InvalidArgumentError(
                    f"submit: request {self.request_id} is sealed with {self._sealed} chunks")
            again = sorted({b for b in indices if self._submitted[b]})
            if again or len(set(indices)) != len(indices):
                twice = again or sorted({b for b in indices if indices.count(b) > 1})
                raise InvalidArgumentError(
                    f"submit: request {self.request_id}: {self._describe(twice)} "
                    "already submitted (each buffer is sent exactly once)")
            for b in indices:
                self._submitted[b] = True
            index = self._chunks
            self._chunks += 1
            self._busy += 1
            if not pack_here:
                self._in_packing += 1
        item = (self, index, _merged(indices), ready)
        if pack_here:
            self._streamer._pack(item)
        else:
            self._streamer._packing.put(item)
        return index

    def seal(self) -> int:
        """Fixes the chunk count after the last submit; the decode rank learns it with the last
        chunk or in a message of its own. Returns the count. Raises InvalidArgumentError,
        changing nothing, when a buffer (a layer) was never submitted or the stream is sealed
        already."""
        with self._lock:
            if self._sealed is not None:
                raise InvalidArgumentError(
                    f"seal: request {self.request_id} is already sealed with {self._sealed} "
                    "chunks")
            missing = [b for b, done in enumerate(self._submitted) if not done]
            if missing:
                raise InvalidArgumentError(
                    f"seal: request {self.request_id}: {self._describe(missing)} never "
                    "submitted (seal after the last layer)")
            self._sealed = self._chunks
            self._busy += 1
            # Straight to the writing thread when no chunk of this stream waits to be packed.
            direct = self._in_packing == 0
        (self._streamer._writing if direct else self._streamer._packing).put(
            (self, None, None, None))
        return self._chunks

    def wait(self, timeout: Optional[float] = None) -> SendResult:
        """Waits until every chunk and the seal are written (``timeout``: default the
        stream's); returns what moved. Raises the first error of any chunk, or TransferError
        after the timeout (the stream then fails: later chunks are not written)."""
        limit = self.timeout if timeout is None else timeout
        if not self._done.wait(limit):
            self._fail(TransferTimeoutError(
                f"request {self.request_id} {about(self.peer, None)}: not written after "
                f"{limit} s: {self._progress()}", peer=self.peer, request_id=self.request_id))
        if self._error is not None:
            raise self._error
        return SendResult(self.plan.staging, self.segments, self.bytes, self.calls,
                          self.pack_seconds, self.write_seconds, chunks=self._chunks)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def released(self, timeout: Optional[float] = None) -> bool:
        """Waits until the stream no longer uses its local memory (every chunk it took is
        written or dropped) and its ``release`` has run; returns True. ``timeout``: seconds,
        default the stream's (:meth:`Streamer.open`'s ``timeout``, else the streamer's,
        :data:`DEFAULT_TIMEOUT` = 60 s unless told otherwise); never unbounded. A failed
        stream gets there once the engine call in progress, if any, has returned (the engine
        bounds it); one whose engine may still read the memory (``engine_busy``) never does,
        and says why in :attr:`kept`.

        Raises:
            TransferTimeoutError: not released after ``timeout`` seconds; the message says
                why the memory is kept (:attr:`kept`) or what is still in progress.
        """
        limit = self.timeout if timeout is None else timeout
        if not self._released.wait(limit):
            why = self.kept or f"still in use: {self._progress()}"
            raise TransferTimeoutError(
                f"request {self.request_id} {about(self.peer, None)}: local memory not "
                f"released after {limit} s: {why}", peer=self.peer,
                request_id=self.request_id)
        return True

    # -- helpers --

    def _describe(self, buffers: Sequence[int]) -> str:
        if self._layer is not None and self.num_layers:
            layers = sorted({b % self.num_layers for b in buffers})
            return f"layers {layers} (buffers {list(buffers)})"
        return f"buffers {list(buffers)}"

    def _progress(self) -> str:
        with self._lock:
            sealed = "not sealed" if self._sealed is None else f"sealed with {self._sealed}"
            return f"{self._chunks} chunks submitted, {sealed}, seal sent: {self._seal_sent}"

    def _fail(self, error: BaseException) -> None:
        if isinstance(error, TransferError):
            # Name the request and the peer on errors that came without them.
            if error.request_id is None:
                error.request_id = self.request_id
            if error.peer is None:
                error.peer = self.peer
        with self._lock:
            if self._error is None and not self._done.is_set():
                self._error = error
            else:
                return
        self._done.set()
        self._streamer._abort(self, str(error))
        self._maybe_release()

    def _finish(self) -> None:
        self._done.set()
        self._maybe_release()

    def _put_down(self) -> None:
        """The writing thread is done with one chunk or seal of this stream."""
        with self._lock:
            self._busy -= 1
        self._maybe_release()

    def _maybe_release(self) -> None:
        """Runs ``release`` once the stream has ended and nothing of it is in use."""
        with self._lock:
            if self._released.is_set() or self.kept or not self._done.is_set() or self._busy:
                return
            if isinstance(self._error, TransferError) and self._error.engine_busy:
                self.kept = (f"request {self.request_id}: the engine may still read its "
                             f"memory ({self._error}); its staging slot is not released")
                return
            self._released.set()
            release, self._release = self._release, None
        if release is not None:
            try:
                release()
            except Exception as error:  # noqa: BLE001 - reported; the threads must go on
                self.kept = f"request {self.request_id}: release raised {error!r}"


class Streamer:
    """Writes requests in chunks through one transport: a packing thread and a writing thread
    shared by every request in flight, so that packing chunk i+1 overlaps writing chunk i (the
    engine and the pack release the GIL). Requests interleave in submission order.

    The transport needs ``write(peer, src, dst, lengths, notification=...)``,
    ``notify(peer, message, carrier=...)`` and, on the receiving side, ``poll_notifications()``:
    :class:`~mori_tp.engines.mooncake.MooncakeTransport` and
    :class:`~mori_tp.engines.nixl.NixlTransport` have them.
    """

    def __init__(self, transport: Any, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.transport = transport
        self.timeout = timeout
        self._closing = False
        self._packing: "queue.Queue[Any]" = queue.Queue()
        self._writing: "queue.Queue[Any]" = queue.Queue()
        self._threads = [
            threading.Thread(target=self._pack_loop, name="mori-tp-pack", daemon=True),
            threading.Thread(target=self._write_loop, name="mori-tp-write", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def open(self, peer: Any, plan: RequestPlan, request_id: str, *,
             layers: Optional[int] = None, backend: str = "auto",
             stream: Optional[int] = None, timeout: Optional[float] = None,
             release: Optional[Callable[[], None]] = None) -> RequestStream:
        """A stream for one request to ``peer``; submit its chunks, then seal. ``layers``: the
        model's layers, when the plan's buffers are one or two per layer (see
        :func:`layer_buffers`), to submit by layer. ``timeout``: the stream's (default the
        streamer's), for its wait and each engine write.

        ``release``: called once, on a streamer thread, when the stream has ended (written,
        or failed) and none of its chunks is being packed or written any more: return the
        request's staging slot there (``lambda: pool.free(slot)``). Not called while the
        engine may still read the memory (an error with ``engine_busy``; :attr:`RequestStream.kept`
        says so).

        Raises :class:`~mori_tp.engines.StaleRegistrationError` at once, with nothing queued,
        when the plan's registration epoch is not the one the peer announced last."""
        epochs = getattr(self.transport, "peer_epochs", None)
        if epochs is not None:
            epochs.check("streamer", peer, planned_epoch(plan), request_id)
        return RequestStream(self, peer, plan, request_id, layers, backend, stream,
                             self.timeout if timeout is None else timeout, release)

    def send(self, peer: Any, plan: RequestPlan, request_id: str, *,
             chunks: Optional[int] = None, backend: str = "auto",
             stream: Optional[int] = None, timeout: Optional[float] = None,
             release: Optional[Callable[[], None]] = None) -> SendResult:
        """One whole request, pipelined: its buffers in :func:`chunk_ranges` chunks, submitted
        at once and sealed; returns when every chunk is written (``release`` as for
        :meth:`open`)."""
        request = self.open(peer, plan, request_id, backend=backend, stream=stream,
                            timeout=timeout, release=release)
        # The caller packs chunk i+1 while the writing thread writes chunk i.
        for ranges in chunk_ranges(plan.num_buffers, plan.bytes_per_buffer, chunks):
            request.submit(buffers=[ranges], pack_here=True)
        request.seal()
        return request.wait()

    def close(self, timeout: Optional[float] = None) -> None:
        """Stops the threads once the queued work is done, waiting at most ``timeout`` seconds
        for both (default the streamer's ``timeout``, :data:`DEFAULT_TIMEOUT` = 60 s unless
        told otherwise). Closing again waits again for threads still running.

        Raises:
            TransferTimeoutError: a thread still running after ``timeout`` (a ``ready`` that
                never returns, an engine call that does not end); the message names it.
        """
        limit = self.timeout if timeout is None else timeout
        if not self._closing:
            self._closing = True
            self._packing.put(None)
        deadline = time.monotonic() + limit
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        running = [thread.name for thread in self._threads if thread.is_alive()]
        if running:
            raise TransferTimeoutError(
                f"Streamer.close: {', '.join(running)} still running after {limit} s "
                f"({self._packing.qsize()} items waiting to pack, {self._writing.qsize()} to "
                f"write): a ready= that has not returned, or an engine call in progress")

    def __enter__(self) -> "Streamer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _pack_loop(self) -> None:
        while True:
            item = self._packing.get()
            if item is None:
                self._writing.put(None)
                return
            self._packed(item)

    def _pack(self, item: Tuple[RequestStream, Optional[int], Any, Any]) -> None:
        """Waits for a chunk's data and packs it (if the staging packs), then hands it to the
        writing thread; a seal passes through."""
        request, index, ranges, ready = item
        if index is not None and request._error is None:
            try:
                _wait_ready(ready)
                request.pack_seconds += request.plan.pack(
                    backend=request.backend, stream=request.stream, buffers=ranges)
            except BaseException as error:  # noqa: B036 - reported to the caller's wait
                request._fail(error)
        self._writing.put(item)

    def _packed(self, item: Tuple[RequestStream, Optional[int], Any, Any]) -> None:
        """The packing thread's part: pack, then count the chunk out of the packing queue."""
        request = item[0]
        self._pack(item)
        if item[1] is not None:
            with request._lock:
                request._in_packing -= 1

    def _write_loop(self) -> None:
        while True:
            item = self._writing.get()
            if item is None:
                return
            request, index, ranges, _ = item
            try:
                if request._error is not None:
                    continue
                if index is None:
                    self._write_seal(request)
                else:
                    self._write_chunk(request, index, ranges)
            except BaseException as error:  # noqa: B036 - reported to the caller's wait
                request._fail(error)
            finally:
                request._put_down()

    def _write_chunk(self, request: RequestStream, index: int,
                     ranges: List[Tuple[int, int]]) -> None:
        with request._lock:
            last = request._sealed is not None and index == request._sealed - 1
            if last:
                request._seal_sent = True
        message = chunk_message(request.request_id, index, ranges,
                                request._sealed if last else None)
        src, dst, lengths = request.plan.addresses(ranges)
        start = time.perf_counter()
        request.calls += self.transport.write(request.peer, src, dst, lengths,
                                              notification=message, timeout=request.timeout,
                                              epoch=planned_epoch(request.plan),
                                              request_id=request.request_id)
        request.write_seconds += time.perf_counter() - start
        request.segments += len(lengths)
        request.bytes += int(lengths.sum())
        if len(lengths):
            # The last byte written: the same bytes again carry a later notification.
            request._carrier = (int(src[-1] + lengths[-1] - 1), int(dst[-1] + lengths[-1] - 1))
        if last:
            request._finish()

    def _write_seal(self, request: RequestStream) -> None:
        if not request._seal_sent:
            request._seal_sent = True
            self.transport.notify(request.peer, seal_message(request.request_id,
                                                             request._sealed or 0),
                                  carrier=request._carrier, timeout=request.timeout,
                                  epoch=planned_epoch(request.plan),
                                  request_id=request.request_id)
        request._finish()

    def _abort(self, request: RequestStream, reason: str) -> None:
        """Tells the decode rank that the request failed, where the engine can carry it: on a
        thread of its own, so that a failing caller is not held up by a peer that does not
        answer; the stream counts as busy (its carrier byte is read) until it is done."""
        with request._lock:
            request._busy += 1

        def abort() -> None:
            try:
                self.transport.notify(request.peer, abort_message(request.request_id, reason),
                                      carrier=request._carrier, timeout=request.timeout,
                                      epoch=planned_epoch(request.plan),
                                      request_id=request.request_id)
            except BaseException:  # noqa: B036 - best effort: the receiver's timeout ends it
                pass
            finally:
                request._put_down()

        threading.Thread(target=abort, name="mori-tp-abort", daemon=True).start()


# --- the decode side -----------------------------------------------------------------------


@dataclass
class Incoming:
    """One request the decode rank expects (:meth:`Receiver.expect`) and its progress."""

    request_id: str
    config: SliceConfig
    dst_pages: Any
    memory: KvMemory
    staging: Staging
    num_buffers: int
    backend: str
    timeout: float
    on_chunk: Optional[Callable[["Incoming", Tuple[Tuple[int, int], ...]], None]] = None
    on_done: Optional[Callable[["Incoming"], None]] = None
    #: Buffers that have landed (and been unpacked, when staged).
    buffers_ready: Set[int] = field(default_factory=set)
    #: Chunk indices that have landed.
    chunks: Set[int] = field(default_factory=set)
    #: The chunk count, once the sender sealed.
    sealed: Optional[int] = None
    #: Why the request failed (then ``done`` is set too).
    error: Optional[BaseException] = None
    #: time.monotonic() when it completed or failed.
    finished_at: Optional[float] = None
    unpack_seconds: float = 0.0
    last_progress: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    #: The sender, once a message of the request has arrived.
    peer: Any = None

    @property
    def complete(self) -> bool:
        return self.done.is_set() and self.error is None

    def missing(self) -> str:
        """What has not arrived, in words."""
        gone = sorted(set(range(self.num_buffers)) - self.buffers_ready)
        if self.sealed is None:
            return f"not sealed; {len(self.chunks)} chunks arrived; buffers {gone} missing"
        chunks = sorted(set(range(self.sealed)) - self.chunks)
        return f"sealed with {self.sealed} chunks; chunks {chunks} and buffers {gone} missing"

    def unpacked(self) -> str:
        """What of the request reached its buffers, in words: the chunks whose notification
        arrived (unpacked, when staged); nothing else was unpacked."""
        landed = sorted(self.buffers_ready)
        where = ("unpacked into the page buffers" if self.staging.unpacks
                 else "written in place")
        if not landed:
            return "no chunk arrived, nothing was unpacked"
        return (f"buffers {landed} ({len(self.chunks)} chunks) arrived and were {where}; no "
                "other data was unpacked")

    def layers_ready(self, num_layers: int) -> List[int]:
        """The layers all of whose buffers have landed."""
        of = layer_buffers(self.num_buffers, num_layers)
        return [layer for layer in range(num_layers)
                if all(b in self.buffers_ready for a, e in of(layer) for b in range(a, e))]


class Receiver:
    """The decode rank's side of pipelined and streamed requests, over one transport: takes the
    transport's notifications, unpacks each chunk as it lands (DST or BOTH staging), completes
    requests in whatever order they finish, and reports every protocol violation.

    Call :meth:`poll` from your loop, or :meth:`start` a thread that polls. Notifications for a
    request that is not expected yet are kept until it is.

    The thread polls every ``poll_interval`` seconds while notifications keep coming and backs
    off, doubling, to ``max_poll_interval`` while none do: a poll is not free (NIXL's
    ``update_notifs`` polled back to back takes about 40% of a core here), and on a host with
    few cores that time comes out of the copies.
    """

    def __init__(self, transport: Any, *, poll_interval: float = 0.0001,
                 max_poll_interval: float = 0.001,
                 early_timeout: float = DEFAULT_TIMEOUT) -> None:
        self.transport = transport
        self.poll_interval = poll_interval
        self.max_poll_interval = max(max_poll_interval, poll_interval)
        #: Seconds a message for a request nobody expects is kept (then dropped, and recorded in
        #: violations): a request that is never expected, or an abort for one that never began.
        self.early_timeout = early_timeout
        self._lock = threading.RLock()
        self._incoming: Dict[str, Incoming] = {}
        self._early: Dict[str, List[Message]] = {}
        self._early_since: Dict[str, float] = {}
        self._finished: List[Incoming] = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        #: Notifications that are not this protocol's, as (peer, message), for other users.
        self.others: List[Tuple[Any, bytes]] = []
        self._received = 0
        #: Messages for requests that had already completed, in words: a sender that sent
        #: more than it sealed. Reported here and on the request (its ``error``).
        self.violations: List[str] = []

    def expect(self, request_id: str, config: SliceConfig, dst_pages: PageIndices, *,
               memory: KvMemory, num_buffers: Optional[int] = None,
               staging: Optional[Union[Staging, int]] = None, backend: str = "auto",
               timeout: float = DEFAULT_TIMEOUT,
               on_chunk: Optional[Callable[[Incoming, Tuple[Tuple[int, int], ...]], None]] = None,
               on_done: Optional[Callable[[Incoming], None]] = None) -> Incoming:
        """Registers a request: its pair's config, its destination pages, this rank's memory
        whose staging field is the request's slot, and the staging the sender uses (default
        :func:`mori_tp.staging_for`). ``on_chunk(incoming, ranges)`` runs after each chunk has
        landed and been unpacked (per-layer readiness), ``on_done(incoming)`` once it completes
        or fails (both on the polling thread); ``timeout`` bounds the time without progress."""
        chosen = _staging(mori_tp.staging_for(config) if staging is None else staging,
                          "Receiver.expect")
        incoming = Incoming(_check_request_id(request_id), config, dst_pages, memory, chosen,
                            len(memory.buffers) if num_buffers is None else num_buffers,
                            backend, timeout, on_chunk, on_done)
        with self._lock:
            if request_id in self._incoming and not self._incoming[request_id].done.is_set():
                raise InvalidArgumentError(f"Receiver.expect: request {request_id} is already "
                                           "expected")
            self._incoming[request_id] = incoming
            self._early_since.pop(request_id, None)
            for message in self._early.pop(request_id, []):
                self._apply(incoming, message)
        return incoming

    def forget(self, incoming: Incoming) -> None:
        """Drops a finished request (its id may then be expected again)."""
        with self._lock:
            if self._incoming.get(incoming.request_id) is incoming:
                del self._incoming[incoming.request_id]

    def poll(self) -> List[Incoming]:
        """Takes the transport's new notifications and applies them; returns the requests that
        completed or failed since the last poll."""
        with self._lock:
            for peer, raw in self.transport.poll_notifications():
                self._received += 1
                message = parse_message(raw)
                if message is None:
                    self.others.append((peer, raw))
                    continue
                incoming = self._incoming.get(message.request_id)
                if incoming is None:
                    self._early.setdefault(message.request_id, []).append(message)
                    self._early_since.setdefault(message.request_id, time.monotonic())
                    continue
                if incoming.peer is None:
                    incoming.peer = peer
                self._apply(incoming, message)
            now = time.monotonic()
            for incoming in list(self._incoming.values()):
                if not incoming.done.is_set() and now - incoming.last_progress > incoming.timeout:
                    self._fail(incoming, TransferTimeoutError(
                        f"request {incoming.request_id}"
                        + (f" from {incoming.peer}" if incoming.peer is not None else "")
                        + f": no progress for {incoming.timeout} s: {incoming.missing()}; "
                        f"{incoming.unpacked()}", peer=incoming.peer,
                        request_id=incoming.request_id))
            for rid, since in list(self._early_since.items()):
                if now - since > self.early_timeout:
                    dropped = self._early.pop(rid, [])
                    del self._early_since[rid]
                    kinds = ", ".join(m.kind for m in dropped)
                    self.violations.append(
                        f"request {rid}: {len(dropped)} messages ({kinds}) for a request never "
                        f"expected, dropped after {self.early_timeout} s")
            finished, self._finished = self._finished, []
            return finished

    def wait(self, incoming: Incoming, timeout: Optional[float] = None) -> Incoming:
        """Waits until ``incoming`` completes; raises its error, or TransferError after
        ``timeout`` seconds (default: the request's own timeout)."""
        limit = incoming.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not incoming.done.is_set():
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"request {incoming.request_id}: not complete after {limit} s: "
                    f"{incoming.missing()}", peer=incoming.peer,
                    request_id=incoming.request_id)
            if self._thread is not None:
                incoming.done.wait(min(0.05, max(deadline - time.monotonic(), 0)))
            else:
                self.poll()
                if not incoming.done.is_set():
                    time.sleep(self.poll_interval)
        if incoming.error is not None:
            raise incoming.error
        return incoming

    def start(self) -> "Receiver":
        """Polls on a thread of its own until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mori-tp-receive",
                                            daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stops the polling thread, waiting for it at most ``timeout`` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        interval = self.poll_interval
        while not self._stop.is_set():
            try:
                busy = self._poll_counting()
            except Exception as error:  # noqa: BLE001 - keep polling; waits stay bounded
                self.violations.append(f"poll raised {error!r}")
                busy = False
            interval = self.poll_interval if busy else min(2 * interval,
                                                           self.max_poll_interval)
            time.sleep(interval)

    def _poll_counting(self) -> bool:
        """Polls; whether any notification came."""
        before = self._received
        self.poll()
        return self._received != before

    # -- applying messages --

    def _fail(self, incoming: Incoming, error: BaseException) -> None:
        if incoming.done.is_set():
            return
        incoming.error = error
        self._finish(incoming)

    def _finish(self, incoming: Incoming) -> None:
        incoming.finished_at = time.monotonic()
        incoming.done.set()
        self._finished.append(incoming)
        if incoming.on_done is not None:
            try:
                incoming.on_done(incoming)
            except Exception as error:  # noqa: BLE001 - the polling thread must go on
                self.violations.append(f"request {incoming.request_id}: on_done raised "
                                       f"{error!r}")

    def _apply(self, incoming: Incoming, message: Message) -> None:
        rid = incoming.request_id
        if incoming.done.is_set():
            # A finished request got more: report it, never drop it.
            violation = (f"request {rid}: a {message.kind} message (chunk {message.index}) "
                         "arrived after the request had finished")
            self.violations.append(violation)
            if incoming.error is None:
                incoming.error = TransferError(violation)
            return
        incoming.last_progress = time.monotonic()
        if message.kind == "malformed":
            self._fail(incoming, TransferError(f"request {rid}: malformed notification "
                                               f"{message.reason}"))
            return
        if message.kind == "abort":
            self._fail(incoming, TransferError(f"request {rid}: the sender aborted: "
                                               f"{message.reason}"))
            return
        if message.kind == "chunk":
            if message.index in incoming.chunks:
                self._fail(incoming, TransferError(
                    f"request {rid}: chunk {message.index} arrived twice"))
                return
            try:
                ranges = _ranges(message.ranges, incoming.num_buffers)
            except (InvalidArgumentError, TypeError) as error:
                self._fail(incoming, TransferError(f"request {rid}: chunk {message.index}: "
                                                   f"{error}"))
                return
            buffers = [b for a, e in ranges for b in range(a, e)]
            twice = sorted(set(buffers) & incoming.buffers_ready)
            if twice or len(set(buffers)) != len(buffers):
                self._fail(incoming, TransferError(
                    f"request {rid}: chunk {message.index} carries buffers {twice or buffers} "
                    "that already arrived"))
                return
            try:
                start = time.perf_counter()
                unpack_request(incoming.config, incoming.dst_pages, memory=incoming.memory,
                               staging=incoming.staging, backend=incoming.backend,
                               buffers=ranges)
                incoming.unpack_seconds += time.perf_counter() - start
            except Exception as error:  # noqa: BLE001 - the request fails with it
                self._fail(incoming, error)
                return
            incoming.chunks.add(message.index)
            incoming.buffers_ready.update(buffers)
            if incoming.on_chunk is not None:
                try:
                    incoming.on_chunk(incoming, tuple(ranges))
                except Exception as error:  # noqa: BLE001 - the request fails with it
                    self._fail(incoming, error)
                    return
        if message.sealed is not None:
            if incoming.sealed is not None and incoming.sealed != message.sealed:
                self._fail(incoming, TransferError(
                    f"request {rid}: sealed twice, with {incoming.sealed} and "
                    f"{message.sealed} chunks"))
                return
            incoming.sealed = message.sealed
        if incoming.sealed is None:
            return
        beyond = sorted(i for i in incoming.chunks if i >= incoming.sealed)
        if beyond:
            self._fail(incoming, TransferError(
                f"request {rid}: sealed with {incoming.sealed} chunks, but chunks {beyond} "
                "arrived"))
            return
        if len(incoming.chunks) == incoming.sealed:
            if len(incoming.buffers_ready) != incoming.num_buffers:
                self._fail(incoming, TransferError(
                    f"request {rid}: all {incoming.sealed} chunks arrived, but "
                    f"{incoming.missing()}"))
                return
            self._finish(incoming)
