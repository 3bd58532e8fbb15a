"""mori-tp requests over AMD's MORI-IO (``mori.io.IOEngine``, from the ``amd-mori`` wheel).

**Not run on this project's CI or development machines**: MORI-IO needs ROCm's libamdhip64 7
and, for its RDMA backend, an RDMA NIC. This adapter is tested only against a stand-in engine
that records its calls (``python/tests/test_engines.py``); the calls follow MORI-IO's
documented Python API (the MORI-IO guide in the docs folder of ROCm/mori, and its
``tests/python/io``).

Needs: ``amd-mori`` (ROCm 7, libamdhip64), an RDMA backend (``engine.create_backend(
BackendType.RDMA)``) or another MORI-IO backend, and numpy.

MORI-IO addresses memory by registered region and offset, which is exactly what
:func:`mori_tp.plan_transfer` produces: its offsets are relative to each buffer's base, or to
``staging + b * staging_len`` on a staged side. :meth:`MoriIoTransport.send` issues one
multi-session ``batch_write(local_descs, local_offsets, remote_descs, remote_offsets, sizes,
uids)`` whose entry ``b`` is buffer ``b``: the region holding its source (a page buffer or the
staging region), the offsets within that region, and likewise on the remote side. A request of
several groups (:class:`~mori_tp.engines.GroupsPlan`) is one ``batch_write`` too, with one
entry per buffer of each group (:meth:`~mori_tp.engines.GroupsPlan.buffer_spans`).

Who calls what:

- Both ranks: one :class:`MoriIoTransport` per process; the engines' descriptors exchanged and
  registered (``engine.register_remote_engine``); :meth:`~MoriIoTransport.register` of each
  rank's :class:`~mori_tp.engines.KvMemory`, whose returned ``MemoryDesc`` objects the decode
  rank sends (``desc.pack()``) to the prefill rank at handshake.
- Prefill rank (initiator): :meth:`~MoriIoTransport.add_remote_memory` with the decode rank's
  unpacked descs, :func:`mori_tp.engines.plan_request`, :meth:`~MoriIoTransport.send`. The
  result's ``transfer_ids`` go to the decode rank over the connector's side channel.
- Decode rank (target): ``engine.pop_inbound_transfer_status(prefill_engine_key, uid)`` until
  every transfer id has succeeded (MORI-IO's target-side notification), then
  :func:`mori_tp.engines.unpack_request`.
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from . import KvMemory, RequestPlan, SendResult, TransferError
from .faults import TransferTimeoutError, about
from .groups import GroupsPlan

__all__ = ["MoriIoTransport"]


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


class _Regions:
    """Registered regions ``(base, size, desc)`` of one engine, found by a contained address."""

    def __init__(self) -> None:
        self._bases: List[int] = []
        self._entries: List[Tuple[int, int, Any]] = []

    def add(self, base: int, size: int, desc: Any) -> None:
        at = bisect.bisect_right(self._bases, base)
        self._bases.insert(at, base)
        self._entries.insert(at, (base, size, desc))

    def find(self, address: int, length: int, what: str) -> Tuple[Any, int]:
        """The desc of the region holding ``[address, address + length)`` and the offset of
        ``address`` in it."""
        at = bisect.bisect_right(self._bases, address) - 1
        if at >= 0:
            base, size, desc = self._entries[at]
            if address + length <= base + size:
                return desc, address - base
        raise TransferError(
            f"mori-io: {what} [0x{address:x}, +{length}) is not inside a registered region"
        )


class MoriIoTransport:
    """Writes mori-tp requests through one MORI-IO ``IOEngine`` (one per process).

    Args:
        engine: a ``mori.io.IOEngine`` with a backend created and the peers' engines
            registered (``register_remote_engine``).
        device_id: the GPU of the buffers (-1 for host memory).
        location: a ``mori.io.MemoryLocationType``; default GPU when ``device_id >= 0``, else CPU.
        poll_interval: seconds between status polls.
    """

    def __init__(self, engine: Any, *, device_id: int = -1, location: Any = None,
                 poll_interval: float = 0.0) -> None:
        self.engine = engine
        self.device_id = device_id
        self._location = location
        self.poll_interval = poll_interval
        self._local = _Regions()
        self._remote: Dict[str, _Regions] = {}

    def _memory_location(self) -> Any:
        if self._location is None:
            from mori.io import MemoryLocationType

            self._location = (MemoryLocationType.GPU if self.device_id >= 0
                              else MemoryLocationType.CPU)
        return self._location

    def register(self, memory: KvMemory) -> List[Any]:
        """Registers every buffer and the staging region of ``memory``; returns their
        ``MemoryDesc`` objects, buffers first, for the handshake."""
        descs = []
        for address, length in memory.regions():
            desc = self.engine.register_memory(address, length, self.device_id,
                                               self._memory_location())
            self._local.add(address, length, desc)
            descs.append(desc)
        return descs

    def add_remote_memory(self, peer: str, descs: List[Any]) -> None:
        """Records a peer's registered regions (unpacked ``MemoryDesc`` objects with ``data``
        and ``size``) so that :meth:`send` can address them; ``peer`` is the peer engine's key."""
        regions = self._remote.setdefault(peer, _Regions())
        for desc in descs:
            regions.add(int(desc.data), int(desc.size), desc)

    def send(self, peer: str, plan: Union[RequestPlan, GroupsPlan], *, timeout: float = 60.0,
             backend: str = "auto", stream: Optional[int] = None,
             request_id: Optional[str] = None) -> SendResult:
        """Moves one request: packs the local staging region if the plan's staging is SRC or
        BOTH, then one ``batch_write`` with one entry per buffer, and waits for every entry's
        status. A :class:`~mori_tp.engines.GroupsPlan` (a request of several groups) packs its
        staged groups and writes one entry per buffer of each group that has segments, group
        after group. The result's ``transfer_ids`` (one per entry) are what the decode rank
        polls with ``pop_inbound_transfer_status``.

        Raises:
            TransferTimeoutError: an entry still in progress after ``timeout`` seconds, with
                ``engine_busy`` set: MORI-IO's Python API has no call that cancels a transfer,
                so the engine may still read the source (do not reuse its staging slot) and
                write the peer's memory.
            TransferError: an entry failed (after every entry had ended, so nothing of the
                request still moves), naming it, the peer and ``request_id``.
        """
        if peer not in self._remote:
            raise TransferError(f"mori-io: no remote memory recorded for peer {peer!r}",
                                peer=peer, request_id=request_id)
        pack_seconds = plan.pack(backend=backend, stream=stream)
        remote = self._remote[peer]
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
        uids = [self.engine.allocate_transfer_uid() for _ in labels]
        start = time.perf_counter()
        if plan.segments:
            statuses = self.engine.batch_write(local_descs, local_offsets, remote_descs,
                                               remote_offsets, sizes, uids)
            self._wait(statuses, labels, peer, timeout, request_id)
        return SendResult(plan.staging, plan.segments, plan.bytes, 1 if plan.segments else 0,
                          pack_seconds, time.perf_counter() - start, tuple(uids))

    def _wait(self, statuses: List[Any], labels: List[str], peer: str, timeout: float,
              request_id: Optional[str] = None) -> None:
        """Waits until every entry has ended (succeeded or failed) or ``timeout`` has passed;
        then raises for the entries that did not succeed."""
        deadline = time.monotonic() + timeout
        pending = list(range(len(statuses)))
        while pending:
            # Neither yet covers INIT (not started) as well as IN_PROGRESS.
            pending = [e for e in pending
                       if not (statuses[e].Succeeded() or statuses[e].Failed())]
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"mori-io: batch_write {about(peer, request_id)}: entries {pending[:8]} "
                    f"({', '.join(labels[e] for e in pending[:4])}) of {len(statuses)} still "
                    f"in progress after {timeout} s; MORI-IO cannot cancel them, so the engine "
                    "may still read the source and write the destination",
                    peer=peer, request_id=request_id, engine_busy=True)
            if self.poll_interval:
                time.sleep(self.poll_interval)
        failed = [e for e, status in enumerate(statuses) if not status.Succeeded()]
        if failed:
            entry = failed[0]
            status = statuses[entry]
            raise TransferError(
                f"mori-io: batch_write entry {entry} ({labels[entry]}) {about(peer, request_id)} "
                f"failed: code {status.Code()}, {status.Message()}"
                + (f" ({len(failed)} entries failed in all)" if len(failed) > 1 else ""),
                peer=peer, request_id=request_id)
