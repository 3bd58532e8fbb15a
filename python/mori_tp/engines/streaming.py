"""Pipelined and layer-wise streamed requests, for any transport with notifications (Mooncake,
NIXL): the engine-neutral part of moving a request in chunks.

A chunk is a set of buffer ranges ``(first, end)``. Buffer ``b``'s staged bytes sit at
``b * staging_len`` of a staging region, so a range is one contiguous part of each region, its
pack is a pack of those buffers into that part, and its segments are the request's per-buffer
list applied to those buffers (:meth:`RequestPlan.addresses` with ``buffers``). Nothing here
depends on how a plan computed its segments.

Decode rank (:class:`Receiver`, one per transport), first: it draws the request's token::

    receiver = Receiver(transport).start()
    incoming = receiver.expect("req-17", config, dst_pages, memory=slot_memory,
                               peer=prefill_name, on_done=lambda _: pool.free(slot))
    # Send incoming.token to the prefill rank with the slot's offset and the page list.
    receiver.wait(incoming)          # every chunk landed and unpacked; or TransferError

Prefill rank (:class:`Streamer`, one per transport)::

    streamer = Streamer(transport)
    # Whole request, pipelined: pack chunk i+1 while chunk i is written and the decode rank
    # unpacks chunk i-1.
    result = streamer.send(peer, plan, "req-17", token=token)
    # Layer by layer, behind prefill compute:
    stream = streamer.open(peer, plan, "req-18", token=token, layers=num_layers)
    for layer in range(num_layers):
        run_layer(layer)
        stream.submit(layer, ready=layer_event)   # a torch.cuda.Event, a hipEvent_t (int),
                                                  # a callable, or None
    stream.seal()                                 # after the last layer: the count is final
    result = stream.wait()

Protocol (:mod:`mori_tp.engines.protocol`, REFERENCE.md section 13): after each chunk's data a
notification ``mori-tp/4 <request> <token> chunk <index> <ranges> staging <mode> reply
<carrier>``, with `` sealed <count>`` before the reply when the sender has sealed by then, else a
separate ``... sealed <count> reply <carrier>``; ``... abort ended|busy <reason>`` when the
sender fails, sent only once every write of the stream has returned. The decode rank answers
``done`` (the sender's ``wait()`` succeeds only then) or ``cancel`` (it gave up: the sender
writes nothing more, answers ``abort ended`` once its writes have returned, and only then is the
request's memory released: ``on_done``; REFERENCE.md section 17). The receiver takes a message only from the request's token holder
(and the bound peer, when given), unpacks each chunk as it arrives (staging DST or BOTH), and
completes the request once it is sealed, every chunk below the count has arrived and every
buffer has arrived exactly once. Anything else (a chunk or buffer twice, a count out of range,
overlapping ranges, a malformed message from the token holder) fails the request with an error
that names it; a message without the token changes nothing and is recorded in
:attr:`Receiver.violations`. A request that makes no progress for ``timeout`` seconds (default
:data:`DEFAULT_TIMEOUT`) fails naming what is missing. Nothing waits forever.

Staging mode and chunks by cost (:mod:`mori_tp.engines.costs`): the prefill rank asks
``streamer.choose(peer, config, src_pages, dst_pages, remote=remote)`` and the decode rank
expects the request with ``staging=BY_SENDER``, offering a slot for the modes that unpack::

    choice = streamer.choose(peer, config, src_pages, dst_pages, remote=remote)
    plan = plan_request(config, src_pages, dst_pages, local=local, remote=remote,
                        staging=choice.staging, token=token)
    streamer.send(peer, plan, "req-19", chunks=choice.chunks, token=token)

Chunk size (:func:`chunk_ranges`): ``min(num_buffers, cap, bytes // MIN_CHUNK_BYTES)``
chunks (at least 1) of whole buffers, as even as buffers allow, where ``cap`` is half the host's
cores, at least 2 and at most ``MAX_AUTO_CHUNKS``: 2 chunks from 8 MiB up on two cores. With
``n`` chunks the stages that are not the bottleneck are hidden but for about ``1/n`` of their
time, and each chunk costs one engine call, one notification and two thread wake-ups (about
0.3 ms, measured on 2026-12-01); REFERENCE.md section 13 gives the measurement behind the
constants, and BENCHMARKS.md's ``engines-staged`` table the latest run.
"""

from __future__ import annotations

import ctypes
import heapq
import hashlib
import hmac
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

import mori_tp
from mori_tp import (
    BackendUnavailableError,
    GpuError,
    InvalidArgumentError,
    PairConfig,
    SliceConfig,
    Staging,
)

from ._requests import (
    BufferRanges,
    KvMemory,
    RequestPlan,
    SendResult,
    _staging,
    buffer_indices,
    unpack_request,
)
from .chunks import MAX_AUTO_CHUNKS, MIN_CHUNK_BYTES, chunk_ranges
from .costs import Choice, CostModel
from .faults import TransferError, TransferTimeoutError, about, planned_epoch
from .inbox import inbox_of, name_bytes
from .protocol import (  # noqa: F401 - chunk_message, seal_message: also from here
    PROTOCOL,
    Message,
    abort_message,
    cancel_message,
    check_request_id,
    check_token,
    chunk_message,
    done_message,
    new_token,
    parse_head,
    parse_message,
    seal_message,
)

__all__ = [
    "BY_SENDER",
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
    "new_token",
]

#: Seconds any wait of this module lasts at most unless told otherwise: a stream's wait, a
#: receiver's wait, one engine write, a request that makes no progress, and how long a failed
#: request's memory is held before its ``on_done`` (a write of its sender may still land).
DEFAULT_TIMEOUT = 60.0
#: ``Receiver.expect(..., staging=BY_SENDER)``: the sender chooses the request's staging mode
#: (:meth:`Streamer.choose`), and each chunk says which it is.
BY_SENDER = "sender"

#: What a Receiver keeps, at most: violations (the newest; ``violation_count`` counts all),
#: other users' notifications (entries and bytes), messages for requests not expected yet
#: (entries and bytes), and finished requests remembered to recognise a late message.
MAX_VIOLATIONS = 1000
MAX_OTHERS = 1024
MAX_OTHERS_BYTES = 16 << 20
MAX_EARLY = 1024
MAX_EARLY_BYTES = 4 << 20
MAX_RECENT = 4096
#: Streams a Streamer remembers to match the decode ranks' answers (the newest).
MAX_KNOWN = 4096
#: Tokens a Receiver remembers to refuse a connector-supplied token used before (the newest).
MAX_USED_TOKENS = 65536
#: Characters of a sender's name kept in an error or violation (the rest is cut, with its
#: length): names are the sender's choice (Mooncake delivers names up to about 1 MB).
MAX_NAME = 200
#: Senders whose answer route a Receiver remembers (the newest), and the longest name kept.
MAX_ROUTES = 1024
#: Characters of one violation kept.
MAX_VIOLATION = 600


def _same(expected: str, got: str) -> bool:
    """Whether a message's token is the request's (in constant time)."""
    return hmac.compare_digest(expected.encode("ascii", "replace"),
                               got.encode("ascii", "replace"))


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


def _listed(items: Sequence[Any], most: int = 32) -> str:
    """``[a, b, ...]``, cut after ``most`` items with the count: error messages stay short
    whatever a peer sends."""
    items = list(items)
    if len(items) <= most:
        return str(items)
    return str(items[:most])[:-1] + f", ... ({len(items)} in all)]"


def _name(sender: Any) -> str:
    """A sender's name for an error or a violation: its repr, cut to :data:`MAX_NAME`
    characters with its length (names are the sender's choice)."""
    text = repr(sender)
    if len(text) <= MAX_NAME:
        return text
    return text[:MAX_NAME] + f"... ({len(text)} characters)"


def _cut(sender: Any) -> str:
    """A sender's name as text, cut like :func:`_name`."""
    text = str(sender)
    if len(text) <= MAX_NAME:
        return text
    return text[:MAX_NAME] + f"... ({len(text)} characters)"


def _a(word: str) -> str:
    """``word`` with its indefinite article."""
    return ("an " if word[:1] in "aeiou" else "a ") + word


def _check_timeout(value: Any, name: str, where: str) -> float:
    """A wait in seconds: a finite number above 0 (no wait of this module is unbounded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < math.inf:
        raise InvalidArgumentError(f"{where}: {name} {value!r} must be a finite number of "
                                   "seconds above 0")
    return float(value)


def _run_release(release: Optional[Callable[[], None]], error: BaseException) -> None:
    """Runs a ``release`` whose stream never began, for the call that took it and raises
    ``error``; a failure of ``release`` goes on ``error`` (its ``__context__``), not instead
    of it."""
    if release is not None:
        try:
            release()
        except Exception as failure:  # noqa: BLE001 - the caller's error comes first
            error.__context__ = failure


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
    """One request in flight from this rank: chunks submitted as they become ready, written by
    the :class:`Streamer`'s threads. Get one from :meth:`Streamer.open`.

    Its life: chunks wait for their ``ready`` on a thread of this stream's own (so a layer
    whose compute never finishes holds back only its own request), are packed by the
    streamer's packing thread and written by its writing thread. The stream ends written (the
    seal delivered after every chunk) or failed (the first error). A failed stream writes no
    further chunk, tells the decode rank with an ``abort`` once every write of it has returned,
    and then gives its memory back (``release``), unless an engine may still read it.
    """

    def __init__(self, streamer: "Streamer", peer: Any, plan: RequestPlan, request_id: str,
                 token: str, layers: Optional[int], backend: str, stream: Optional[int],
                 timeout: float, release: Optional[Callable[[], None]] = None) -> None:
        self._streamer = streamer
        self.peer = peer
        self.plan = plan
        self.request_id = request_id
        #: The request's token (the decode rank's ``Incoming.token``), in every notification.
        self.token = token
        self.num_layers = layers
        self._layer = layer_buffers(plan.num_buffers, layers) if layers is not None else None
        self.backend = backend
        self.stream = stream
        self.timeout = timeout
        self._lock = threading.Lock()
        self._submitted = [False] * plan.num_buffers
        #: Chunks submitted, and chunks whose write returned.
        self._chunks = 0
        self._written = 0
        self._sealed: Optional[int] = None
        #: How the count reaches the decode rank: None (not yet), "riding" (on the chunk being
        #: written, the last one), "queued" (alone, queued or being sent), "sent".
        self._seal: Optional[str] = None
        self._done = threading.Event()
        #: Set once the stream is over: the decode rank confirmed it (``done``) or it failed.
        self._over = threading.Event()
        #: The decode rank's ``done`` arrived: every chunk landed and was unpacked there.
        self.confirmed = False
        #: time.monotonic() when the stream was over (confirmed or failed), else None.
        self._ended_at: Optional[float] = None
        self._error: Optional[BaseException] = None
        #: An error of this stream that says an engine may still move its bytes, if any (not
        #: only the first error: a write that fails after a timeout failed the stream counts).
        self._engine_busy: Optional[BaseException] = None
        #: Chunks whose ``ready`` has not returned: not packed, memory not touched yet.
        self._waiting = 0
        #: (what, since) of the engine call of this stream in progress, for a timeout's words.
        self._in_call: Optional[Tuple[str, float]] = None
        #: Chunks past their ``ready`` that the writing thread has not finished with, the seal
        #: sent alone, and the abort being sent: while any is, the local memory may be read.
        self._busy = 0
        #: The abort to the decode rank: None, "pending" (the stream failed; sent once _busy is
        #: 0), "sending", "sent".
        self._abort: Optional[str] = None
        #: The abort's own failure, if it could not be sent (the receiver then times out).
        self.abort_error: Optional[BaseException] = None
        self._readies: "queue.Queue[Any]" = queue.Queue()
        self._ready_thread: Optional[threading.Thread] = None
        self._release = release
        self._releasing = False
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
        ``buffers`` (ranges), at least one buffer. Packing waits for ``ready`` (None: ready
        now; a callable; an object with ``synchronize()``, such as the layer's
        torch.cuda.Event; or a raw ``hipEvent_t`` handle as an int, synchronized with
        ``hipEventSynchronize`` from libamdhip64, loaded with ctypes:
        :func:`hip_event_synchronize`) on a thread of this stream, so this returns at once and
        a ``ready`` that never returns holds back no other request; with ``pack_here`` it waits
        and packs on the calling thread instead (one thread handoff fewer per chunk, for a
        caller that has nothing else to do, as :meth:`Streamer.send`); an exception there,
        ``KeyboardInterrupt`` included, fails the stream and is raised. Returns the chunk's
        index.

        Raises InvalidArgumentError, changing nothing, for an empty chunk, a buffer already
        submitted (a layer submitted twice), a stream already sealed, ranges outside the
        buffers, or a chunk whose notification would exceed the protocol's bound; a
        TransferError caused by the stream's error once the stream has failed; and
        InvalidArgumentError, failing the stream, once the streamer is closed.
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
        if not indices:
            raise InvalidArgumentError(
                f"submit: request {self.request_id}: an empty chunk (no layer, no buffer); a "
                "chunk carries at least one buffer")
        ranges = _merged(indices)
        # The longest this chunk's notification can be: refused here, not by the receiver.
        width = self.plan.num_buffers
        chunk_message(self.request_id, self.token, width, ranges, sealed=width,
                      staging=self.plan.staging, reply=self._streamer._reply)
        with self._lock:
            if self._error is not None:
                raise TransferError(f"request {self.request_id} failed: {self._error}") \
                    from self._error
            if self._sealed is not None:
                raise InvalidArgumentError(
                    f"submit: request {self.request_id} is sealed with {self._sealed} chunks")
            again = sorted({b for b in indices if self._submitted[b]})
            if again or len(set(indices)) != len(indices):
                twice = again or sorted({b for b in indices if indices.count(b) > 1})
                raise InvalidArgumentError(
                    f"submit: request {self.request_id}: {self._describe(twice)} "
                    "already submitted (each buffer is sent exactly once)")
            if self._streamer._closing:
                closed = self._streamer._closed_error("submit", self)
            else:
                closed = None
                for b in indices:
                    self._submitted[b] = True
                index = self._chunks
                self._chunks += 1
                if ready is None or pack_here:
                    self._busy += 1
                else:
                    self._waiting += 1
        if closed is not None:
            self._fail(closed)
            raise closed
        item = (self, index, ranges, ready)
        if pack_here:
            self._streamer._pack(item, here=True)
        elif ready is None:
            self._streamer._hand(self._streamer._packing, item)
        else:
            self._await_ready(item)
        return index

    def seal(self) -> int:
        """Fixes the chunk count after the last submit; the decode rank learns it with the last
        chunk or in a message of its own. Returns the count. Raises InvalidArgumentError,
        changing nothing, when no chunk or a buffer (a layer) was never submitted, or the
        stream is sealed already; the stream's error (a TransferError caused by it) once it
        has failed."""
        with self._lock:
            if self._error is not None:
                raise TransferError(f"request {self.request_id} failed: {self._error}") \
                    from self._error
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
            # Every chunk written already: the count goes alone. Otherwise the last chunk to be
            # written carries it (or sends it right after, see Streamer._write_chunk).
            alone = self._written == self._chunks and self._seal is None
            if alone:
                self._seal = "queued"
                self._busy += 1
        if alone:
            self._streamer._hand(self._streamer._writing, (self, None, None, None))
        return self._chunks

    def wait(self, timeout: Optional[float] = None) -> SendResult:
        """Waits until every chunk and the seal are written and the decode rank has confirmed
        that every chunk landed (its ``done`` answer; ``timeout``: default the stream's, for
        both together); returns what moved. Success is reported only after that confirmation:
        a request the decode rank failed (its ``cancel``) raises here. Raises the stream's
        first error, or TransferTimeoutError after the timeout: the stream then fails (later
        chunks are not written, the decode rank is told once the write in progress has
        returned)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        if not self._done.wait(limit):
            self._fail(TransferTimeoutError(
                f"request {self.request_id} {about(self.peer, None)}: not written after "
                f"{limit} s: {self._progress()}", peer=self.peer, request_id=self.request_id))
        elif not self._over.wait(max(0.0, deadline - time.monotonic())):
            self._fail(TransferTimeoutError(
                f"request {self.request_id} {about(self.peer, None)}: written, but the decode "
                f"rank did not confirm it (no 'done' answer) within {limit} s: it may have "
                "failed the request, or its answers cannot reach this process (NIXL: the "
                "decode agent needs this agent's metadata; Mooncake: this transport's reply "
                "carrier)", peer=self.peer, request_id=self.request_id))
        if self._error is not None:
            raise self._error
        return SendResult(self.plan.staging, self.segments, self.bytes, self.calls,
                          self.pack_seconds, self.write_seconds, chunks=self._chunks)

    def abort(self, reason: str = "aborted by the caller") -> bool:
        """Fails the stream now: no further chunk is written, ``wait`` raises a TransferError
        naming ``reason``, the decode rank gets an ``abort`` once every write of the stream has
        returned, and ``release`` runs after that. Returns False (doing nothing) when the
        stream had already ended."""
        return self._fail(TransferError(
            f"request {self.request_id} {about(self.peer, None)}: {reason}", peer=self.peer,
            request_id=self.request_id))

    @property
    def done(self) -> bool:
        """Every chunk and the seal are written (or the stream failed); the decode rank may
        not have confirmed it yet: :attr:`over` says when :meth:`wait` no longer blocks."""
        return self._done.is_set()

    @property
    def over(self) -> bool:
        """The stream is over: the decode rank confirmed it (``done``) or it failed, so
        :meth:`wait` returns or raises at once. Poll this, not :attr:`done`, before a
        ``wait(0)``: a wait that runs out fails the stream."""
        return self._over.is_set()

    def released(self, timeout: Optional[float] = None) -> bool:
        """Waits until the stream no longer uses its local memory (every chunk it took is
        written or dropped, its abort sent) and its ``release`` has run; returns True.
        ``timeout``: seconds, default the stream's (:meth:`Streamer.open`'s ``timeout``, else
        the streamer's, :data:`DEFAULT_TIMEOUT` = 60 s unless told otherwise); never
        unbounded. A failed stream gets there once the engine call in progress, if any, has
        returned (the engine bounds it); one whose engine may still read the memory
        (``engine_busy`` on any of its errors) never does, and says why in :attr:`kept`.

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
            return f"layers {_listed(layers)} (buffers {_listed(buffers)})"
        return f"buffers {_listed(buffers)}"

    def _progress(self) -> str:
        with self._lock:
            sealed = "not sealed" if self._sealed is None else f"sealed with {self._sealed}"
            text = (f"{self._chunks} chunks submitted, {self._written} written, {sealed}, "
                    f"seal sent: {self._seal == 'sent'}")
            call = self._in_call
        if call is not None:
            what, since = call
            text += (f"; {what} has been in the engine for {time.monotonic() - since:.1f} s "
                     "(the engine has not returned: a slow or stalled connection to the peer; "
                     "Mooncake delays a notification while silent TCP connections are held "
                     "to the peer's session port, REFERENCE.md section 18)")
        elif self._waiting:
            text += f"; {self._waiting} chunks wait for their ready"
        return text

    def _carrier(self) -> Optional[int]:
        """A byte of the decode rank's registered memory that a notification without data can
        read (Mooncake sends a notification only with a transfer): the first buffer's."""
        remote = self.plan.remote
        if remote.buffers:
            return remote.buffers[0]
        return remote.staging or None

    def _await_ready(self, item: Tuple[Any, ...]) -> None:
        """Queues a chunk for this stream's ready thread, starting it if none runs."""
        with self._lock:
            self._readies.put(item)
            thread = None
            if self._ready_thread is None:
                thread = threading.Thread(target=self._ready_loop, daemon=True,
                                          name=f"mori-tp-ready ({self.request_id})")
                self._ready_thread = thread
        if thread is not None:
            self._streamer._track(thread)
            thread.start()

    def _ready_loop(self) -> None:
        """Waits for each queued chunk's ``ready`` in turn and hands the chunk to the packing
        thread; ends when none is queued. A failed stream's chunks are dropped unwaited."""
        me = threading.current_thread()
        while True:
            with self._lock:
                try:
                    item = self._readies.get_nowait()
                except queue.Empty:
                    self._ready_thread = None
                    self._streamer._untrack(me)
                    return
            failure: Optional[BaseException] = None
            if self._error is None:
                try:
                    _wait_ready(item[3])
                except BaseException as error:  # noqa: B036 - reported to the caller's wait
                    failure = error
            if failure is not None:
                self._fail(failure)
            with self._lock:
                self._waiting -= 1
                go = self._error is None
                if go:
                    self._busy += 1
            if go:
                self._streamer._hand(self._streamer._packing, item)
            else:
                self._settle()

    def _fail(self, error: BaseException) -> bool:
        """Fails the stream with ``error`` if it has not ended; returns whether this did. An
        error that says the engine may still read (``engine_busy``) is remembered even when
        the stream had failed before, so that its memory is kept."""
        if isinstance(error, TransferError):
            # Name the request and the peer on errors that came without them.
            if error.request_id is None:
                error.request_id = self.request_id
            if error.peer is None:
                error.peer = self.peer
        with self._lock:
            if isinstance(error, TransferError) and error.engine_busy \
                    and self._engine_busy is None:
                self._engine_busy = error
            first = self._error is None and not self.confirmed
            if first:
                self._error = error
                self._abort = "pending"
                self._done.set()
                self._over.set()
                self._ended_at = time.monotonic()
        if first:
            self._streamer._forget(self)
        self._settle()
        return first

    def _confirm(self) -> None:
        """The decode rank's ``done``: the request succeeded (if it had not failed here)."""
        with self._lock:
            # Authentic (the token): it may come before this side saw its last write return.
            if self._error is None:
                self.confirmed = True
                self._over.set()
                self._ended_at = time.monotonic()
        if self.confirmed:
            self._streamer._done_with(self)

    def _cancelled(self, reason: str) -> None:
        """The decode rank's ``cancel``: it gave up on the request. The stream fails (nothing
        more is written) and answers ``abort ended`` once every write of it has returned; an
        abort already sent is sent again (the answer the decode rank waits for)."""
        error = TransferError(f"request {self.request_id} {about(self.peer, None)}: the decode "
                              f"rank gave up on it: {reason}", peer=self.peer,
                              request_id=self.request_id)
        if self._fail(error):
            return
        with self._lock:
            again = self._abort == "sent" and self._engine_busy is None
            if again:
                self._abort = "pending"
        if again:
            self._settle()

    def _finish(self) -> None:
        """Every chunk and the count were delivered; success waits for the decode rank's
        ``done``."""
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
        self._streamer._forget(self)
        self._settle()

    def _put_down(self) -> None:
        """The writing thread is done with one chunk or seal of this stream."""
        with self._lock:
            self._busy -= 1
        self._settle()

    def _settle(self) -> None:
        """Once the stream has ended and nothing of it is in use: a failed stream sends its
        abort first (so that the decode rank hears of the failure only after every write of
        the stream has returned), then ``release`` runs, unless an engine may still read the
        memory."""
        abort = False
        release: Optional[Callable[[], None]] = None
        with self._lock:
            if not self._done.is_set() or self._busy:
                return
            if self._error is not None and self._abort == "pending":
                self._abort = "sending"
                self._busy += 1
                abort = True
                busy = self._engine_busy is not None
            elif self._releasing or self.kept is not None:
                return
            elif self._engine_busy is not None:
                self.kept = (f"request {self.request_id}: the engine may still read its "
                             f"memory ({self._engine_busy}); its staging slot is not released")
                return
            else:
                self._releasing = True
                release, self._release = self._release, None
        if abort:
            thread = threading.Thread(target=self._send_abort, args=(busy,), daemon=True,
                                      name=f"mori-tp-abort ({self.request_id})")
            self._streamer._track(thread, self._streamer._aborts)
            thread.start()
            return
        try:
            if release is not None:
                release()
        except Exception as error:  # noqa: BLE001 - reported; the threads must go on
            self.kept = f"request {self.request_id}: release raised {error!r}"
            return
        self._released.set()

    def _send_abort(self, busy: bool) -> None:
        """Tells the decode rank that the stream failed: ``abort busy`` when an engine may still
        move bytes of it, else ``abort ended``. Runs on a thread of its own, so that a failing
        caller is not held up by a peer that does not answer; best effort (a receiver that
        never hears it times out)."""
        try:
            self._streamer.transport.notify(
                self.peer, abort_message(self.request_id, self.token, str(self._error), busy),
                carrier=self._carrier(), timeout=self.timeout,
                epoch=planned_epoch(self.plan), request_id=self.request_id)
        except BaseException as error:  # noqa: B036 - best effort, recorded
            self.abort_error = error
        finally:
            with self._lock:
                self._abort = "sent"
                self._busy -= 1
            # Every write of it returned and the decode rank was told: a later cancel of it is
            # answered as one for a request no stream holds (abort ended).
            self._streamer._done_with(self)
            self._settle()
            self._streamer._untrack(threading.current_thread(), self._streamer._aborts)


class _Activity:
    """Which packs and writes of a streamer run at once: a pack or write that ran while no
    other did is timed alone, the figure a cost model's stages stand for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._started = 0

    def begin(self) -> Tuple[bool, int]:
        with self._lock:
            self._active += 1
            self._started += 1
            return self._active > 1, self._started

    def end(self, token: Tuple[bool, int]) -> bool:
        """Whether the pack or write that began with ``token`` ran alone."""
        with self._lock:
            self._active -= 1
            return not token[0] and self._started == token[1]


class Streamer:
    """Writes requests in chunks through one transport: a packing thread and a writing thread
    shared by every request in flight, so that packing chunk i+1 overlaps writing chunk i (the
    engine and the pack release the GIL). Chunks are packed in the order they become ready and
    written in the order they were packed; requests interleave.

    The transport needs ``write(peer, src, dst, lengths, notification=...)``,
    ``notify(peer, message, carrier=...)`` and, on the receiving side, ``poll_notifications()``:
    :class:`~mori_tp.engines.mooncake.MooncakeTransport` and
    :class:`~mori_tp.engines.nixl.NixlTransport` have them.

    Each request's staging mode and chunk count can be chosen by cost (:meth:`choose`, with
    the streamer's :class:`~mori_tp.engines.costs.CostModel`, which learns the transport's costs
    from every write the streamer makes); the decode rank then expects the request with
    ``staging=BY_SENDER``.
    """

    def __init__(self, transport: Any, *, timeout: float = DEFAULT_TIMEOUT,
                 costs: Optional[CostModel] = None) -> None:
        self.transport = transport
        self.timeout = _check_timeout(timeout, "timeout", "Streamer")
        if costs is not None and not isinstance(costs, CostModel):
            raise TypeError("Streamer: costs must be a mori_tp.engines.costs.CostModel")
        #: The cost model that :meth:`choose` and :meth:`send`'s default chunk count use; every
        #: chunk's write and pack are recorded in it.
        self.costs = costs if costs is not None else CostModel(
            max_segments_per_call=getattr(transport, "max_segments_per_call", None))
        self._activity = _Activity()
        self._lock = threading.Lock()
        #: No new stream or chunk is taken (close was called).
        self._closing = False
        #: The packing and writing threads have been told to stop, and have stopped taking work.
        self._stopped = False
        self._gone: Set[int] = set()
        self._streams: Set[RequestStream] = set()
        self._waiters: Set[threading.Thread] = set()
        #: Threads sending a failed stream's abort: close() waits for them too, so that no
        #: streamer thread is inside the engine once it returns.
        self._aborts: Set[threading.Thread] = set()
        self._packing: "queue.Queue[Any]" = queue.Queue()
        self._writing: "queue.Queue[Any]" = queue.Queue()
        #: The decode ranks' answers (done, cancel) come through the transport's Inbox.
        self._inbox = inbox_of(transport)
        self._inbox.attach_streamer(self)
        #: The carrier the decode rank's answers read one byte of (Mooncake), or 0.
        carrier = getattr(transport, "reply_carrier", None)
        self._reply = int(carrier()) if callable(carrier) else 0
        #: Streams that may still get an answer, by token, oldest first: (stream, since).
        self._known: "OrderedDict[str, RequestStream]" = OrderedDict()
        self._answers = threading.Condition(self._lock)
        #: Answers that matched no stream this streamer knows (a stranger's, or too late).
        self.stray_answers = 0
        #: Peers this streamer opened streams to (the newest MAX_ROUTES): a cancel from one of
        #: them for a request no stream holds is answered.
        self._peers: "OrderedDict[Any, None]" = OrderedDict()
        #: Tokens of requests a decode rank cancelled before any stream of them was opened
        #: here (the newest MAX_KNOWN): open() refuses them, the answer said none would come.
        self._refused: "OrderedDict[str, str]" = OrderedDict()
        self._strays: "queue.Queue[Any]" = queue.Queue(maxsize=64)
        self._stray_thread: Optional[threading.Thread] = None
        self._threads = [
            threading.Thread(target=self._pack_loop, name="mori-tp-pack", daemon=True),
            threading.Thread(target=self._write_loop, name="mori-tp-write", daemon=True),
            threading.Thread(target=self._answer_loop, name="mori-tp-answers", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def open(self, peer: Any, plan: RequestPlan, request_id: str, *,
             token: Optional[str] = None, layers: Optional[int] = None, backend: str = "auto",
             stream: Optional[int] = None, timeout: Optional[float] = None,
             release: Optional[Callable[[], None]] = None) -> RequestStream:
        """A stream for one request to ``peer``; submit its chunks, then seal. ``token``: the
        request's token, drawn by the decode rank's :meth:`Receiver.expect` and sent with the
        slot and pages (``incoming.token``); default the plan's (``plan_request(...,
        token=)``). The decode rank ignores messages without it.
        ``layers``: the model's layers, when the plan's buffers are one or two per layer (see
        :func:`layer_buffers`), to submit by layer. ``timeout``: the stream's (default the
        streamer's), for its wait and each engine write.

        ``release``: called exactly once, on a streamer thread, when the stream has ended
        (written, or failed) and none of its chunks is being packed or written any more, nor
        its abort sent: return the request's staging slot there (``lambda: pool.free(slot)``).
        Not called while the engine may still read the memory (an error with
        ``engine_busy``; :attr:`RequestStream.kept` says so). When ``open`` itself raises,
        ``release`` has run before it does (nothing used the memory).

        Raises :class:`~mori_tp.engines.StaleRegistrationError` at once, with nothing queued,
        when the plan's registration epoch is not the one the peer announced last;
        InvalidArgumentError for a missing or bad token, a request id the protocol cannot
        carry, a plan without buffers, a bad timeout, or a closed streamer."""
        try:
            where = "Streamer.open"
            check_request_id(request_id, where)
            planned = getattr(plan, "token", None)
            if token is None:
                token = planned
            elif planned is not None and planned != token:
                raise InvalidArgumentError(f"{where}: request {request_id}: the token differs "
                                           "from the one the plan was made with")
            if token is None:
                raise InvalidArgumentError(
                    f"{where}: request {request_id} needs its token: the one the decode rank's "
                    "Receiver.expect drew (incoming.token), sent with the slot and pages "
                    "(plan_request(..., token=) or token=)")
            check_token(token, where)
            if plan.num_buffers < 1:
                raise InvalidArgumentError(f"{where}: request {request_id}: the plan has no "
                                           "buffers")
            limit = self.timeout if timeout is None else _check_timeout(timeout, "timeout",
                                                                        where)
            epochs = getattr(self.transport, "peer_epochs", None)
            if epochs is not None:
                epochs.check("streamer", peer, planned_epoch(plan), request_id)
            request = RequestStream(self, peer, plan, request_id, token, layers, backend,
                                    stream, limit, release)
            with self._lock:
                if self._closing:
                    error = self._closed_error("open", request)
                    # Nothing of it was or will be written: the decode rank, which holds the
                    # request's memory until its sender answers, is told so.
                    self._refuse(request, error)
                    raise error
                if token in self._refused:
                    raise TransferError(
                        f"{where}: request {request_id}: the decode rank gave up on it before "
                        "it was opened here, and was told that nothing of it would be written",
                        peer=peer, request_id=request_id)
                self._streams.add(request)
                self._know(request)
                if isinstance(peer, (str, bytes)) and len(peer) <= 4 * MAX_NAME:
                    self._peers.pop(peer, None)
                    self._peers[peer] = None
                    while len(self._peers) > MAX_ROUTES:
                        self._peers.popitem(last=False)
        except BaseException as error:
            _run_release(release, error)
            raise
        return request

    def choose(self, peer: Any, config: Union[SliceConfig, PairConfig], request: Any,
               dst_pages: Any = None, *, remote: KvMemory, modes: Optional[Sequence[Any]] = None,
               request_id: Optional[str] = None) -> Choice:
        """The staging mode and chunk count for one request to ``peer``, by the streamer's cost
        model (:meth:`CostModel.choose <mori_tp.engines.costs.CostModel.choose>`): call it
        before taking this rank's staging slot (needed when ``choice.staging.packs``) and
        planning with ``plan_request(..., staging=choice.staging)``; then
        ``send(..., chunks=choice.chunks)``. ``remote``: the decode rank's memory for the
        request, whose ``staging_capacity`` is the slot it offered (DST and BOTH are chosen only
        when it holds the request); the decode rank must expect the request with
        ``staging=BY_SENDER``. ``modes``: the modes allowed (default all four)."""
        return self.costs.choose(peer, config, request, dst_pages,
                                 num_buffers=len(remote.buffers),
                                 remote_staging=remote.staging_capacity, modes=modes,
                                 request_id=request_id)

    def send(self, peer: Any, plan: RequestPlan, request_id: str, *,
             token: Optional[str] = None, chunks: Optional[int] = None, backend: str = "auto",
             stream: Optional[int] = None, timeout: Optional[float] = None,
             release: Optional[Callable[[], None]] = None) -> SendResult:
        """One whole request, pipelined: its buffers in ``chunks`` chunks (default: the cost
        model's count for the plan's mode once it knows the transport's costs to ``peer``, else
        :func:`chunk_ranges`' rule), submitted at once and sealed; returns when every chunk is
        written (``token`` and ``release`` as for :meth:`open`). Raises the stream's error: the
        pack's or the engine's own exception, not a wrapper; ``release`` runs in every case
        (also when ``chunks`` is refused)."""
        try:
            if chunks is None and plan.num_buffers:
                chunks = self.costs.chunks_for(peer, plan.staging, plan.segments, plan.bytes,
                                               plan.num_buffers)
            ranges = chunk_ranges(plan.num_buffers, plan.bytes_per_buffer, chunks)
        except BaseException as error:
            _run_release(release, error)
            raise
        request = self.open(peer, plan, request_id, token=token, backend=backend,
                            stream=stream, timeout=timeout, release=release)
        try:
            # The caller packs chunk i+1 while the writing thread writes chunk i.
            for chunk in ranges:
                request.submit(buffers=[chunk], pack_here=True)
            request.seal()
        except BaseException as error:  # noqa: B036 - the stream ends with it, then it goes on
            request._fail(error)
            original = request._error
            if original is not None and original is not error \
                    and isinstance(error, TransferError) and error.__cause__ is original:
                raise original from None
            raise
        return request.wait()

    def close(self, timeout: Optional[float] = None) -> None:
        """Stops taking work, fails the streams that were never sealed (they could not end
        otherwise; their ``release`` runs), and stops the threads once the queued work is done,
        waiting at most ``timeout`` seconds in all (default the streamer's ``timeout``,
        :data:`DEFAULT_TIMEOUT` = 60 s unless told otherwise). Closing again waits again for
        threads still running. ``open``, ``send`` and ``submit`` after ``close`` raise
        InvalidArgumentError.

        Raises:
            TransferTimeoutError: a thread still running after ``timeout`` (a stream's
                ``ready`` that has not returned, an engine call that does not end, an abort
                to a peer that does not answer); the message names it.
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            self._closing = True
            unsealed = [s for s in self._streams if s._sealed is None]
        for request in unsealed:
            request._fail(TransferError(
                f"request {request.request_id} {about(request.peer, None)}: the streamer was "
                "closed before the stream was sealed", peer=request.peer,
                request_id=request.request_id))
        with self._lock:
            waiters = list(self._waiters)
        for waiter in waiters:
            waiter.join(max(0.0, deadline - time.monotonic()))
        held = [w.name for w in waiters if w.is_alive()]
        if not held:
            with self._lock:
                stop = not self._stopped
                self._stopped = True
            if stop:
                self._packing.put(None)
                with self._answers:
                    self._answers.notify_all()
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            # The writing thread has ended: no abort starts after this.
            with self._lock:
                aborts = list(self._aborts)
            for thread in aborts:
                thread.join(max(0.0, deadline - time.monotonic()))
            stray = self._stray_thread
            if stray is not None:
                stray.join(max(0.0, deadline - time.monotonic()))
            held = ([t.name for t in self._threads if t.is_alive()]
                    + [t.name for t in aborts if t.is_alive()]
                    + ([stray.name] if stray is not None and stray.is_alive() else []))
            self._inbox.detach_streamer(self)
        running = held
        if running:
            raise TransferTimeoutError(
                f"Streamer.close: {', '.join(running)} still running after {limit} s "
                f"({self._packing.qsize()} items waiting to pack, {self._writing.qsize()} to "
                f"write): a ready= that has not returned, or an engine call in progress")

    def __enter__(self) -> "Streamer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- bookkeeping --

    def _closed_error(self, what: str, request: RequestStream) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{what}: request {request.request_id} {about(request.peer, None)}: the streamer is "
            "closed")

    def _done_with(self, request: RequestStream) -> None:
        """Forgets a stream that is over and needs no answer any more (confirmed, or its abort
        sent): a streamer keeps no stream (and no plan) beyond its life."""
        with self._lock:
            if self._known.get(request.token) is request:
                del self._known[request.token]

    def _know(self, request: RequestStream) -> None:
        """Records a stream that may get answers (under the lock): the newest MAX_KNOWN, and
        those over for more than their timeout are forgotten."""
        self._known.pop(request.token, None)
        self._known[request.token] = request
        now = time.monotonic()
        while self._known:
            token, oldest = next(iter(self._known.items()))
            ended = oldest._ended_at
            if len(self._known) <= MAX_KNOWN and (ended is None
                                                  or now - ended <= oldest.timeout):
                break
            del self._known[token]
        self._answers.notify_all()

    def _answer_loop(self) -> None:
        """Takes the decode ranks' answers: backing off to 1 ms while a stream waits for one,
        to 5 ms while none does (a cancel for a request no stream holds is answered too)."""
        interval = 0.0001
        while True:
            with self._lock:
                if self._stopped:
                    return
                waiting = any(not s._over.is_set() for s in self._known.values())
            try:
                batch = self._inbox.take("streamer")
            except Exception:  # noqa: BLE001 - the receiver's poll reports the transport
                batch = []
            for sender, raw in batch:
                self._answer(sender, raw)
            interval = 0.0001 if batch else min(2 * interval, 0.001 if waiting else 0.005)
            time.sleep(interval)

    def _answer(self, sender: Any, raw: bytes) -> None:
        message = parse_message(raw)
        if message is None or message.kind not in ("done", "cancel"):
            self.stray_answers += 1
            return
        owner = self._inbox.owner(message.token)
        if owner is not None and owner is not self:
            owner._take_answer(sender, message)
            return
        self._take_answer(sender, message)

    def _take_answer(self, sender: Any, message: Message) -> None:
        with self._lock:
            stream = self._known.get(message.token)
            unknown = stream is None
            if unknown and message.kind == "cancel" and sender in self._peers:
                # No stream of this streamer holds the request: none ever will (open refuses
                # the token from now on), so the answer the decode rank waits for is true.
                self._refused.pop(message.token, None)
                self._refused[message.token] = message.request_id
                while len(self._refused) > MAX_KNOWN:
                    self._refused.popitem(last=False)
                answer = True
            else:
                answer = False
        if answer:
            self._answer_stray(sender, message)
            return
        if stream is None or stream.request_id != message.request_id \
                or not hmac.compare_digest(stream.token.encode("ascii"),
                                           message.token.encode("ascii", "replace")):
            self.stray_answers += 1
            return
        if message.kind == "done":
            stream._confirm()
        else:
            stream._cancelled(message.reason)

    def _refuse(self, request: RequestStream, error: BaseException) -> None:
        """Sends ``abort ended`` for a stream refused at open (nothing of it written), from a
        thread of its own, best effort: the decode rank holds the request's memory until its
        sender answers."""
        message = abort_message(request.request_id, request.token,
                                f"the stream was refused before anything was written: {error}")

        def send() -> None:
            try:
                self.transport.notify(request.peer, message, carrier=request._carrier(),
                                      timeout=request.timeout, request_id=request.request_id)
            except Exception:  # noqa: BLE001 - best effort; the decode rank keeps holding
                self.stray_answers += 1

        threading.Thread(target=send, daemon=True, name="mori-tp-refused").start()

    def _answer_stray(self, sender: Any, message: Message) -> None:
        """Queues ``abort ended`` for a request no stream of this streamer holds (sent by a
        thread of its own: a Mooncake notification waits for its read)."""
        try:
            self._strays.put_nowait((sender, message))
        except queue.Full:
            self.stray_answers += 1
            return
        with self._lock:
            if self._stray_thread is None or not self._stray_thread.is_alive():
                self._stray_thread = threading.Thread(target=self._stray_loop, daemon=True,
                                                      name="mori-tp-stray-answers")
                self._stray_thread.start()

    def _stray_loop(self) -> None:
        while True:
            try:
                sender, message = self._strays.get(timeout=1.0)
            except queue.Empty:
                with self._lock:
                    if self._strays.empty():
                        self._stray_thread = None
                        return
                continue
            try:
                self.transport.notify(
                    sender, abort_message(message.request_id, message.token,
                                          "no stream of the sender holds this request; none "
                                          "will be opened"),
                    carrier=message.reply or None, timeout=self.timeout,
                    request_id=message.request_id)
            except Exception:  # noqa: BLE001 - best effort; the decode rank keeps holding
                self.stray_answers += 1

    def _forget(self, request: RequestStream) -> None:
        with self._lock:
            self._streams.discard(request)

    def _track(self, thread: threading.Thread,
               into: Optional[Set[threading.Thread]] = None) -> None:
        """Records a ready thread (default) or an abort thread, which close() waits for."""
        with self._lock:
            (self._waiters if into is None else into).add(thread)

    def _untrack(self, thread: threading.Thread,
                 into: Optional[Set[threading.Thread]] = None) -> None:
        with self._lock:
            (self._waiters if into is None else into).discard(thread)

    def _hand(self, target: "queue.Queue[Any]", item: Any) -> None:
        """Queues ``item`` for the packing or the writing thread; once that thread has stopped
        taking work (a close that raced this), fails its stream and puts it down instead."""
        with self._lock:
            gone = id(target) in self._gone
            if not gone:
                target.put(item)
        if gone and item is not None:
            self._drop(item)

    def _drop(self, item: Tuple[Any, ...]) -> None:
        """A chunk or seal that no thread will take any more: its stream fails, and the item
        is put down."""
        request = item[0]
        request._fail(self._closed_error("write", request))
        request._put_down()

    # -- the threads --

    def _pack_loop(self) -> None:
        while True:
            item = self._packing.get()
            if item is None:
                with self._lock:
                    self._gone.add(id(self._packing))
                    left = _drain(self._packing)
                for rest in left:
                    self._drop(rest)
                self._hand(self._writing, None)
                return
            self._pack(item)

    def _pack(self, item: Tuple[RequestStream, Optional[int], Any, Any],
              here: bool = False) -> None:
        """Waits for a chunk's data (``here``: the caller's thread, for pack_here) and packs it
        if the staging packs, then hands it to the writing thread. ``here``: an exception that
        is not an Exception (KeyboardInterrupt, SystemExit) fails the stream and is raised."""
        request, index, ranges, ready = item
        raised: Optional[BaseException] = None
        if request._error is None:
            try:
                if here:
                    _wait_ready(ready)
                token = self._activity.begin()
                try:
                    seconds = request.plan.pack(backend=request.backend,
                                                stream=request.stream, buffers=ranges)
                finally:
                    alone = self._activity.end(token)
                request.pack_seconds += seconds
                if seconds > 0:
                    self.costs.observe_copy(
                        "pack", sum(e - a for a, e in ranges) * request.plan.staging_len,
                        seconds, alone=alone)
            except BaseException as error:  # noqa: B036 - reported to the caller's wait
                request._fail(error)
                if here and not isinstance(error, Exception):
                    raised = error
        self._hand(self._writing, item)
        if raised is not None:
            raise raised

    def _write_loop(self) -> None:
        while True:
            item = self._writing.get()
            if item is None:
                with self._lock:
                    self._gone.add(id(self._writing))
                    left = _drain(self._writing)
                for rest in left:
                    if rest is not None:
                        self._drop(rest)
                return
            request, index, ranges, _ = item
            try:
                if request._error is not None:
                    continue
                if index is None:
                    self._send_seal(request)
                    request._finish()
                else:
                    self._write_chunk(request, index, ranges)
            except BaseException as error:  # noqa: B036 - reported to the caller's wait
                request._fail(error)
            finally:
                request._put_down()

    def _write_chunk(self, request: RequestStream, index: int,
                     ranges: List[Tuple[int, int]]) -> None:
        with request._lock:
            # This chunk completes the count: the count rides on its notification.
            last = (request._sealed is not None and request._seal is None
                    and request._written + 1 == request._sealed)
            if last:
                request._seal = "riding"
        message = chunk_message(request.request_id, request.token, index, ranges,
                                request._sealed if last else None,
                                staging=request.plan.staging, reply=self._reply)
        src, dst, lengths = request.plan.addresses(ranges)
        token = self._activity.begin()
        cpu = time.process_time()
        start = time.perf_counter()
        calls = 0
        request._in_call = (f"the write of chunk {index}", time.monotonic())
        try:
            if len(lengths):
                calls = self.transport.write(request.peer, src, dst, lengths,
                                             notification=message, timeout=request.timeout,
                                             epoch=planned_epoch(request.plan),
                                             request_id=request.request_id)
                request.calls += calls
            else:
                # Nothing to move (a pair that is not SEND): the notification goes alone.
                self._notify(request, message)
        finally:
            request._in_call = None
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu
            alone = self._activity.end(token)
        request.write_seconds += seconds
        request.segments += len(lengths)
        moved = int(lengths.sum())
        request.bytes += moved
        if calls:
            self.costs.observe_write(request.peer, len(lengths), moved, calls, seconds,
                                     alone=alone, cpu_seconds=cpu)
        with request._lock:
            request._written += 1
            if last:
                request._seal = "sent"
            complete = request._sealed is not None and request._written == request._sealed
            # Sealed while this chunk was being written: the count goes alone, now.
            alone = complete and request._seal is None
            if alone:
                request._seal = "queued"
        if alone:
            self._send_seal(request)
        if complete:
            request._finish()

    def _send_seal(self, request: RequestStream) -> None:
        request._in_call = ("the seal's notification", time.monotonic())
        try:
            self._notify(request, seal_message(request.request_id, request.token,
                                               request._sealed or 0, self._reply))
        finally:
            request._in_call = None
        with request._lock:
            request._seal = "sent"

    def _notify(self, request: RequestStream, message: bytes) -> None:
        self.transport.notify(request.peer, message, carrier=request._carrier(),
                              timeout=request.timeout, epoch=planned_epoch(request.plan),
                              request_id=request.request_id)


def _drain(target: "queue.Queue[Any]") -> List[Any]:
    out = []
    while True:
        try:
            out.append(target.get_nowait())
        except queue.Empty:
            return out


# --- the decode side -----------------------------------------------------------------------


@dataclass(eq=False)
class Incoming:
    """One request the decode rank expects (:meth:`Receiver.expect`) and its progress."""

    request_id: str
    config: Union[SliceConfig, PairConfig]
    dst_pages: Any
    memory: KvMemory
    #: The request's staging mode; None while the sender chooses it (``BY_SENDER``) and no
    #: chunk has said which yet.
    staging: Optional[Staging]
    num_buffers: int
    backend: str
    timeout: float
    #: The request's token: send it to the prefill rank with the slot and pages
    #: (``Streamer.open(..., token=)``). Messages without it are ignored.
    token: str = field(default="", repr=False)
    on_chunk: Optional[Callable[["Incoming", Tuple[Tuple[int, int], ...]], None]] = None
    #: Runs once the request has ended and no write of it can land in its memory any more.
    on_done: Optional[Callable[["Incoming"], None]] = None
    #: The sender the request is bound to (the engine's name for it), or None: any sender
    #: that has the token.
    sender: Any = None
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
    #: The sender: the bound one, else the sender of the first message taken.
    peer: Any = None
    #: Messages of the request's sender that came after it had finished, in words.
    late: List[str] = field(default_factory=list)
    #: Set once no write of the request can land in its memory any more (then ``on_done``
    #: runs): at once when it completes or its sender aborts after every write returned; after
    #: another failure once its sender answers the cancel (or :meth:`Receiver.release`, or
    #: ``linger`` when the cancel could not be delivered); never while the sender's engine may
    #: write.
    settled: threading.Event = field(default_factory=threading.Event)
    #: Why the request never settles: the sender's engine may still write into its memory.
    kept: Optional[str] = None
    #: Whether the sender chooses the staging mode (``expect(staging=BY_SENDER)``).
    by_sender: bool = False
    #: Bytes of staging slot a mode that unpacks needs on this rank: ``num_buffers *
    #: staging_len``.
    staging_need: int = 0
    #: The sender's carrier for this rank's answers (from its chunks), 0 while unknown.
    reply: int = 0
    #: The request failed here and its memory is held until its sender answers the ``cancel``
    #: (or :meth:`Receiver.release`): a late write of the sender may still land in it.
    quarantined: bool = False
    #: Where the ``cancel`` to the sender stands: "" (none), "sending", "delivered",
    #: "no route" (the sender is unknown) or "failed: <why>".
    cancel_state: str = ""
    cancel_sent_at: float = 0.0
    #: How a held request's memory was let go without its sender's answer, in words ("" when
    #: the sender answered, or the request was never held).
    released: str = ""

    @property
    def complete(self) -> bool:
        return self.done.is_set() and self.error is None

    def missing(self) -> str:
        """What has not arrived, in words."""
        gone = [b for b in range(self.num_buffers) if b not in self.buffers_ready]
        if self.sealed is None:
            return (f"not sealed; {len(self.chunks)} chunks arrived; buffers {_listed(gone)} "
                    "missing")
        chunks = [c for c in range(self.sealed) if c not in self.chunks]
        return (f"sealed with {self.sealed} chunks; chunks {_listed(chunks)} and buffers "
                f"{_listed(gone)} missing")

    def unpacked(self) -> str:
        """What of the request reached its buffers, in words: the chunks whose notification
        arrived (unpacked, when staged); nothing else was unpacked."""
        landed = sorted(self.buffers_ready)
        if not landed or self.staging is None:
            return "no chunk arrived, nothing was unpacked"
        where = ("unpacked into the page buffers" if self.staging.unpacks
                 else "written in place")
        return (f"buffers {_listed(landed)} ({len(self.chunks)} chunks) arrived and were "
                f"{where}; no other data was unpacked")

    def layers_ready(self, num_layers: int) -> List[int]:
        """The layers all of whose buffers have landed."""
        of = layer_buffers(self.num_buffers, num_layers)
        return [layer for layer in range(num_layers)
                if all(b in self.buffers_ready for a, e in of(layer) for b in range(a, e))]


class _Finished:
    """What a Receiver remembers of a finished request, to recognise a late message of its
    sender: its id, token, bound sender and the request's list of late messages."""

    __slots__ = ("request_id", "token", "sender", "late", "finished_at")

    def __init__(self, incoming: Incoming) -> None:
        self.request_id = incoming.request_id
        self.token = incoming.token
        self.sender = incoming.sender
        self.late = incoming.late
        self.finished_at = incoming.finished_at


class Receiver:
    """The decode rank's side of pipelined and streamed requests, over one transport: takes the
    transport's notifications, unpacks each chunk as it lands (DST or BOTH staging), completes
    requests in whatever order they finish, and reports every protocol violation.

    Call :meth:`poll` from your loop, or :meth:`start` a thread that polls. A message is taken
    for a request only with the request's token (and from its bound sender, when given);
    messages for a request that is not expected yet are kept until it is (bounded), and checked
    then. Everything the receiver keeps is bounded: finished requests leave by themselves,
    :attr:`violations` and :attr:`others` keep the newest.

    The thread polls every ``poll_interval`` seconds while notifications keep coming and backs
    off, doubling, to ``max_poll_interval`` while none do: a poll is not free (NIXL's
    ``update_notifs`` polled back to back takes about 40% of a core here), and on a host with
    few cores that time comes out of the copies.

    A request this rank gives up on (it timed out, or its sender broke the protocol) fails at
    once (``done`` set, :meth:`wait` raises) and its memory is held (``incoming.quarantined``,
    :attr:`quarantined`) until its sender answers the ``cancel`` sent to it with ``abort
    ended``, every write of it returned; then ``on_done`` runs. :meth:`release` lets a held
    request go when the connector knows its sender is gone. ``linger``: seconds after which a
    held request whose cancel could not be delivered (no route, or the engine refused it) is
    released, the sender taken to be gone; default None: never on time alone. A request that
    completes, or whose sender aborted after every write of it returned, settles at once.
    """

    def __init__(self, transport: Any, *, poll_interval: float = 0.0001,
                 max_poll_interval: float = 0.001,
                 early_timeout: float = DEFAULT_TIMEOUT,
                 linger: Optional[float] = None) -> None:
        self.transport = transport
        self.poll_interval = poll_interval
        self.max_poll_interval = max(max_poll_interval, poll_interval)
        #: Seconds a message for a request nobody expects is kept (then dropped, and recorded in
        #: violations): a request that is never expected, or an abort for one that never began.
        #: Also how long a finished request is remembered, to recognise a late message.
        self.early_timeout = early_timeout
        if linger is not None and not 0 <= linger < math.inf:
            raise InvalidArgumentError(f"Receiver: linger {linger!r} must be a finite number of "
                                       "seconds, at least 0, or None (each request's timeout)")
        self.linger = linger
        self._lock = threading.RLock()
        #: The transport's notifications; one Receiver per transport (a second is refused).
        self._inbox = inbox_of(transport)
        self._inbox.attach_receiver(self)
        #: Failed requests whose memory is held until their sender answers, by token.
        self._quarantined: Dict[str, Incoming] = {}
        #: Digests of the tokens of requests expected so far (the newest MAX_USED_TOKENS).
        self._used: "OrderedDict[bytes, None]" = OrderedDict()
        #: The answer carrier of each sender that sent a chunk (the newest MAX_ROUTES).
        self._routes: "OrderedDict[Any, int]" = OrderedDict()
        #: When each sender's last notification came (the newest MAX_ROUTES, names cut).
        self._heard: "OrderedDict[str, float]" = OrderedDict()
        #: Answers (done, cancel) waiting for the answering thread.
        self._answers: "queue.Queue[Any]" = queue.Queue()
        self._answer_thread: Optional[threading.Thread] = None
        self._incoming: Dict[str, Incoming] = {}
        #: Finished requests, oldest first, kept early_timeout seconds (at most MAX_RECENT).
        self._recent: "OrderedDict[str, _Finished]" = OrderedDict()
        #: Raw messages for requests not expected yet, per request id, and since when.
        self._early: Dict[str, List[Tuple[Any, bytes]]] = {}
        self._early_since: Dict[str, float] = {}
        self._early_count = 0
        self._early_bytes = 0
        #: Early messages of requests expected since, for the next poll to take.
        self._queued: List[Tuple[Incoming, Any, bytes]] = []
        #: Requests that settle later: a heap of (when, order, request).
        self._lingering: List[Tuple[float, int, Incoming]] = []
        self._lingered = 0
        self._finished: List[Incoming] = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        #: Notifications that are not this protocol's, as (peer, message), for other users: the
        #: newest MAX_OTHERS, at most MAX_OTHERS_BYTES together (others_dropped counts the rest).
        self.others: List[Tuple[Any, bytes]] = []
        self._others_bytes = 0
        self.others_dropped = 0
        self._received = 0
        #: What went wrong that no request could be told of, in words, the newest
        #: MAX_VIOLATIONS: messages without the request's token or from another sender,
        #: messages after a request finished, malformed or foreign-version messages, early
        #: messages dropped, a transport that failed to poll. violation_count counts them all.
        self.violations: List[str] = []
        self.violation_count = 0
        #: Polls whose transport call raised (the thread records each new error once).
        self.poll_errors = 0
        self._last_poll_error = ""
        #: Answers (done, cancel) that could not be sent, and the last one's error in words.
        self.answer_errors = 0
        self.last_answer_error = ""

    # -- the decode rank's answers --

    def route(self, peer: Any, carrier: int) -> None:
        """Tells the receiver where its answers to ``peer`` go before that sender's first
        chunk arrives (the sender's ``reply`` carrier: ``Streamer.reply_carrier``); chunks
        carry it too."""
        with self._lock:
            self._remember_route(peer, int(carrier))

    def _remember_route(self, peer: Any, carrier: int) -> None:
        if peer is None or name_bytes(peer) > 4 * MAX_NAME:
            return
        self._routes.pop(peer, None)
        self._routes[peer] = carrier
        while len(self._routes) > MAX_ROUTES:
            self._routes.popitem(last=False)

    def _answer(self, incoming: Incoming, kind: str, reason: str = "") -> None:
        """Queues ``done`` or ``cancel`` for the request's sender (under the lock)."""
        peer = incoming.peer
        if kind == "cancel":
            incoming.cancel_sent_at = time.monotonic()
            if peer is None:
                incoming.cancel_state = "no route"
                return
            incoming.cancel_state = "sending"
            memory = incoming.memory
            own = memory.buffers[0] if memory.buffers else (memory.staging or 0)
            raw = cancel_message(incoming.request_id, incoming.token, reason, int(own))
        else:
            if peer is None:
                return
            raw = done_message(incoming.request_id, incoming.token)
        carrier = incoming.reply or self._routes.get(peer, 0)
        if self._answers.qsize() > MAX_ROUTES:
            self.answer_errors += 1
            if kind == "cancel":
                incoming.cancel_state = "failed: too many answers queued"
            return
        self._answers.put((incoming, kind, peer, raw, carrier))
        if self._answer_thread is None or not self._answer_thread.is_alive():
            self._answer_thread = threading.Thread(target=self._answer_loop, daemon=True,
                                                   name="mori-tp-answer")
            self._answer_thread.start()

    def _answer_loop(self) -> None:
        """Sends the queued answers, one at a time, off the polling thread (a Mooncake
        notification waits for its one-byte read: up to the engine's timeout for a sender
        that does not answer)."""
        while True:
            try:
                item = self._answers.get(timeout=1.0)
            except queue.Empty:
                with self._lock:
                    if self._answers.empty():
                        self._answer_thread = None
                        return
                continue
            incoming, kind, peer, raw, carrier = item
            failure: Optional[BaseException] = None
            try:
                self.transport.notify(peer, raw, carrier=carrier or None,
                                      timeout=incoming.timeout,
                                      request_id=incoming.request_id)
            except Exception as error:  # noqa: BLE001 - recorded; the request stays held
                failure = error
            with self._lock:
                if failure is not None:
                    self.answer_errors += 1
                    self.last_answer_error = (f"request {incoming.request_id}: the '{kind}' "
                                              f"answer to {_name(peer)} could not be sent: "
                                              f"{failure!r}")[:MAX_VIOLATION]
                if kind == "cancel" and incoming.quarantined:
                    incoming.cancel_state = ("delivered" if failure is None
                                             else f"failed: {failure!r}"[:300])

    def cancel(self, incoming: Incoming, reason: str = "cancelled by the decode rank") -> bool:
        """Gives up on a request now (the connector's decision): it fails with
        TransferError naming ``reason``, its memory is held (``incoming.quarantined``) and its
        sender is told; ``on_done`` runs once the sender has answered that nothing more of it
        will land. Returns False when the request had already ended."""
        with self._lock:
            if incoming.done.is_set():
                return False
            self._fail(incoming, TransferError(f"request {incoming.request_id}: {reason}",
                                               peer=incoming.peer,
                                               request_id=incoming.request_id))
            return True

    def release(self, incoming: Incoming, reason: str = "released by the caller") -> bool:
        """Ends a quarantined request's hold on its memory now and runs its ``on_done``:
        call it only when the sender's process is known to be gone (the connector's own
        liveness check), since a sender that is only stalled may still write. Returns whether
        the request was held."""
        with self._lock:
            if not incoming.quarantined:
                return False
            incoming.released = f"released by the caller without its sender's answer: {reason}"
            self._unquarantine(incoming)
            return True

    @property
    def quarantined(self) -> List[Incoming]:
        """Failed requests whose memory is held until their sender answers (or
        :meth:`release`): keep their staging slots and pages out of use."""
        with self._lock:
            return list(self._quarantined.values())

    def _unquarantine(self, incoming: Incoming) -> None:
        if self._quarantined.get(incoming.token) is incoming:
            del self._quarantined[incoming.token]
        incoming.quarantined = False
        self._settle(incoming)

    def _heard_from(self, peer: Any) -> str:
        """When ``peer``'s last notification came, in words (for a timeout's message)."""
        if peer is None:
            return "no sender known yet"
        when = self._heard.get(_name(peer))
        if when is None:
            return f"no notification from {_name(peer)} has arrived"
        return (f"the last notification from {_name(peer)} came {time.monotonic() - when:.1f} "
                "s ago")

    def expect(self, request_id: str, config: Union[SliceConfig, PairConfig],
               dst_pages: Any, *, memory: KvMemory, num_buffers: Optional[int] = None,
               staging: Optional[Union[Staging, int, str]] = None, backend: str = "auto",
               timeout: float = DEFAULT_TIMEOUT, peer: Any = None,
               token: Optional[str] = None,
               on_chunk: Optional[Callable[[Incoming, Tuple[Tuple[int, int], ...]], None]] = None,
               on_done: Optional[Callable[[Incoming], None]] = None) -> Incoming:
        """Registers a request: its pair's config (a SliceConfig with its destination pages,
        or a PairConfig with its :class:`~mori_tp.Request`), this rank's memory whose staging
        field is the request's slot, and the staging the sender uses (default
        :func:`mori_tp.staging_for`, :func:`mori_tp.pair_staging_for` for a PairConfig), or
        :data:`BY_SENDER` (``"sender"``): the sender chooses (:meth:`Streamer.choose`), and the
        ``staging`` word of the first chunk to arrive fixes the mode. Every chunk says how it was staged; one
        staged otherwise than the request's mode, or staged DST or BOTH while ``memory``'s slot
        holds less than ``num_buffers * staging_len`` bytes, fails the request before anything
        is unpacked. Offer a slot of that size to let the sender choose DST or BOTH.

        ``token``: the request's token (default: a new one, :func:`new_token`); send
        ``incoming.token`` to the prefill rank with the slot and pages. ``peer``: the sender's
        name as the engine reports it (Mooncake: the prefill's session id; NIXL: its agent
        name), to take messages from that sender only; both engines let a sender choose its
        name, so the token is what authenticates (REFERENCE.md section 18).

        ``on_chunk(incoming, ranges)`` runs after each chunk has landed and been unpacked
        (per-layer readiness). ``on_done(incoming)`` runs once the request has ended and no
        write of it can land in ``memory`` any more, so free the request's slot there: at
        once when it completes, or when its sender aborts after every write of the stream
        returned; after any other failure (a timeout, a protocol violation) only once the
        sender has answered the receiver's ``cancel`` (every write of it returned), or the
        connector calls :meth:`release`, while ``incoming.done`` is set, :meth:`wait` raises
        at once and ``incoming.quarantined`` says the memory is held: keep the slot out of the
        pool and do not let the serving engine reuse the pages until then; never
        when the sender's engine may still write (an ``abort busy``: ``incoming.kept`` says
        so, and the slot must be kept). Both run on the thread that polls (the receiver's,
        or a caller of :meth:`poll` or :meth:`wait`), never inside ``expect``. ``timeout``
        bounds the time without progress.

        Raises InvalidArgumentError, changing nothing, for a request id the protocol cannot
        carry, a bad token, a bad timeout or buffer count, or a request already expected and
        not finished."""
        where = "Receiver.expect"
        check_request_id(request_id, where)
        chosen = token if token is not None else new_token()
        check_token(chosen, where)
        timeout = _check_timeout(timeout, "timeout", where)
        by_sender = isinstance(staging, str) and staging == BY_SENDER
        if staging is None:
            staging = (mori_tp.pair_staging_for(config) if isinstance(config, PairConfig)
                       else mori_tp.staging_for(config))
        mode = None if by_sender else _staging(staging, where)
        count = len(memory.buffers) if num_buffers is None else num_buffers
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgumentError(f"{where}: request {request_id}: num_buffers {count!r} "
                                       "must be at least 1")
        length = (mori_tp.pair_staging_len(config, dst_pages.num_tokens)
                  if isinstance(config, PairConfig) else mori_tp.staging_len(config,
                                                                             len(dst_pages)))
        incoming = Incoming(request_id, config, dst_pages, memory, mode, count, backend,
                            timeout, chosen, on_chunk, on_done, sender=peer, peer=peer,
                            by_sender=by_sender, staging_need=count * length)
        used = hashlib.blake2b(chosen.encode("ascii"), digest_size=16).digest()
        with self._lock:
            live = self._incoming.get(request_id)
            if live is not None:
                raise InvalidArgumentError(f"{where}: request {request_id} is already "
                                           "expected")
            if used in self._used:
                raise InvalidArgumentError(
                    f"{where}: request {request_id}: the token was used by an earlier request "
                    f"(this receiver remembers the last {MAX_USED_TOKENS}): a replay of that "
                    "request's messages would complete this one; draw a new token "
                    "(mori_tp.engines.new_token(), or leave token= out)")
            self._used[used] = None
            while len(self._used) > MAX_USED_TOKENS:
                self._used.popitem(last=False)
            self._recent.pop(request_id, None)
            self._incoming[request_id] = incoming
            # Messages that came first are checked and applied by the next poll.
            self._early_since.pop(request_id, None)
            for sender, raw in self._early.pop(request_id, []):
                self._early_count -= 1
                self._early_bytes -= len(raw)
                self._queued.append((incoming, sender, raw))
        return incoming

    def forget(self, incoming: Incoming) -> None:
        """Forgets a finished request at once (finished requests are forgotten by themselves
        after ``early_timeout``; a finished request's id may be expected again at any time)."""
        with self._lock:
            record = self._recent.get(incoming.request_id)
            if record is not None and record.late is incoming.late:
                del self._recent[incoming.request_id]

    def poll(self) -> List[Incoming]:
        """Takes the transport's new notifications and applies them, fails requests past their
        timeout and settles those due (``on_done``); returns the requests that completed or
        failed since
        the last poll. One message that cannot be processed is recorded in
        :attr:`violations`, and the rest of the batch is taken as usual.

        Raises:
            TransferError: the transport's ``poll_notifications`` raised (its exception is the
                cause); the timeouts and settling were still handled.
        """
        failure: Optional[BaseException] = None
        try:
            batch = self._inbox.take("receiver")
        except Exception as error:  # noqa: BLE001 - timeouts must still fire
            batch, failure = [], error
        # Outside the lock expect() takes: the header and token first, and the body parsed only
        # for a message that carries a live request's token.
        screened = [(sender, raw, self._screened(raw)) for sender, raw in batch]
        with self._lock:
            queued, self._queued = self._queued, []
        early = [(incoming, sender, raw, self._screened(raw))
                 for incoming, sender, raw in queued]
        with self._lock:
            for incoming, sender, raw, parsed in early:
                self._guarded(sender, raw, incoming, parsed)
            now = time.monotonic()
            for sender, raw, parsed in screened:
                self._received += 1
                key = _name(sender)
                self._heard.pop(key, None)
                self._heard[key] = now
                if len(self._heard) > MAX_ROUTES:
                    self._heard.popitem(last=False)
                self._guarded(sender, raw, None, parsed)
            self._sweep(time.monotonic())
            if failure is not None:
                raise TransferError(f"Receiver.poll: the transport's poll_notifications raised "
                                    f"{failure!r}") from failure
            finished, self._finished = self._finished, []
            return finished

    def wait(self, incoming: Incoming, timeout: Optional[float] = None) -> Incoming:
        """Waits until ``incoming`` completes; raises its error. After ``timeout`` seconds
        (default: the request's own timeout) the request fails with TransferTimeoutError, as a
        stream's wait does: nothing of it is unpacked any more, later messages are violations,
        and its memory is held until its sender answers the cancel (then ``on_done`` runs).
        Polls itself when no thread polls."""
        limit = incoming.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not incoming.done.is_set():
            if time.monotonic() > deadline:
                with self._lock:
                    self._fail(incoming, TransferTimeoutError(
                        f"request {incoming.request_id}"
                        + (f" from {_cut(incoming.peer)}" if incoming.peer is not None else "")
                        + f": not complete after {limit} s: {incoming.missing()}; "
                        f"{incoming.unpacked()}", peer=incoming.peer,
                        request_id=incoming.request_id))
                break
            thread = self._thread
            if thread is not None and thread.is_alive():
                incoming.done.wait(min(0.05, max(deadline - time.monotonic(), 0)))
            else:
                self.poll()
                if not incoming.done.is_set():
                    time.sleep(self.poll_interval)
        if incoming.error is not None:
            raise incoming.error
        return incoming

    def start(self) -> "Receiver":
        """Polls on a thread of its own until :meth:`close` (again after a close)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="mori-tp-receive",
                                                daemon=True)
                self._thread.start()
        return self

    def detach(self) -> None:
        """Gives the transport's notifications up, so that another Receiver may take them
        (one per transport); this one takes none from then on."""
        self.close()
        self._inbox.detach_receiver(self)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the polling thread, waiting for it at most ``timeout`` seconds; :meth:`wait`
        polls by itself from then on, and :meth:`start` starts a new thread."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if not thread.is_alive():
                with self._lock:
                    if self._thread is thread:
                        self._thread = None

    def _run(self) -> None:
        interval = self.poll_interval
        while not self._stop.is_set():
            try:
                busy = self._poll_counting()
                self._last_poll_error = ""
            except Exception as error:  # noqa: BLE001 - keep polling; waits stay bounded
                self.poll_errors += 1
                text = f"poll raised {error.__cause__ or error!r}"
                if text != self._last_poll_error:
                    self._violation(text)
                    self._last_poll_error = text
                busy = False
            interval = self.poll_interval if busy else min(2 * interval,
                                                           self.max_poll_interval)
            self._stop.wait(interval)

    def _poll_counting(self) -> bool:
        """Polls; whether any notification came."""
        before = self._received
        self.poll()
        return self._received != before

    # -- taking messages --

    def _violation(self, text: str) -> None:
        self.violation_count += 1
        self.violations.append(text[:MAX_VIOLATION])
        if len(self.violations) > MAX_VIOLATIONS:
            del self.violations[:len(self.violations) - MAX_VIOLATIONS]

    def _screened(self, raw: bytes) -> Optional[Message]:
        """:meth:`_screen`, or None when it raises (the message is then taken, and what it
        raises recorded, under the lock like any other)."""
        try:
            return self._screen(raw)
        except Exception:  # noqa: BLE001 - recorded when the message is taken
            return None

    def _screen(self, raw: bytes) -> Optional[Message]:
        """The parsed message when its header names a live or held request and carries its
        token (checked first, on the header alone), else None: the body of a message that
        cannot be taken is never parsed. Runs without the lock (a snapshot look-up; the
        token is checked again under the lock)."""
        head = parse_head(raw)
        if head is None or head[0] != PROTOCOL.encode():
            return None
        _, rid, token, _ = head
        live = self._incoming.get(rid) or self._quarantined.get(token)
        if live is None or live.request_id != rid or not _same(live.token, token):
            return None
        return parse_message(raw)

    def _guarded(self, sender: Any, raw: bytes, queued: Optional[Incoming],
                 parsed: Optional[Message] = None) -> None:
        """Takes one message; whatever it raises is recorded, and the batch goes on."""
        try:
            if queued is None:
                self._take(sender, raw, parsed)
            elif self._incoming.get(queued.request_id) is queued:
                self._take_for(queued, sender, raw, parsed, early=True)
            else:
                self._take(sender, raw, parsed)
        except Exception as error:  # noqa: BLE001 - one message must not cost the others
            self._violation(f"a notification from {_name(sender)} ({len(raw)} bytes) could not be "
                            f"processed: {error!r}"[:400])

    def _other(self, sender: Any, raw: bytes) -> None:
        size = len(raw) + name_bytes(sender)
        if size > MAX_OTHERS_BYTES:
            self.others_dropped += 1
            return
        self.others.append((sender, raw))
        self._others_bytes += size
        drop = 0
        while len(self.others) - drop > MAX_OTHERS or self._others_bytes > MAX_OTHERS_BYTES:
            self._others_bytes -= len(self.others[drop][1]) + name_bytes(self.others[drop][0])
            drop += 1
        if drop:
            del self.others[:drop]
            self.others_dropped += drop

    def _take(self, sender: Any, raw: bytes, parsed: Optional[Message] = None) -> None:
        head = parse_head(raw)
        if head is None:
            self._other(sender, raw)
            return
        version, rid, token, kind = head
        if version != PROTOCOL.encode():
            self._violation(f"a notification from {_name(sender)} in another protocol version "
                            f"({version[:20].decode('ascii', 'replace')!r}, this receiver "
                            f"speaks {PROTOCOL}), ignored")
            return
        held = self._quarantined.get(token)
        if held is not None and held.request_id == rid and _same(held.token, token):
            self._take_held(held, sender, raw, parsed)
            return
        incoming = self._incoming.get(rid)
        if incoming is not None:
            self._take_for(incoming, sender, raw, parsed)
            return
        finished = self._recent.get(rid)
        if finished is not None:
            if not _same(finished.token, token):
                self._violation(f"request {rid}: {_a(kind[:20] or '?')} message from "
                                f"{_name(sender)} without the request's token, ignored")
            elif finished.sender is None or finished.sender == sender:
                late = (f"request {rid}: {_a(kind[:20] or '?')} message from {_name(sender)} "
                        "arrived after the request had finished")
                finished.late.append(late)
                del finished.late[:-16]
                self._violation(late)
            return
        try:
            check_request_id(rid)
        except InvalidArgumentError:
            self._violation(f"a notification from {_name(sender)} names no valid request: "
                            f"{raw[:80]!r}, ignored")
            return
        size = len(raw) + name_bytes(sender)
        if self._early_count >= MAX_EARLY or self._early_bytes + size > MAX_EARLY_BYTES:
            self._violation(f"request {rid}: a message from {_name(sender)} for a request not "
                            f"expected, dropped: {self._early_count} such messages "
                            f"({self._early_bytes} bytes) are kept already")
            return
        self._early.setdefault(rid, []).append((sender, raw))
        self._early_since.setdefault(rid, time.monotonic())
        self._early_count += 1
        self._early_bytes += size

    def _take_for(self, incoming: Incoming, sender: Any, raw: bytes,
                  parsed: Optional[Message] = None, *, early: bool = False) -> None:
        """A message for a live request: the token and the sender first (from the header),
        then the body."""
        head = parse_head(raw)
        if head is None or head[0] != PROTOCOL.encode() or head[1] != incoming.request_id:
            return
        kind = head[3][:20] or "?"
        when = " (kept from before the request was expected)" if early else ""
        if not _same(incoming.token, head[2]):
            self._violation(f"request {incoming.request_id}: {_a(kind)} message from "
                            f"{_name(sender)}{when} without the request's token, ignored")
            return
        if incoming.sender is not None and sender != incoming.sender:
            self._violation(f"request {incoming.request_id}: {_a(kind)} message from "
                            f"{_name(sender)}{when}, but the request is bound to "
                            f"{_name(incoming.sender)}, ignored")
            return
        message = parsed if parsed is not None and parsed.token == incoming.token \
            else parse_message(raw)
        if message is None:
            return
        self._apply(incoming, sender, message)

    def _take_held(self, incoming: Incoming, sender: Any, raw: bytes,
                   parsed: Optional[Message]) -> None:
        """A message of the sender of a request held after it failed here: its ``abort
        ended`` (every write of it returned) releases the memory; anything else is late (the
        sender has not seen the cancel yet), is recorded, and the cancel goes again."""
        if incoming.sender is not None and sender != incoming.sender:
            self._violation(f"request {incoming.request_id}: a message from {_name(sender)} "
                            f"for a held request bound to {_name(incoming.sender)}, ignored")
            return
        message = parsed if parsed is not None else parse_message(raw)
        if message is None:
            return
        if incoming.peer is None:
            incoming.peer = sender
        if message.reply:
            incoming.reply = message.reply
            self._remember_route(sender, message.reply)
        if message.kind == "abort":
            if message.busy:
                incoming.kept = (f"request {incoming.request_id}: the sender's engine may "
                                 f"still write into its memory ({message.reason}); on_done "
                                 "does not run, keep its slot")
                self._violation(incoming.kept)
                if self._quarantined.get(incoming.token) is incoming:
                    del self._quarantined[incoming.token]
                return
            self._unquarantine(incoming)
            return
        late = (f"request {incoming.request_id}: {_a(message.kind)} message (chunk "
                f"{message.index}) from {_name(sender)} arrived after the request had failed; "
                "its memory is held until the sender answers the cancel")
        incoming.late.append(late)
        del incoming.late[:-16]
        self._violation(late)
        now = time.monotonic()
        if incoming.cancel_state != "sending" and now - incoming.cancel_sent_at > 0.2:
            self._answer(incoming, "cancel", str(incoming.error))

    def _authentic(self, incoming: Incoming, sender: Any, message: Message,
                   early: bool = False) -> bool:
        """Whether ``message`` carries the request's token and comes from its bound sender;
        if not, it is recorded and changes nothing."""
        rid = incoming.request_id
        when = " (kept from before the request was expected)" if early else ""
        if not hmac.compare_digest(message.token.encode("ascii", "replace"),
                                   incoming.token.encode("ascii")):
            self._violation(f"request {rid}: {_a(message.kind)} message from {_name(sender)}{when} "
                            "without the request's token, ignored")
            return False
        if incoming.sender is not None and sender != incoming.sender:
            self._violation(f"request {rid}: {_a(message.kind)} message from {_name(sender)}{when}, "
                            f"but the request is bound to {_name(incoming.sender)}, ignored")
            return False
        return True

    # -- applying messages --

    def _fail(self, incoming: Incoming, error: BaseException, *, settled: bool = False,
              busy: bool = False) -> None:
        """Fails a live request. ``settled``: no write of its sender can still land (settle
        now); ``busy``: one may, for as long as the sender's engine says (never settle: keep the
        memory); neither: one may until the sender's write timeout (settle after ``linger``)."""
        if incoming.done.is_set():
            return
        incoming.error = error
        self._end(incoming, "now" if settled else "keep" if busy else "linger")

    def _end(self, incoming: Incoming, settle: str) -> None:
        now = time.monotonic()
        incoming.finished_at = now
        if self._incoming.get(incoming.request_id) is incoming:
            del self._incoming[incoming.request_id]
        self._recent[incoming.request_id] = _Finished(incoming)
        while len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)
        incoming.done.set()
        self._finished.append(incoming)
        if settle == "now":
            self._settle(incoming)
        elif settle == "keep":
            incoming.kept = (f"request {incoming.request_id}: the sender's engine may still "
                             f"write into its memory ({incoming.error}); on_done does not run, "
                             "keep its slot")
            self._violation(incoming.kept)
        else:
            # Given up here while the sender may still write: hold the memory, tell the
            # sender, and release once it answers that every write of it has returned.
            incoming.quarantined = True
            self._quarantined[incoming.token] = incoming
            self._answer(incoming, "cancel", str(incoming.error))
            if self.linger is not None:
                self._lingered += 1
                heapq.heappush(self._lingering, (now + self.linger, self._lingered, incoming))

    def _settle(self, incoming: Incoming) -> None:
        """No write of the request can land any more: ``on_done`` (which frees its slot)."""
        incoming.settled.set()
        if incoming.on_done is not None:
            try:
                incoming.on_done(incoming)
            except Exception as error:  # noqa: BLE001 - the polling thread must go on
                self._violation(f"request {incoming.request_id}: on_done raised {error!r}")

    def _sweep(self, now: float) -> None:
        """Timeouts of live requests, requests that settle now, and what is kept too long."""
        for incoming in list(self._incoming.values()):
            if now - incoming.last_progress > incoming.timeout:
                self._fail(incoming, TransferTimeoutError(
                    f"request {incoming.request_id}"
                    + (f" from {_cut(incoming.peer)}" if incoming.peer is not None else "")
                    + f": no progress for {incoming.timeout} s: {incoming.missing()}; "
                    f"{incoming.unpacked()}; {self._heard_from(incoming.peer)}",
                    peer=incoming.peer,
                    request_id=incoming.request_id))
        while self._lingering and self._lingering[0][0] <= now:
            held = heapq.heappop(self._lingering)[2]
            if not held.quarantined:
                continue
            if held.cancel_state in ("sending", "delivered"):
                # The sender is reachable (or being reached): its answer comes once its
                # writes have returned; look again a linger later.
                self._lingered += 1
                heapq.heappush(self._lingering, (now + (self.linger or 0.0) + 0.05,
                                                 self._lingered, held))
                continue
            held.released = (f"released {self.linger} s after it failed without its sender's "
                             f"answer (the cancel: {held.cancel_state or 'not sent'}): the "
                             "sender is taken to be gone (Receiver(linger=))")
            self._unquarantine(held)
        for rid, since in list(self._early_since.items()):
            if now - since > self.early_timeout:
                dropped = self._early.pop(rid, [])
                del self._early_since[rid]
                self._early_count -= len(dropped)
                self._early_bytes -= sum(len(raw) for _, raw in dropped)
                kinds = ", ".join(sorted({((parse_head(raw) or (b"", "", "", "?"))[3][:20]
                                           or "?") for _, raw in dropped}))
                self._violation(
                    f"request {rid}: {len(dropped)} messages ({kinds}) for a request never "
                    f"expected, dropped after {self.early_timeout} s")
        while self._recent:
            rid, oldest = next(iter(self._recent.items()))
            if oldest.finished_at is not None and now - oldest.finished_at <= self.early_timeout:
                break
            del self._recent[rid]

    def _apply(self, incoming: Incoming, sender: Any, message: Message) -> None:
        """A message of the request's token holder: progress, or a failure naming what the
        sender got wrong. Every check comes before any unpack."""
        rid = incoming.request_id
        if incoming.peer is None:
            incoming.peer = sender
        if message.reply:
            incoming.reply = message.reply
            self._remember_route(sender, message.reply)
        kind = message.kind
        if kind in ("done", "cancel"):
            self._fail(incoming, TransferError(f"request {rid}: {_a(kind)} answer from "
                                               f"{_name(sender)}, which only a decode rank "
                                               "sends"))
            return
        if kind in ("malformed", "oversized"):
            self._fail(incoming, TransferError(f"request {rid}: {kind} notification from "
                                               f"{_name(sender)}: {message.reason}"))
            return
        if kind == "abort":
            self._fail(incoming, TransferError(
                f"request {rid}: the sender aborted: {message.reason}", peer=sender,
                request_id=rid, engine_busy=message.busy),
                settled=not message.busy, busy=message.busy)
            return
        n = incoming.num_buffers
        problem = None
        if message.sealed is not None:
            if not 1 <= message.sealed <= n:
                problem = (f"sealed with {message.sealed} chunks; a request of {n} buffers has "
                           f"1 to {n}")
            elif incoming.sealed is not None:
                problem = (f"sealed twice, with {incoming.sealed} and {message.sealed} "
                           "chunks")
            else:
                beyond = sorted(c for c in incoming.chunks if c >= message.sealed)
                if beyond:
                    problem = (f"sealed with {message.sealed} chunks, but chunks "
                               f"{_listed(beyond)} arrived")
        if problem is None and kind == "chunk":
            problem = self._check_chunk(incoming, message)
        if problem is not None:
            self._fail(incoming, TransferError(f"request {rid}: {problem}"))
            return
        if kind == "chunk":
            ranges = message.ranges
            if incoming.staging is None:
                # The sender's choice (BY_SENDER), from its first chunk; checked above.
                incoming.staging = message.staging
            try:
                if incoming.staging.unpacks:
                    start = time.perf_counter()
                    unpack_request(incoming.config, incoming.dst_pages, memory=incoming.memory,
                                   staging=incoming.staging, backend=incoming.backend,
                                   buffers=ranges)
                    incoming.unpack_seconds += time.perf_counter() - start
            except Exception as error:  # noqa: BLE001 - the request fails with it
                self._fail(incoming, error)
                return
            incoming.chunks.add(message.index)
            incoming.buffers_ready.update(b for a, e in ranges for b in range(a, e))
            incoming.last_progress = time.monotonic()
            if incoming.on_chunk is not None:
                try:
                    incoming.on_chunk(incoming, tuple(ranges))
                except Exception as error:  # noqa: BLE001 - the request fails with it
                    self._fail(incoming, error)
                    return
        if message.sealed is not None:
            incoming.sealed = message.sealed
            incoming.last_progress = time.monotonic()
        if incoming.sealed is not None and len(incoming.chunks) == incoming.sealed:
            if len(incoming.buffers_ready) != n:
                self._fail(incoming, TransferError(
                    f"request {rid}: all {incoming.sealed} chunks arrived, but "
                    f"{incoming.missing()}"))
                return
            self._end(incoming, "now")
            self._answer(incoming, "done")

    def _check_chunk(self, incoming: Incoming, message: Message) -> Optional[str]:
        """What is wrong with a chunk message, or None: its index, its count of ranges, each
        range, overlaps among them and with what arrived, in time linear in the ranges."""
        n = incoming.num_buffers
        index = message.index
        count = message.sealed if message.sealed is not None else incoming.sealed
        if index >= n:
            return (f"chunk {index} is outside the chunks of a request of {n} buffers "
                    f"(0 to {n - 1})")
        if index in incoming.chunks:
            return f"chunk {index} arrived twice"
        if count is not None and index >= count:
            beyond = sorted(c for c in incoming.chunks | {index} if c >= count)
            return f"sealed with {count} chunks, but chunks {_listed(beyond)} arrived"
        mode = message.staging
        if mode is None:
            return f"chunk {index} does not say how it was staged"
        if incoming.staging is not None and mode is not incoming.staging:
            expected = ("the sender's earlier chunks were staged" if incoming.by_sender
                        else "the request was expected with")
            return (f"chunk {index} was staged {mode.name} by its sender, but {expected} "
                    f"{incoming.staging.name}")
        capacity = incoming.memory.staging_capacity
        if mode.unpacks and capacity < incoming.staging_need:
            return (f"chunk {index} is staged {mode.name}, which unpacks from a staging slot "
                    f"of {incoming.staging_need} bytes ({n} buffers x "
                    f"{incoming.staging_need // n}); the request's slot holds {capacity}")
        ranges = message.ranges
        if not 1 <= len(ranges) <= n:
            return f"chunk {index} has {len(ranges)} buffer ranges (1 to {n})"
        for first, end in ranges:
            if not first < end <= n:
                return (f"chunk {index}: buffer range ({first}, {end}) is empty or outside the "
                        f"{n} buffers")
        ordered = sorted(ranges)
        for before, after in zip(ordered, ordered[1:]):
            if after[0] < before[1]:
                return (f"chunk {index} carries buffer ranges {before} and {after}, which "
                        "overlap")
        twice = [b for a, e in ordered for b in range(a, e) if b in incoming.buffers_ready]
        if twice:
            return f"chunk {index} carries buffers {_listed(twice)} that already arrived"
        return None
