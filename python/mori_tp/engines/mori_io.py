"""mori-tp requests over AMD's MORI-IO (``mori.io.IOEngine``, from ROCm/mori).

Tested here against MORI-IO itself: ROCm/mori at commit 1e3ce4e1 (branch feature/tcp-backend),
built by ``hip/mori-io-build.sh`` with its TCP backend, host memory, two processes on
127.0.0.1 (``python/tests/engine_*.py mori_io``, ``tests/mori_io.rs``). Its RDMA backend (an
RDMA NIC) and XGMI backend (AMD GPUs) are not tested here; the unit tests in
``python/tests/test_engines.py`` also run the adapter against a recording stand-in.

Needs: MORI's Python package with its IO part (``mori.io``: the ``amd-mori`` wheel, or the
build above), a backend the engine has created (``create_backend(BackendType.TCP)`` or
``RDMA``), and numpy.

MORI-IO addresses memory by registered region and offset, which is exactly what
:func:`mori_tp.plan_transfer` produces: its offsets are relative to each buffer's base, or to
``staging + b * staging_len`` on a staged side. :meth:`MoriIoTransport.send` issues one
multi-session ``batch_write(local_descs, local_offsets, remote_descs, remote_offsets, sizes,
uids)`` whose entry ``b`` is buffer ``b``: the region holding its source (a page buffer or the
staging region), the offsets within that region, and likewise on the remote side. A request of
several groups (:class:`~mori_tp.engines.GroupsPlan`) is one ``batch_write`` too, with one
entry per buffer of each group (:meth:`~mori_tp.engines.GroupsPlan.buffer_spans`).
:meth:`MoriIoTransport.write` takes absolute addresses (what the streaming protocol writes)
and makes one entry per pair of regions.

Completion. SGLang's and vLLM's MORI-IO connectors create engines with
``enable_notification=False`` and tell the decode rank over their own channel (ZMQ) that a
request has landed; they do not rely on ``pop_inbound_transfer_status``. This transport does
the same by default (``completion="side-channel"``): once every entry of a write has succeeded
on the initiator (MORI-IO's TCP backend reports success once the target has written the bytes
and answered), the notification goes over a side channel of its own (:class:`SideChannel`, a
TCP connection to the peer's listener; a connector may use its own channel instead, with
:meth:`~MoriIoTransport.send`'s ``transfer_ids``). With ``completion="inbound"`` the message
also carries the write's transfer ids, and the receiver delivers it only once
``pop_inbound_transfer_status(sender's engine key, uid)`` has reported SUCCESS for each of
them (MORI-IO's target-side status): the decode rank then needs both.

Failures. ``batch_write`` leaves the entries after a backend failure in INIT for good (they
never start), so the wait checks every entry for ``Failed()`` first: once one has failed it
waits only for entries already in progress, then raises naming the failed entry and the ones
that never started. MORI-IO's Python API cannot cancel a transfer: an entry still in progress
at the timeout raises :class:`~mori_tp.engines.TransferTimeoutError` with ``engine_busy``.

Versions. Packed engine and memory descriptors are MORI's msgpack encodings, passed to
``EngineDesc.unpack`` / ``MemoryDesc.unpack`` unread, except for the number of fields each
holds: a peer whose descriptors have another field count than this process's runs another
MORI (MORI's main has 6 fields in ``EngineDesc``, its nightly 7), which msgpack would unpack
silently into wrong fields; :meth:`MoriIoTransport.add_peer` refuses it with
:class:`MoriVersionError`.

Who calls what:

- Both ranks: one :class:`MoriIoTransport` per process (:meth:`~MoriIoTransport.start`, or
  around an engine the connector has); :meth:`~MoriIoTransport.register` of each rank's
  :class:`~mori_tp.engines.KvMemory`.
- Decode rank (target): publishes :meth:`~MoriIoTransport.address` (its engine descriptor,
  memory descriptors and side-channel address) at handshake; waits for the request's
  notification (:meth:`~MoriIoTransport.wait_notification` or
  :meth:`~MoriIoTransport.poll_notifications`), then :func:`mori_tp.engines.unpack_request`.
- Prefill rank (initiator): :meth:`~MoriIoTransport.add_peer` with that address,
  :func:`mori_tp.engines.plan_request`, :meth:`~MoriIoTransport.send` with a notification.
"""

from __future__ import annotations

import bisect
import socket
import struct
import threading
import time
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import KvMemory, RequestPlan, SendResult, TransferError
from .faults import PeerEpochs, TransferTimeoutError, about, new_epoch, planned_epoch
from .groups import GroupsPlan

__all__ = ["COMPLETIONS", "MoriIoTransport", "MoriVersionError", "SideChannel"]

#: The completion modes (see the module docs).
COMPLETIONS = ("side-channel", "inbound")
#: Seconds a write or notification waits by default.
DEFAULT_TIMEOUT = 60.0
#: Segments one batch_write entry carries at most, by default. MORI-IO's TCP backend sends an
#: entry's offsets and sizes in one control message (``BuildBatchReq``: 16 bytes a segment and
#: 17 more) and its peer drops a connection whose control message exceeds 1 MiB
#: (``kMaxControlMessageBytes``, src/io/tcp/protocol.hpp of ROCm/mori 1e3ce4e1): a write of
#: 100000 segments in one entry failed here with "TCP: connection lost". Larger entries are
#: split into entries of at most this many segments, in the same call.
MAX_SEGMENTS_PER_ENTRY = ((1 << 20) - 17) // 16
#: What :meth:`MoriIoTransport.address` returns holds this key and version.
ADDRESS_FORMAT = ("mori-tp mori-io address", 1)


class MoriVersionError(TransferError):
    """A peer's MORI-IO descriptors come from another MORI version than this process's."""


def _entries(plan: Union[RequestPlan, GroupsPlan]) -> Iterator[Tuple[str, int, int, Any, Any,
                                                                       Any]]:
    """``(label, src_base, dst_base, src_offsets, dst_offsets, lengths)`` of each batch entry:
    one per buffer of a RequestPlan, one per buffer of each group of a GroupsPlan."""
    if isinstance(plan, GroupsPlan):
        for g, b, src_base, dst_base, span in plan.buffer_spans():
            yield (f"group {g} buffer {b}", src_base, dst_base, plan.src_offsets[span],
                   plan.dst_offsets[span], plan.lengths[span])
        return
    src_bases, dst_bases = plan.src_bases(), plan.dst_bases()
    for b in range(plan.num_buffers):
        yield (f"buffer {b}", int(src_bases[b]), int(dst_bases[b]), plan.src_offsets,
               plan.dst_offsets, plan.lengths)


def packed_fields(packed: bytes) -> Optional[int]:
    """The number of fields of a packed MORI descriptor (a msgpack array: MORI's
    ``MSGPACK_DEFINE``), from its header alone; None when it is no msgpack array."""
    if not packed:
        return None
    head = packed[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(packed) >= 3:
        return int.from_bytes(packed[1:3], "big")
    if head == 0xDD and len(packed) >= 5:
        return int.from_bytes(packed[1:5], "big")
    return None


class _Regions:
    """Registered regions ``(base, size, desc)`` of one engine, found by a contained address."""

    def __init__(self) -> None:
        self._bases: List[int] = []
        self._entries: List[Tuple[int, int, Any]] = []

    def add(self, base: int, size: int, desc: Any) -> None:
        at = bisect.bisect_right(self._bases, base)
        self._bases.insert(at, base)
        self._entries.insert(at, (base, size, desc))

    def remove(self, desc: Any) -> None:
        keep = [(e, b) for e, b in zip(self._entries, self._bases) if e[2] is not desc]
        self._entries = [e for e, _ in keep]
        self._bases = [b for _, b in keep]

    def find(self, address: int, length: int, what: str) -> Tuple[Any, int]:
        """The desc of the region holding ``[address, address + length)`` and the offset of
        ``address`` in it (the latest registered of those that hold it)."""
        at = bisect.bisect_right(self._bases, address) - 1
        while at >= 0:
            base, size, desc = self._entries[at]
            if address + length <= base + size:
                return desc, address - base
            at -= 1
        raise TransferError(
            f"mori-io: {what} [0x{address:x}, +{length}) is not inside a registered region"
        )


class SideChannel:
    """Messages from one process to another over TCP, beside the engine: what SGLang's and
    vLLM's MORI-IO connectors do over ZMQ. Each message is a frame: its length, the sender's
    name, the transfer ids it vouches for (``completion="inbound"``) and the message bytes. A
    thread accepts connections and reads them; :meth:`take` hands over what arrived.

    Args:
        hostname: the address to listen on (port chosen by the system).
    """

    _HEAD = struct.Struct("!HI")  # sender bytes, transfer ids

    def __init__(self, hostname: str = "127.0.0.1") -> None:
        self._listener = socket.create_server((hostname, 0))
        self.address: Tuple[str, int] = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._inbox: List[Tuple[str, Tuple[int, ...], bytes]] = []
        self._outgoing: Dict[Tuple[str, int], socket.socket] = {}
        self._send_lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="mori-tp-side-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        with connection:
            reader = connection.makefile("rb")
            while True:
                size = reader.read(4)
                if len(size) < 4:
                    return
                body = reader.read(int.from_bytes(size, "big"))
                if len(body) < self._HEAD.size:
                    return
                name_len, uid_count = self._HEAD.unpack_from(body, 0)
                at = self._HEAD.size
                name = body[at:at + name_len].decode("utf-8", "replace")
                at += name_len
                uids = struct.unpack_from(f"!{uid_count}Q", body, at)
                at += 8 * uid_count
                with self._lock:
                    self._inbox.append((name, uids, bytes(body[at:])))

    def send(self, address: Tuple[str, int], sender: str, message: bytes,
             uids: Sequence[int] = (), timeout: float = DEFAULT_TIMEOUT) -> None:
        """Sends ``message`` from ``sender`` to the channel listening at ``address``."""
        name = sender.encode("utf-8")
        body = (self._HEAD.pack(len(name), len(uids)) + name
                + struct.pack(f"!{len(uids)}Q", *uids) + bytes(message))
        frame = len(body).to_bytes(4, "big") + body
        key = (str(address[0]), int(address[1]))
        with self._send_lock:
            connection = self._outgoing.get(key)
            try:
                if connection is None:
                    connection = socket.create_connection(key, timeout=timeout)
                    self._outgoing[key] = connection
                connection.settimeout(timeout)
                connection.sendall(frame)
            except OSError as error:
                self._outgoing.pop(key, None)
                if connection is not None:
                    connection.close()
                raise TransferError(f"mori-io: the side channel to {key[0]}:{key[1]} failed: "
                                    f"{error}") from error

    def take(self) -> List[Tuple[str, Tuple[int, ...], bytes]]:
        """Every ``(sender, transfer ids, message)`` received since the last call."""
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._send_lock:
            for connection in self._outgoing.values():
                connection.close()
            self._outgoing.clear()


class MoriIoTransport:
    """Writes mori-tp requests through one MORI-IO ``IOEngine`` (one per process), with the
    methods of the other transports (:class:`~mori_tp.engines.mooncake.MooncakeTransport`):
    register, write, send, notify, poll_notifications, wait_notification.

    Args:
        engine: a ``mori.io.IOEngine`` with a backend created.
        device_id: the GPU of the buffers (-1 for host memory).
        location: a ``mori.io.MemoryLocationType``; default GPU when ``device_id >= 0``, else CPU.
        poll_interval: seconds between status polls.
        completion: ``"side-channel"`` (default) or ``"inbound"`` (see the module docs).
        hostname: the address the side channel listens on (made when first needed).
        max_segments_per_entry: the most segments of one batch entry (default
            :data:`MAX_SEGMENTS_PER_ENTRY`); a longer entry is split, in the same call.

    Raises:
        ValueError: ``completion`` is not one of :data:`COMPLETIONS`, or
            ``max_segments_per_entry`` is below 1.
    """

    def __init__(self, engine: Any, *, device_id: int = -1, location: Any = None,
                 poll_interval: float = 0.0, completion: str = "side-channel",
                 hostname: str = "127.0.0.1",
                 max_segments_per_entry: int = MAX_SEGMENTS_PER_ENTRY) -> None:
        if completion not in COMPLETIONS:
            raise ValueError(f"completion must be one of {', '.join(COMPLETIONS)}, not "
                             f"{completion!r}")
        if max_segments_per_entry < 1:
            raise ValueError(f"max_segments_per_entry must be at least 1, not "
                             f"{max_segments_per_entry}")
        self.max_segments_per_entry = max_segments_per_entry
        self.engine = engine
        self.device_id = device_id
        self._location = location
        self.poll_interval = poll_interval
        self.completion = completion
        self.hostname = hostname
        self._local = _Regions()
        self._remote: Dict[str, _Regions] = {}
        #: Every registered (KvMemory regions' base, desc), in order: what address() packs.
        self._registered: List[Tuple[int, Any]] = []
        self.epoch = new_epoch()
        self.peer_epochs = PeerEpochs()
        self._side: Optional[SideChannel] = None
        self._side_lock = threading.Lock()
        #: Each peer's side-channel address (add_peer).
        self._peer_channels: Dict[str, Tuple[str, int]] = {}
        #: Notifications received and not yet taken, per sender.
        self._notifications: Dict[str, List[bytes]] = {}
        #: completion="inbound": messages waiting for their transfer ids' inbound status.
        self._held: List[Tuple[str, List[int], bytes, float]] = []
        self._notify_lock = threading.Lock()
        #: completion="inbound": what went wrong with held messages (a failed inbound status).
        self.inbound_failures: List[str] = []

    @classmethod
    def start(cls, name: str, hostname: str = "127.0.0.1", *, completion: str = "side-channel",
              backend_config: Any = None) -> "MoriIoTransport":
        """An engine named ``name`` listening on ``hostname`` with a TCP backend
        (``backend_config``: a ``mori.io.TcpBackendConfig``, default MORI's), host memory."""
        try:
            from mori.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig
        except ImportError as error:
            raise ImportError(
                "the MORI-IO transport needs MORI's Python package with its IO part (mori.io: "
                "the amd-mori wheel, or hip/mori-io-build.sh's build of ROCm/mori): "
                f"{error}") from error
        engine = IOEngine(name, IOEngineConfig(hostname, 0))
        engine.create_backend(BackendType.TCP, backend_config or TcpBackendConfig())
        return cls(engine, completion=completion, hostname=hostname)

    @property
    def key(self) -> str:
        """This engine's key: what peers' notifications name it by."""
        return str(self.engine.get_engine_desc().key)

    @property
    def name(self) -> str:
        return self.key

    def _memory_location(self) -> Any:
        if self._location is None:
            from mori.io import MemoryLocationType

            self._location = (MemoryLocationType.GPU if self.device_id >= 0
                              else MemoryLocationType.CPU)
        return self._location

    def register_descs(self, memory: KvMemory) -> List[Any]:
        """Registers every buffer and the staging region of ``memory``; returns their
        ``MemoryDesc`` objects, buffers first (what a connector sends at handshake)."""
        descs = []
        for address, length in memory.regions():
            desc = self.engine.register_memory(address, length, self.device_id,
                                               self._memory_location())
            self._local.add(address, length, desc)
            self._registered.append((address, desc))
            descs.append(desc)
        return descs

    def register(self, memory: KvMemory) -> KvMemory:
        """Registers every buffer and the staging region of ``memory``; returns ``memory``
        stamped with this transport's registration epoch (send that one to peers, with
        :meth:`address`)."""
        self.register_descs(memory)
        return replace(memory, epoch=self.epoch)

    def unregister(self, memory: KvMemory) -> None:
        """Undoes :meth:`register` (before the memory is freed); draws a new epoch."""
        bases = {address for address, _ in memory.regions()}
        for address, desc in [r for r in self._registered if r[0] in bases]:
            self.engine.deregister_memory(desc)
            self._local.remove(desc)
            self._registered.remove((address, desc))
        self.epoch = new_epoch()

    def _channel(self) -> SideChannel:
        with self._side_lock:
            if self._side is None:
                self._side = SideChannel(self.hostname)
            return self._side

    def address(self) -> Dict[str, Any]:
        """What a peer's :meth:`add_peer` takes: this engine's packed descriptor, the packed
        descriptors of everything registered so far, and the side channel's address."""
        return {
            "format": ADDRESS_FORMAT,
            "engine": bytes(self.engine.get_engine_desc().pack()),
            "memory": [bytes(desc.pack()) for _, desc in self._registered],
            "side_channel": self._channel().address,
        }

    def answer_address(self) -> Dict[str, Any]:
        """What a decode rank loads to answer this transport's streams (``done``, ``cancel``:
        protocol v4): :meth:`address` without any memory descriptor, so the peer can send this
        one notifications over the side channel but can neither read nor write its memory."""
        return dict(self.address(), memory=[])

    def add_peer(self, address: Dict[str, Any]) -> str:
        """Registers the peer of ``address`` (:meth:`address`) with the engine and records its
        memory; returns its engine key (the ``peer`` of :meth:`send`).

        Raises:
            MoriVersionError: its descriptors have another number of fields than this MORI's
                (another MORI version), or the address is not one of this transport's.
        """
        if not isinstance(address, dict) or address.get("format") != ADDRESS_FORMAT:
            raise MoriVersionError(f"mori-io: not a mori-tp MORI-IO address (format "
                                   f"{ADDRESS_FORMAT}): {str(address)[:80]}")
        own = bytes(self.engine.get_engine_desc().pack())
        theirs, want = packed_fields(address["engine"]), packed_fields(own)
        if theirs != want:
            raise MoriVersionError(
                f"mori-io: the peer's engine descriptor has {theirs} fields, this process's "
                f"{want}: the peer runs another MORI version (MORI's main packs 6 fields in "
                "EngineDesc, its nightly 7); both sides must run the same MORI")
        mine = [packed_fields(bytes(d.pack())) for _, d in self._registered[:1]]
        for packed in address["memory"]:
            if mine and packed_fields(packed) != mine[0]:
                raise MoriVersionError(
                    f"mori-io: the peer's memory descriptors have {packed_fields(packed)} "
                    f"fields, this process's {mine[0]}: the peer runs another MORI version")
        from mori.io import EngineDesc, MemoryDesc

        desc = EngineDesc.unpack(address["engine"])
        self.engine.register_remote_engine(desc)
        key = str(desc.key)
        self._remote.pop(key, None)
        self.add_remote_memory(key, [MemoryDesc.unpack(p) for p in address["memory"]])
        self._peer_channels[key] = tuple(address["side_channel"])
        return key

    def add_remote_memory(self, peer: str, descs: List[Any]) -> None:
        """Records a peer's registered regions (unpacked ``MemoryDesc`` objects with ``data``
        and ``size``) so that :meth:`send` can address them; ``peer`` is the peer engine's key."""
        regions = self._remote.setdefault(peer, _Regions())
        for desc in descs:
            regions.add(int(desc.data), int(desc.size), desc)

    def set_peer_epoch(self, peer: str, epoch: int) -> None:
        """Records the registration epoch ``peer`` announced at its handshake; from then on a
        plan for any other epoch is refused before it reaches the engine."""
        self.peer_epochs.set(peer, epoch)

    def _peer_regions(self, peer: str, request_id: Optional[str]) -> _Regions:
        if peer not in self._remote:
            raise TransferError(f"mori-io: no remote memory recorded for peer {peer!r}",
                                peer=peer, request_id=request_id)
        return self._remote[peer]

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              *, notification: bytes = b"", timeout: float = DEFAULT_TIMEOUT,
              epoch: Optional[int] = None, request_id: Optional[str] = None) -> int:
        """Writes ``lengths[i]`` bytes from local ``src[i]`` to remote ``dst[i]`` for every i
        in one ``batch_write`` (one entry per pair of registered regions), waits for every
        entry, then sends ``notification`` (if any) to the peer; returns the number of engine
        calls (0 or 1). ``epoch`` is checked against the peer's first (nothing moves on a
        mismatch). Raises as :meth:`send` does."""
        count = len(lengths)
        if not len(src) == len(dst) == count:
            raise ValueError(f"{len(src)} sources, {len(dst)} destinations, {count} lengths")
        self.peer_epochs.check("mori-io", peer, epoch, request_id)
        remote = self._peer_regions(peer, request_id)
        entries: Dict[Tuple[int, int], Tuple[Any, Any, List[int], List[int], List[int]]] = {}
        for i, (s, d, n) in enumerate(zip(_ints(src), _ints(dst), _ints(lengths))):
            src_desc, src_at = self._local.find(s, n, f"local segment {i}")
            dst_desc, dst_at = remote.find(d, n, f"remote segment {i}")
            entry = entries.setdefault((id(src_desc), id(dst_desc)),
                                       (src_desc, dst_desc, [], [], []))
            entry[2].append(src_at)
            entry[3].append(dst_at)
            entry[4].append(n)
        values = list(entries.values())
        uids = self._batch([e[0] for e in values], [e[2] for e in values],
                           [e[1] for e in values], [e[3] for e in values],
                           [e[4] for e in values],
                           [f"entry of {len(e[4])} segments" for e in values], peer, timeout,
                           request_id)
        if notification:
            self._notify(peer, notification, uids, timeout, request_id)
        return 1 if uids else 0

    def _batch(self, local_descs: List[Any], local_offsets: List[List[int]],
               remote_descs: List[Any], remote_offsets: List[List[int]],
               sizes: List[List[int]], labels: List[str], peer: str, timeout: float,
               request_id: Optional[str]) -> Tuple[int, ...]:
        """One ``batch_write`` of these entries (none: no call), each split into entries of at
        most ``max_segments_per_entry`` segments, waited for; its uids."""
        if not sizes:
            return ()
        limit = self.max_segments_per_entry
        if any(len(n) > limit for n in sizes):
            split: Tuple[List[Any], ...] = ([], [], [], [], [], [])
            for entry in zip(local_descs, local_offsets, remote_descs, remote_offsets, sizes,
                             labels):
                count = len(entry[4])
                for at in range(0, max(count, 1), limit):
                    part = (entry[0], entry[1][at:at + limit], entry[2],
                            entry[3][at:at + limit], entry[4][at:at + limit],
                            entry[5] if count <= limit else
                            f"{entry[5]}, segments {at}..{min(at + limit, count) - 1}")
                    for into, value in zip(split, part):
                        into.append(value)
            local_descs, local_offsets, remote_descs, remote_offsets, sizes, labels = split
        uids = [self.engine.allocate_transfer_uid() for _ in sizes]
        statuses = self.engine.batch_write(local_descs, local_offsets, remote_descs,
                                           remote_offsets, sizes, uids)
        self._wait(statuses, labels, peer, timeout, request_id)
        return tuple(uids)

    def send(self, peer: str, plan: Union[RequestPlan, GroupsPlan], *, notification: bytes = b"",
             timeout: float = DEFAULT_TIMEOUT, backend: str = "auto",
             stream: Optional[int] = None, request_id: Optional[str] = None) -> SendResult:
        """Moves one request: packs the local staging region if the plan's staging is SRC or
        BOTH, then one ``batch_write`` with one entry per buffer, waits for every entry's
        status, then sends ``notification`` (if any) to the peer. A
        :class:`~mori_tp.engines.GroupsPlan` (a request of several groups) packs its staged
        groups and writes one entry per buffer of each group that has segments, group after
        group. The result's ``transfer_ids`` (one per entry) are what the decode rank may poll
        with ``pop_inbound_transfer_status``.

        Raises:
            StaleRegistrationError: the plan's epoch is not the peer's; nothing was written.
            TransferTimeoutError: an entry still in progress after ``timeout`` seconds, with
                ``engine_busy`` set: MORI-IO's Python API has no call that cancels a transfer,
                so the engine may still read the source (do not reuse its staging slot) and
                write the peer's memory.
            TransferError: an entry failed (once no entry of the request is in progress any
                more), naming it, the entries that never started, the peer and ``request_id``.
        """
        self.peer_epochs.check("mori-io", peer, planned_epoch(plan), request_id)
        remote = self._peer_regions(peer, request_id)
        pack_seconds = plan.pack(backend=backend, stream=stream)
        local_descs, local_offsets, remote_descs, remote_offsets, sizes = [], [], [], [], []
        labels = []
        for label, src_base, dst_base, src_offsets, dst_offsets, lengths in _entries(plan):
            # The largest offset + length of the entry's segments: its region must hold it.
            src_extent = int((src_offsets + lengths).max()) if len(lengths) else 0
            dst_extent = int((dst_offsets + lengths).max()) if len(lengths) else 0
            src_desc, src_at = self._local.find(src_base, src_extent, f"local {label}")
            dst_desc, dst_at = remote.find(dst_base, dst_extent, f"remote {label}")
            local_descs.append(src_desc)
            local_offsets.append((src_offsets + src_at).tolist())
            remote_descs.append(dst_desc)
            remote_offsets.append((dst_offsets + dst_at).tolist())
            sizes.append(lengths.tolist())
            labels.append(label)
        start = time.perf_counter()
        uids: Tuple[int, ...] = ()
        if plan.segments:
            uids = self._batch(local_descs, local_offsets, remote_descs, remote_offsets, sizes,
                               labels, peer, timeout, request_id)
        if notification:
            self._notify(peer, notification, uids, timeout, request_id)
        return SendResult(plan.staging, plan.segments, plan.bytes, 1 if uids else 0,
                          pack_seconds, time.perf_counter() - start, uids)

    def _wait(self, statuses: List[Any], labels: List[str], peer: str, timeout: float,
              request_id: Optional[str] = None) -> None:
        """Waits until every entry has succeeded, or one has failed and none is in progress
        any more (the entries after a failure may stay INIT for good), or ``timeout`` has
        passed; then raises for the entries that did not succeed."""
        deadline = time.monotonic() + timeout
        pending = list(range(len(statuses)))
        while True:
            pending = [e for e in pending if not statuses[e].Succeeded()]
            failed = [e for e in pending if statuses[e].Failed()]
            if not pending:
                return
            # After a failure only the entries in progress can still end: INIT ones never start.
            moving = ([e for e in pending if e not in failed and statuses[e].InProgress()]
                      if failed else pending)
            if not moving:
                break
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"mori-io: batch_write {about(peer, request_id)}: entries {moving[:8]} "
                    f"({', '.join(labels[e] for e in moving[:4])}) of {len(statuses)} still "
                    f"in progress after {timeout} s; MORI-IO cannot cancel them, so the engine "
                    "may still read the source and write the destination",
                    peer=peer, request_id=request_id, engine_busy=True)
            if self.poll_interval:
                time.sleep(self.poll_interval)
        entry = failed[0]
        status = statuses[entry]
        never = [e for e in pending if e not in failed]
        raise TransferError(
            f"mori-io: batch_write entry {entry} ({labels[entry]}) {about(peer, request_id)} "
            f"failed: code {status.Code()}, {status.Message()}"
            + (f" ({len(failed)} entries failed in all)" if len(failed) > 1 else "")
            + (f"; entries {never[:8]} never started (INIT)" if never else ""),
            peer=peer, request_id=request_id)

    def _notify(self, peer: str, message: bytes, uids: Sequence[int], timeout: float,
                request_id: Optional[str]) -> None:
        channel = self._peer_channels.get(peer)
        if channel is None:
            raise TransferError(f"mori-io: no side channel known for peer {peer!r} (add_peer "
                                "records it)", peer=peer, request_id=request_id)
        self._channel().send(channel, self.key, message,
                             uids if self.completion == "inbound" else (), timeout)

    def notify(self, peer: str, message: bytes, *, carrier: Optional[int] = None,
               timeout: float = DEFAULT_TIMEOUT, epoch: Optional[int] = None,
               request_id: Optional[str] = None) -> None:
        """Sends ``message`` to the peer over the side channel, without data (``carrier`` is
        not needed: the side channel carries messages alone). ``epoch`` as for :meth:`write`."""
        self.peer_epochs.check("mori-io", peer, epoch, request_id)
        self._notify(peer, message, (), timeout, request_id)

    def _take_all(self) -> List[Tuple[str, bytes]]:
        out = [(peer, m) for peer, messages in self._notifications.items() for m in messages]
        self._notifications.clear()
        if self._side is None:
            return out
        now = time.monotonic()
        self._held.extend((sender, list(uids), message, now)
                          for sender, uids, message in self._side.take())
        held = []
        for sender, uids, message, since in self._held:
            while uids:
                status = self.engine.pop_inbound_transfer_status(sender, uids[0])
                if status is None:
                    break
                if not status.Succeeded():
                    self.inbound_failures.append(
                        f"transfer {uids[0]} from {sender}: code {status.Code()}, "
                        f"{status.Message()}; its message {message[:40]!r} dropped")
                    uids = None
                    break
                uids.pop(0)
            if uids is None:
                continue
            if uids:
                held.append((sender, uids, message, since))
            else:
                out.append((sender, message))
        self._held = held
        return out

    def poll_notifications(self) -> List[Tuple[str, bytes]]:
        """Every notification received since the last call, as ``(sender's engine key,
        message)``, oldest first. With ``completion="inbound"`` a message comes out once
        MORI-IO's inbound status of every transfer it names has succeeded (one that failed
        drops it, recorded in :attr:`inbound_failures`). Thread-safe."""
        with self._notify_lock:
            return self._take_all()

    def wait_notification(self, peer: str, message: bytes, *,
                          timeout: float = DEFAULT_TIMEOUT) -> None:
        """Waits until ``peer`` has sent exactly ``message`` and consumes it; others stay for
        later calls. Raises :class:`~mori_tp.engines.TransferTimeoutError` after
        ``timeout`` seconds."""
        self._channel()
        deadline = time.monotonic() + timeout
        while True:
            with self._notify_lock:
                for sender, received in self._take_all():
                    self._notifications.setdefault(sender, []).append(received)
                waiting = self._notifications.get(peer, [])
                if message in waiting:
                    waiting.remove(message)
                    return
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"mori-io: no notification {message!r} from {peer} within {timeout} s"
                    + (f" ({'; '.join(self.inbound_failures[-2:])})"
                       if self.inbound_failures else ""), peer=peer)
            time.sleep(0.0005)

    def close(self) -> None:
        """Closes the side channel."""
        if self._side is not None:
            self._side.close()


def _ints(values: Any) -> List[int]:
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]
