"""mori-tp requests over Mooncake's transfer engine (``mooncake.engine.TransferEngine``).

Needs: ``pip install mooncake-transfer-engine`` (with CUDA) or
``mooncake-transfer-engine-non-cuda`` (host memory only); Debian/Ubuntu ``libibverbs1``,
``libnuma1`` and ``libcurl4``, which the wheel links (libibverbs even for TCP) but does not
bundle; and numpy. The engine is imported only by
:meth:`MooncakeTransport.start`; a transport can also wrap an engine the connector already has.

Who calls what:

- Both ranks: one :class:`MooncakeTransport` per process, and :meth:`~MooncakeTransport.register`
  of its :class:`~mori_tp.engines.KvMemory` (buffers and staging pool) once.
- Decode rank (target): publishes :attr:`~MooncakeTransport.session_id` and its ``KvMemory``
  at handshake; once the request has landed, calls :func:`mori_tp.engines.unpack_request`.
  It learns that from a notification: :meth:`~MooncakeTransport.write` with ``notification``
  sends one after the data (``batch_transfer_sync`` with a ``TransferNotify`` named after the
  sender's session id), which the target reads with :meth:`~MooncakeTransport.poll_notifications`
  or :meth:`~MooncakeTransport.wait_notification` (``get_notifies``), or over the connector's own
  side channel, as SGLang's does.
- Prefill rank (initiator): :func:`mori_tp.engines.plan_request`, then
  :meth:`~MooncakeTransport.send` to the decode rank's session id; it returns once every
  segment is written.

Segments per call: Mooncake's TCP transport queues at most 1024 transfers (one per segment) per
peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``), lets 1024 more wait up to 1 s for room
(``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``, ``MC_TCP_ADMISSION_TIMEOUT_MS``), and refuses the
rest: ``tcp_transport.cpp`` in kvcache-ai/Mooncake (``kDefaultQueuedTransfersPerPeer``,
``kDefaultPendingAdmissionsPerPeer``, ``kDefaultAdmissionTimeoutMs``). Measured here
(mooncake-transfer-engine-non-cuda 0.3.13.post1, loopback): one ``batch_transfer_sync_write``
of 2048 segments succeeds, one of 4096 returns -1, and so does the next call to that peer
while the refused ones drain (about 0.5 s). Only the 1024 queued ones are safe on a slow link:
the waiting ones are refused once they have waited 1 s. So the transport never holds more than
the queue (``segment_budget``, read from the environment as the engine does) in flight per peer,
from any number of threads: each call takes room for its segments first and waits for it up to
the write's ``timeout``. It splits a list into calls of at most ``max_segments_per_call``
(default: the whole queue, 1024), and refuses a larger setting with the numbers. A staged
request needs one segment per buffer (BOTH) or per run of pages, so it rarely needs more than
one call.

Timeouts: Mooncake bounds each synchronous write itself, by ``MC_TRANSFER_TIMEOUT`` seconds (at
least 5) plus one second per GiB, and drops a TCP connection that makes no progress for
``MC_TCP_PROGRESS_TIMEOUT_SEC`` (both 30 by default); the engine reads them when it is created.
:meth:`MooncakeTransport.start` sets both from its ``engine_timeout`` (default 30 s) unless the
environment already does. Measured here: a peer killed mid-write fails the write within 0.1 s
(connection reset); a peer that stops responding (SIGSTOP) fails it after ``engine_timeout``.

What a failed call leaves behind: the binding's ``batch_transfer_sync`` returns -1 as soon as one
transfer of its batch failed (``getBatchTransferStatus`` reports the batch FAILED then, with the
others possibly still waiting; it retries the batch on the next NIC context), and after its own
time limit (``MC_TRANSFER_TIMEOUT`` plus 1 s per 10^9 bytes) it frees the batch with transfers
possibly still queued (kvcache-ai/Mooncake ``transfer_engine_py.cpp``, ``batchTransferSync``;
``multi_transport.cpp``, ``getBatchTransferStatus``). A write that fails at that time limit
raises with ``engine_busy`` set: the engine may still read its source and write its
destination. An earlier -1 (a refused address, a connection that failed) does not.

Notifications: Mooncake sends a batch's ``TransferNotify`` once every transfer of the batch has
completed (``getBatchTransferStatus``, ``transfer_engine_impl.h``), over its RPC connection, never
without a transfer. :meth:`MooncakeTransport.notify` therefore reads one byte of the peer's
registered memory into a scratch byte of its own, which changes nothing on the peer. The name a
notification carries is whatever the sender put in its ``TransferNotify``: the engine does not
authenticate it (REFERENCE.md section 18).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import KvMemory, RequestPlan, SendResult, TransferError
from .faults import (
    PeerEpochs,
    SegmentBudget,
    TransferTimeoutError,
    about,
    env_int,
    new_epoch,
    planned_epoch,
)
from .inbox import SetAside
from .streaming import DEFAULT_TIMEOUT

__all__ = [
    "DEFAULT_ENGINE_TIMEOUT",
    "DEFAULT_MAX_SEGMENTS_PER_CALL",
    "ENGINE_QUEUE_PER_PEER",
    "MooncakeTransport",
]

#: Transfers the TCP transport queues per peer by default (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER).
ENGINE_QUEUE_PER_PEER = 1024
#: Segments per batch_transfer_sync_write call by default: the whole per-peer queue.
DEFAULT_MAX_SEGMENTS_PER_CALL = 1024
#: Seconds the engine gives a write (MC_TRANSFER_TIMEOUT) or a stalled connection
#: (MC_TCP_PROGRESS_TIMEOUT_SEC) by default, as Mooncake does.
DEFAULT_ENGINE_TIMEOUT = 30.0
#: The least MC_TRANSFER_TIMEOUT the engine takes (it raises smaller settings to this).
MIN_ENGINE_TIMEOUT = 5


class MooncakeTransport:
    """Writes mori-tp requests through one Mooncake ``TransferEngine`` (one per process).

    Args:
        engine: an initialized ``mooncake.engine.TransferEngine`` (or any object with its
            ``get_rpc_port``, ``register_memory``, ``unregister_memory`` and
            ``batch_transfer_sync_write`` methods).
        hostname: the address this engine was initialized with; with the P2P handshake the
            session id peers use is ``"<hostname>:<rpc port>"``.
        max_segments_per_call: the most segments handed to one engine call (default: the
            per-peer queue, 1024; see the module docs). More than ``segment_budget`` is refused.
        segment_budget: segments in flight per peer, all threads together (default: the
            engine's queue, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` or 1024).

    Raises:
        ValueError: ``max_segments_per_call`` below 1 or above ``segment_budget``, with both.
    """

    def __init__(self, engine: Any, *, hostname: str = "127.0.0.1",
                 max_segments_per_call: Optional[int] = None,
                 segment_budget: Optional[int] = None) -> None:
        budget = (env_int("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", ENGINE_QUEUE_PER_PEER)
                  if segment_budget is None else segment_budget)
        if budget < 1:
            raise ValueError(f"segment_budget must be at least 1, not {budget}")
        if max_segments_per_call is None:
            max_segments_per_call = min(DEFAULT_MAX_SEGMENTS_PER_CALL, budget)
        if not 1 <= max_segments_per_call <= budget:
            raise ValueError(
                f"max_segments_per_call must be 1 to {budget} (the transfers Mooncake's TCP "
                f"transport queues per peer, MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER), not "
                f"{max_segments_per_call}: a call of more is refused by the engine (-1)"
            )
        self.engine = engine
        self.hostname = hostname
        self.max_segments_per_call = max_segments_per_call
        #: Room for segments in the engine's queue for each peer.
        self.budget = SegmentBudget(budget)
        #: This process's registration epoch: stamped on what register() returns, drawn anew
        #: after unregister().
        self.epoch = new_epoch()
        #: The epoch each peer announced at its latest handshake (set_peer_epoch).
        self.peer_epochs = PeerEpochs()
        #: Notifications wait_notification did not match, kept for later calls: bounded in
        #: entries and bytes (names counted), each for at most a minute.
        self._set_aside = SetAside()
        #: Held while notifications are taken (poll_notifications, wait_notification): from
        #: several threads, each notification goes to exactly one caller.
        self._notify_lock = threading.Lock()
        #: The engine's own time limit for one synchronous call, in seconds before the bytes'
        #: share (it reads MC_TRANSFER_TIMEOUT when created; start() sets it).
        self.engine_timeout = float(max(MIN_ENGINE_TIMEOUT, env_int(
            "MC_TRANSFER_TIMEOUT", int(DEFAULT_ENGINE_TIMEOUT))))
        #: A registered byte of our own that notifications without data read into.
        self._scratch: Optional["np.ndarray"] = None
        self._scratch_lock = threading.Lock()

    @property
    def segment_budget(self) -> int:
        return self.budget.capacity

    @classmethod
    def start(cls, hostname: str = "127.0.0.1", *, protocol: str = "tcp",
              metadata_server: str = "P2PHANDSHAKE", device_name: str = "",
              max_segments_per_call: Optional[int] = None,
              engine_timeout: float = DEFAULT_ENGINE_TIMEOUT) -> "MooncakeTransport":
        """Creates and initializes an engine: ``TransferEngine().initialize(hostname,
        metadata_server, protocol, device_name)``. ``protocol`` is ``"tcp"`` or ``"rdma"``
        (then ``device_name`` names the NICs, e.g. ``"mlx5_0"``). ``engine_timeout``: seconds
        (whole, at least 5) after which the engine fails a write or drops a stalled connection
        (``MC_TRANSFER_TIMEOUT``, ``MC_TCP_PROGRESS_TIMEOUT_SEC``; an environment that sets
        them wins)."""
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise ImportError(
                "the Mooncake transport needs the mooncake-transfer-engine wheel "
                "(pip install mooncake-transfer-engine-non-cuda for host memory) and "
                f"libibverbs1: {error}"
            ) from error
        seconds = str(max(5, int(-(-engine_timeout // 1))))
        for name in ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC"):
            os.environ.setdefault(name, seconds)
        engine = TransferEngine()
        status = engine.initialize(hostname, metadata_server, protocol, device_name)
        if status != 0:
            raise TransferError(
                f"mooncake: initialize({hostname!r}, {metadata_server!r}, {protocol!r}, "
                f"{device_name!r}) returned {status}"
            )
        return cls(engine, hostname=hostname, max_segments_per_call=max_segments_per_call)

    @property
    def session_id(self) -> str:
        """What a peer passes to :meth:`send` to reach this engine (P2P handshake)."""
        return f"{self.hostname}:{self.engine.get_rpc_port()}"

    def register(self, memory: KvMemory) -> KvMemory:
        """Registers every buffer and the staging region of ``memory`` with the engine; returns
        ``memory`` stamped with this transport's registration epoch (send that one to peers)."""
        for address, length in memory.regions():
            status = self.engine.register_memory(address, length)
            if status != 0:
                raise TransferError(
                    f"mooncake: register_memory(0x{address:x}, {length}) returned {status}"
                )
        return replace(memory, epoch=self.epoch)

    def unregister(self, memory: KvMemory) -> None:
        """Undoes :meth:`register` (before the memory is freed). Draws a new epoch: plans made
        against what this process registered before are refused once peers learn it."""
        for address, _ in memory.regions():
            self.engine.unregister_memory(address)
        self.epoch = new_epoch()

    def set_peer_epoch(self, session_id: str, epoch: int) -> None:
        """Records the registration epoch ``session_id`` announced at its handshake (its
        :class:`~mori_tp.engines.KvMemory`'s ``epoch``); from then on a plan for any other
        epoch is refused before it reaches the engine."""
        self.peer_epochs.set(session_id, epoch)

    def write(self, session_id: str, src: Sequence[int], dst: Sequence[int],
              lengths: Sequence[int], *, notification: bytes = b"",
              timeout: float = DEFAULT_TIMEOUT, epoch: Optional[int] = None,
              request_id: Optional[str] = None) -> int:
        """Writes ``lengths[i]`` bytes from local ``src[i]`` to remote ``dst[i]`` for every i,
        in calls of at most ``max_segments_per_call``; returns the number of calls. Blocks
        until every segment is written. A ``notification`` goes with the last call and reaches
        the peer after the data; Mooncake sends none without data, so an empty list with a
        notification is refused (see :meth:`notify`).

        ``epoch``: the registration epoch the addresses were planned against (a plan's
        ``remote.epoch``), checked against the peer's (:meth:`set_peer_epoch`) before anything
        moves. ``timeout``: seconds each call may wait for room in the peer's queue (the engine
        bounds the write itself: ``engine_timeout`` at :meth:`start`). ``request_id`` names the
        request in errors.

        Raises:
            StaleRegistrationError: ``epoch`` is not the peer's; nothing was written.
            TransferTimeoutError: no room in the peer's queue within ``timeout``; the segments
                before this call were written.
            TransferError: the engine failed a call (-1: the peer is gone, refused the
                addresses, or its queue overflowed); the segments before that call were written.
        """
        count = len(lengths)
        if not len(src) == len(dst) == count:
            raise ValueError(f"{len(src)} sources, {len(dst)} destinations, {count} lengths")
        if notification and not count:
            raise TransferError(
                f"mooncake: a notification {about(session_id, request_id)} needs at least one "
                "segment to carry it (Mooncake sends notifications only with a transfer; "
                "notify() reads a byte of the peer's memory for it)",
                peer=session_id, request_id=request_id,
            )
        self.peer_epochs.check("mooncake", session_id, epoch, request_id)
        calls = 0
        for start in range(0, count, self.max_segments_per_call):
            end = min(start + self.max_segments_per_call, count)
            calls += 1
            self._batch(session_id, src[start:end], dst[start:end], lengths[start:end],
                        notification if end == count else b"", "Write", timeout, request_id,
                        f"segments {start}..{end - 1} of {count} (call {calls}); segments "
                        f"before {start} were written")
        return calls

    def _batch(self, session_id: str, src: Any, dst: Any, lengths: Any, notification: bytes,
               opcode_name: str, timeout: float, request_id: Optional[str], what: str) -> None:
        """One ``batch_transfer_sync`` call (``batch_transfer_sync_write`` without a
        notification), within the peer's segment budget."""
        count = len(lengths)
        args = (session_id, _ints(src), _ints(dst), _ints(lengths))
        if not self.budget.acquire(session_id, count, timeout):
            held = self.budget.held(session_id)
            raise TransferTimeoutError(
                f"mooncake: no room for {count} segments in the queue "
                f"{about(session_id, request_id)} within {timeout} s ({held} of "
                f"{self.segment_budget} in flight from other calls); {what}",
                peer=session_id, request_id=request_id,
            )
        started = time.monotonic()
        try:
            if notification:
                notify_type, opcode = self._notify_types()
                notify = notify_type(self.session_id, notification.decode("latin-1"))
                status = self.engine.batch_transfer_sync(*args, getattr(opcode, opcode_name),
                                                         notify)
            else:
                status = self.engine.batch_transfer_sync_write(*args)
        finally:
            self.budget.release(session_id, count)
        if status != 0:
            elapsed = time.monotonic() - started
            limit = self.engine_timeout + sum(args[3]) / 1e9
            gave_up = elapsed >= limit
            why = (f"after {elapsed:.1f} s, the engine's own time limit ({limit:.1f} s): it gave "
                   "the call up with transfers of it possibly still queued, which may still "
                   "read the source and write the destination" if gave_up else "")
            raise TransferError(
                f"mooncake: batch_transfer_sync {about(session_id, request_id)} returned "
                f"{status} for {what}" + (f"; {why}" if why else ""),
                peer=session_id, request_id=request_id, engine_busy=gave_up,
            )

    def _notify_types(self) -> Tuple[Any, Any]:
        """``TransferNotify`` and ``TransferOpcode`` of the engine's own module."""
        module = sys.modules.get(type(self.engine).__module__)
        if module is None or not hasattr(module, "TransferNotify"):
            import mooncake.engine as module  # type: ignore[no-redef]
        return module.TransferNotify, module.TransferOpcode

    def notify(self, session_id: str, message: bytes, *, carrier: Optional[int] = None,
               timeout: float = DEFAULT_TIMEOUT, epoch: Optional[int] = None,
               request_id: Optional[str] = None) -> None:
        """Sends ``message`` to the peer without data. Mooncake only sends a notification with
        a transfer, so the message rides on a one-byte read: ``carrier`` is an address of the
        peer's registered memory (any byte: the first buffer of the plan's ``remote``), read
        into a scratch byte of this transport, which changes nothing on the peer. The engine
        sends the notification once the read has completed. ``timeout``, ``epoch`` and
        ``request_id`` as for :meth:`write`."""
        if carrier is None:
            raise TransferError(
                f"mooncake: a notification {about(session_id, request_id)} needs a carrier: an "
                "address of the peer's registered memory to read one byte of (Mooncake sends "
                "notifications only with a transfer)",
                peer=session_id, request_id=request_id,
            )
        self.peer_epochs.check("mooncake", session_id, epoch, request_id)
        scratch = self._scratch_address()
        self._batch(session_id, [scratch], [int(carrier)], [1], message, "Read", timeout,
                    request_id, "a one-byte read carrying a notification")

    def _scratch_address(self) -> int:
        """The scratch byte notifications read into, registered with the engine once."""
        with self._scratch_lock:
            if self._scratch is None:
                scratch = np.zeros(64, dtype=np.uint8)
                status = self.engine.register_memory(int(scratch.ctypes.data), scratch.nbytes)
                if status != 0:
                    raise TransferError(f"mooncake: register_memory of the notification "
                                        f"scratch byte returned {status}")
                self._scratch = scratch
            return int(self._scratch.ctypes.data)

    def poll_notifications(self) -> List[Tuple[str, bytes]]:
        """Every notification received since the last call, as ``(sender name, message)``,
        oldest first, including those :meth:`wait_notification` has set aside. Thread-safe:
        each notification goes to one caller of this or of :meth:`wait_notification`. One
        message the binding cannot convert costs only itself: it is returned as
        ``(name or None, b"")``, and the rest of the batch as usual."""
        with self._notify_lock:
            return self._take_all()

    @property
    def _notifications(self) -> Dict[Any, List[bytes]]:
        """What :meth:`wait_notification` keeps set aside, per sender (a copy, to inspect)."""
        with self._notify_lock:
            kept = self._set_aside.drain()
            out: Dict[Any, List[bytes]] = {}
            for sender, message in kept:
                self._set_aside.add(sender, message)
                out.setdefault(sender, []).append(message)
            return out

    def reply_carrier(self) -> int:
        """A byte of this transport's registered memory that a peer's notification to it may
        read (a decode rank's answers to a Streamer: REFERENCE.md section 13)."""
        return self._scratch_address()

    def _take_all(self) -> List[Tuple[str, bytes]]:
        out = self._set_aside.drain()
        for notify in self.engine.get_notifies():
            out.append(_notification(notify))
        return out

    def wait_notification(self, session_id: str, message: bytes, *,
                          timeout: float = DEFAULT_TIMEOUT) -> None:
        """Waits until the peer ``session_id`` has sent exactly ``message`` (a :meth:`write`
        notification) and consumes it; others stay for later calls. Raises
        :class:`~mori_tp.engines.TransferTimeoutError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._notify_lock:
                for peer, received in self._take_all():
                    self._set_aside.add(peer, received)
                if self._set_aside.take(session_id, message):
                    return
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"mooncake: no notification {message!r} from {session_id} within {timeout} s",
                    peer=session_id,
                )
            time.sleep(0.0005)

    def send(self, session_id: str, plan: RequestPlan, *, backend: str = "auto",
             stream: Optional[int] = None, timeout: float = DEFAULT_TIMEOUT,
             request_id: Optional[str] = None) -> SendResult:
        """Moves one request: packs the local staging region if the plan's staging is SRC or
        BOTH, then writes every segment of every buffer to ``session_id``. When it returns the
        bytes are in the decode rank's memory; the decode rank unpacks (DST or BOTH) once told.
        A plan against another registration epoch than the peer's is refused
        (:class:`~mori_tp.engines.StaleRegistrationError`) before anything is packed; see
        :meth:`write` for ``timeout`` and the errors."""
        self.peer_epochs.check("mooncake", session_id, planned_epoch(plan), request_id)
        pack_seconds = plan.pack(backend=backend, stream=stream)
        src, dst, lengths = plan.addresses()
        start = time.perf_counter()
        calls = self.write(session_id, src, dst, lengths, timeout=timeout,
                           epoch=planned_epoch(plan), request_id=request_id)
        return SendResult(plan.staging, plan.segments, plan.bytes, calls, pack_seconds,
                          time.perf_counter() - start)


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _notification(notify: Any) -> Tuple[Any, bytes]:
    """``(name, message bytes)`` of one received TransferNotify. The binding gives ``str``:
    this transport's own messages were decoded as latin-1 (so latin-1 gives their bytes back);
    another sender's may hold any character, and then its UTF-8 is the message. A field the
    binding cannot convert gives None or b"", never an exception."""
    try:
        name: Any = _text(notify.name)
    except Exception:  # noqa: BLE001 - a foreign name must not cost the batch
        name = None
    try:
        text = notify.msg
        if isinstance(text, bytes):
            return name, text
        try:
            return name, text.encode("latin-1")
        except UnicodeEncodeError:
            return name, text.encode("utf-8", "surrogateescape")
    except Exception:  # noqa: BLE001 - likewise for the message
        return name, b""


def _ints(values: Any) -> Any:
    """A list of Python ints: the engine's binding takes ``list[int]``."""
    return values.tolist() if hasattr(values, "tolist") else list(values)
