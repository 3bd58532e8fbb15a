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

Segments per call: with default settings Mooncake's TCP transport queues at most 2048 transfers
per peer, and one ``batch_transfer_sync_write`` of more fails (returns -1, and later calls to
that peer may fail too). ``send`` therefore splits the list into calls of at most
``max_segments_per_call`` (default 1024: half the queue, so two concurrent requests to one peer
still fit). Raising ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` and
``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` in the engine's environment allows larger calls. A
staged request needs one segment per buffer (BOTH) or per run of pages, so it rarely needs
more than one call.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import KvMemory, RequestPlan, SendResult, TransferError

__all__ = ["MooncakeTransport", "DEFAULT_MAX_SEGMENTS_PER_CALL"]

#: Segments per batch_transfer_sync_write call: half of the TCP transport's default per-peer
#: queue of 2048 (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER).
DEFAULT_MAX_SEGMENTS_PER_CALL = 1024


class MooncakeTransport:
    """Writes mori-tp requests through one Mooncake ``TransferEngine`` (one per process).

    Args:
        engine: an initialized ``mooncake.engine.TransferEngine`` (or any object with its
            ``get_rpc_port``, ``register_memory``, ``unregister_memory`` and
            ``batch_transfer_sync_write`` methods).
        hostname: the address this engine was initialized with; with the P2P handshake the
            session id peers use is ``"<hostname>:<rpc port>"``.
        max_segments_per_call: the most segments handed to one engine call (see the module
            docs for why the default is 1024).
    """

    def __init__(self, engine: Any, *, hostname: str = "127.0.0.1",
                 max_segments_per_call: int = DEFAULT_MAX_SEGMENTS_PER_CALL) -> None:
        if max_segments_per_call < 1:
            raise ValueError(
                f"max_segments_per_call must be at least 1, not {max_segments_per_call}"
            )
        self.engine = engine
        self.hostname = hostname
        self.max_segments_per_call = max_segments_per_call
        #: Notifications received and not yet taken, per sender.
        self._notifications: Dict[str, List[bytes]] = {}

    @classmethod
    def start(cls, hostname: str = "127.0.0.1", *, protocol: str = "tcp",
              metadata_server: str = "P2PHANDSHAKE", device_name: str = "",
              max_segments_per_call: int = DEFAULT_MAX_SEGMENTS_PER_CALL) -> "MooncakeTransport":
        """Creates and initializes an engine: ``TransferEngine().initialize(hostname,
        metadata_server, protocol, device_name)``. ``protocol`` is ``"tcp"`` or ``"rdma"``
        (then ``device_name`` names the NICs, e.g. ``"mlx5_0"``)."""
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise ImportError(
                "the Mooncake transport needs the mooncake-transfer-engine wheel "
                "(pip install mooncake-transfer-engine-non-cuda for host memory) and "
                f"libibverbs1: {error}"
            ) from error
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

    def register(self, memory: KvMemory) -> None:
        """Registers every buffer and the staging region of ``memory`` with the engine."""
        for address, length in memory.regions():
            status = self.engine.register_memory(address, length)
            if status != 0:
                raise TransferError(
                    f"mooncake: register_memory(0x{address:x}, {length}) returned {status}"
                )

    def unregister(self, memory: KvMemory) -> None:
        """Undoes :meth:`register` (before the memory is freed)."""
        for address, _ in memory.regions():
            self.engine.unregister_memory(address)

    def write(self, session_id: str, src: Sequence[int], dst: Sequence[int],
              lengths: Sequence[int], *, notification: bytes = b"",
              timeout: Optional[float] = None) -> int:
        """Writes ``lengths[i]`` bytes from local ``src[i]`` to remote ``dst[i]`` for every i,
        in calls of at most ``max_segments_per_call``; returns the number of calls. Blocks
        until every segment is written. A ``notification`` goes with the last call and reaches
        the peer after the data; Mooncake sends none without data, so an empty list with a
        notification is refused (see :meth:`notify`). ``timeout`` is accepted for the
        transports' common signature; Mooncake's synchronous write has no timeout of its own
        (its TCP transport gives up on a dead peer by itself)."""
        count = len(lengths)
        if not len(src) == len(dst) == count:
            raise ValueError(f"{len(src)} sources, {len(dst)} destinations, {count} lengths")
        if notification and not count:
            raise TransferError(
                f"mooncake: a notification to {session_id} needs at least one segment to carry "
                "it (Mooncake sends notifications only with a transfer)"
            )
        calls = 0
        for start in range(0, count, self.max_segments_per_call):
            end = min(start + self.max_segments_per_call, count)
            args = (session_id, _ints(src[start:end]), _ints(dst[start:end]),
                    _ints(lengths[start:end]))
            if notification and end == count:
                notify_type, opcode = self._notify_types()
                notify = notify_type(self.session_id, notification.decode("latin-1"))
                status = self.engine.batch_transfer_sync(*args, opcode.Write, notify)
            else:
                status = self.engine.batch_transfer_sync_write(*args)
            calls += 1
            if status != 0:
                raise TransferError(
                    f"mooncake: batch_transfer_sync_write to {session_id} returned {status} for "
                    f"segments {start}..{end - 1} of {count} (call {calls}); segments before "
                    f"{start} were written"
                )
        return calls

    def _notify_types(self) -> Tuple[Any, Any]:
        """``TransferNotify`` and ``TransferOpcode`` of the engine's own module."""
        module = sys.modules.get(type(self.engine).__module__)
        if module is None or not hasattr(module, "TransferNotify"):
            import mooncake.engine as module  # type: ignore[no-redef]
        return module.TransferNotify, module.TransferOpcode

    def notify(self, session_id: str, message: bytes, *,
               carrier: Optional[Tuple[int, int]] = None) -> None:
        """Sends ``message`` to the peer without new data. Mooncake only sends a notification
        with a transfer, so ``carrier`` names one byte to write again, ``(local address,
        remote address)``: a byte an earlier write of the same request already copied, whose
        source has not changed since, so the write changes nothing."""
        if carrier is None:
            raise TransferError(
                f"mooncake: a notification to {session_id} needs a carrier byte (Mooncake sends "
                "notifications only with a transfer)"
            )
        self.write(session_id, [carrier[0]], [carrier[1]], [1], notification=message)

    def poll_notifications(self) -> List[Tuple[str, bytes]]:
        """Every notification received since the last call, as ``(sender session id,
        message)``, oldest first, including those :meth:`wait_notification` has set aside."""
        out = [(peer, message) for peer, messages in self._notifications.items()
               for message in messages]
        self._notifications.clear()
        out.extend((_text(n.name), _text(n.msg).encode("latin-1"))
                   for n in self.engine.get_notifies())
        return out

    def wait_notification(self, session_id: str, message: bytes, *,
                          timeout: float = 60.0) -> None:
        """Waits until the peer ``session_id`` has sent exactly ``message`` (a :meth:`write`
        notification) and consumes it; others stay for later calls. Raises
        :class:`TransferError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            for peer, received in self.poll_notifications():
                self._notifications.setdefault(peer, []).append(received)
            waiting = self._notifications.get(session_id, [])
            if message in waiting:
                waiting.remove(message)
                return
            if time.monotonic() > deadline:
                raise TransferError(
                    f"mooncake: no notification {message!r} from {session_id} within {timeout} s"
                )
            time.sleep(0.0005)

    def send(self, session_id: str, plan: RequestPlan, *, backend: str = "auto",
             stream: Optional[int] = None) -> SendResult:
        """Moves one request: packs the local staging region if the plan's staging is SRC or
        BOTH, then writes every segment of every buffer to ``session_id``. When it returns the
        bytes are in the decode rank's memory; the decode rank unpacks (DST or BOTH) once told.
        """
        pack_seconds = plan.pack(backend=backend, stream=stream)
        src, dst, lengths = plan.addresses()
        start = time.perf_counter()
        calls = self.write(session_id, src, dst, lengths)
        return SendResult(plan.staging, plan.segments, plan.bytes, calls, pack_seconds,
                          time.perf_counter() - start)


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _ints(values: Any) -> Any:
    """A list of Python ints: the engine's binding takes ``list[int]``."""
    return values.tolist() if hasattr(values, "tolist") else list(values)
