"""Faults between two processes on 127.0.0.1 through a real transfer engine, one case per run;
every request that completes is checked byte for byte against one send_kvcache (host backend)
into a copy of the decode buffers, bytes outside the slice included.

- ``decode-killed``: the decode process is killed while a request is in flight, once between
  two chunks and once while a large chunk is being written. The prefill rank's stream fails
  with a TransferError naming the peer and the request within a bound, its staging slot goes
  back to the pool, and the next request, to a decode process that is alive, lands whole.
- ``prefill-killed``: the prefill process (a child here) is killed in the middle of a chunk,
  part of whose bytes reached the decode rank's staging slot. The decode rank (this process)
  gives up after its timeout, naming the request, frees its slot, and has unpacked nothing but
  the chunk that arrived whole.
- ``lost-notification``: a chunk's notification dropped, a seal dropped, and a request never
  sent: each ends on the decode rank after its timeout with an error naming what is missing;
  a transport's wait for a notification that never comes ends the same way.
- ``restart``: the decode process restarts with new memory (a new registration epoch). A plan
  made against its old memory is refused (StaleRegistrationError) by send, by a stream and by
  a write, before any byte moves: the new process's buffers are untouched. A plan against the
  new memory lands whole.
- ``segments``: a request with more segments than Mooncake's TCP transport queues per peer
  (1024; 2048 with the ones it lets wait) is split into calls that fit and lands whole, also
  from four threads at once to the same peer; a setting above the queue is refused with the
  numbers. NIXL takes the same request in one call, and a write of 100000 segments.

    python3 python/tests/engine_faults.py mooncake|nixl|mori_io CASE

Exit status: 0 passed, 1 failed, 77 skipped (the engine is not installed; with
MORI_TP_REQUIRE_TOOLS=1 that is a failure instead). tests/python.rs runs every case under cargo
test. Every wait is bounded: the case's own timeouts, STEP_TIMEOUT for each step, and an alarm
after TOTAL_TIMEOUT.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import mori_tp
from engine_loopback import skip_or_arm
from layouts import Layout, fragmented_request
from mori_tp import Staging
from mori_tp.engines import (
    KvMemory,
    StaleRegistrationError,
    Streamer,
    TransferError,
    TransferTimeoutError,
    new_token,
    plan_request,
)
from mori_tp.engines.loopback import (
    PeerError,
    Placement,
    StreamPeer,
    _start_child,
    _stop_child,
    digest,
    driver,
    run_program,
    sentinel,
)
from mori_tp.engines.streaming import Receiver, chunk_ranges, parse_message

BUFFERS = 6  # K and V of three layers
STEP_TIMEOUT = 60.0
#: What the engines themselves give a write (Mooncake's MC_TRANSFER_TIMEOUT floor is 5 s).
ENGINE_TIMEOUT = 5.0
#: The decode rank's no-progress timeout in the cases that wait for it to fire.
DECODE_TIMEOUT = 2.0
#: Slack on top of a timeout for the polling, a process's exit, a loaded two-core machine.
SLACK = 5.0
#: Below the 300 s that tests/python.rs allows, so that this script reports a hang itself.
TOTAL_TIMEOUT = 240

SMALL = Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=32)
#: Large chunks: 8 KiB prefill pages, 200 runs of 1-4 pages (about 4 MiB per buffer).
LARGE = Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=1024)


class Failure(AssertionError):
    pass


def require(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


class Setup:
    """One layout and request: every prefill rank's buffers and a staging pool in this
    process, a decode child (StreamPeer) holding every decode rank, one Streamer."""

    def __init__(self, engine: str, layout: Layout, runs: int, seed: int = 1,
                 pool_requests: int = 4, transport: Any = None) -> None:
        self.engine, self.layout = engine, layout
        source = Source(layout, runs, seed)
        self.request, self.src, self.src_capacity = source.request, source.buffers, source.capacity
        self.slot_bytes = source.slot_bytes
        self.driver = driver(engine, engine_timeout=ENGINE_TIMEOUT)
        self.transport = transport or self.driver.start("prefill")
        self.dst_capacity = self.request.dst_capacity_pages * layout.dst_item_len
        self.pool = mori_tp.StagingPool(pool_requests * self.slot_bytes)
        self.local = [self.transport.register(KvMemory(tuple(int(b.ctypes.data) for b in rank),
                                                       self.src_capacity))
                      for rank in self.src]
        self.transport.register(KvMemory((), 0, self.pool.address, self.pool.capacity))
        self.streamer = Streamer(self.transport, timeout=STEP_TIMEOUT)
        self.peer: Optional[StreamPeer] = None
        self.remote: Any = None
        #: Each request's token, as the decode child drew it.
        self.tokens: Dict[str, str] = {}
        self.start_peer()

    def start_peer(self) -> None:
        """A decode child (a new one after a kill or a restart), connected both ways, with its
        registration epoch recorded."""
        self.peer = StreamPeer(self.engine, [(BUFFERS, self.dst_capacity)] * self.layout.d_tp,
                               4 * self.slot_bytes, STEP_TIMEOUT,
                               placement=Placement(engine_timeout=ENGINE_TIMEOUT))
        self.remote = self.driver.connect(self.transport, self.peer.address, self.peer.epoch)
        self.peer.connect(self.driver.sender(self.transport))

    def plan(self, p: int, d: int, staging: Staging, rid: str,
             decode_timeout: float = STEP_TIMEOUT) -> Tuple[Any, Callable[[], None], Any]:
        """Slots on both sides, the decode child expecting the request, and the plan; returns
        (plan, release of the prefill slot, the slot)."""
        config = self.layout.config(p, d)
        need = BUFFERS * mori_tp.staging_len(config, len(self.request.src_pages))
        remote_slot, self.tokens[rid] = self.peer.expect(
            rid, d, config, self.request.dst_pages, int(staging), need if staging.unpacks else 0,
            timeout=decode_timeout)
        local, slot = self.local[p], None
        if staging.packs:
            slot = self.pool.alloc(need, timeout=STEP_TIMEOUT)
            local = replace(local, staging=slot.address, staging_capacity=slot.size)
        remote = replace(self.peer.memories[d], staging=remote_slot,
                         staging_capacity=need if remote_slot else 0)
        plan = plan_request(config, self.request.src_pages, self.request.dst_pages,
                            local=local, remote=remote, staging=staging)
        return plan, (lambda: self.pool.free(slot)) if slot is not None else (lambda: None), slot

    def expected(self, p: int, d: int) -> List[str]:
        """Digests of decode rank ``d``'s buffers after request (p, d) alone, from sentinels."""
        want = [sentinel(d, b, self.dst_capacity) for b in range(BUFFERS)]
        mori_tp.send_kvcache(self.layout.config(p, d), [int(b.ctypes.data) for b in self.src[p]],
                             [int(w.ctypes.data) for w in want], src_capacity=self.src_capacity,
                             dst_capacity=self.dst_capacity,
                             src_pages=self.request.src_pages, dst_pages=self.request.dst_pages,
                             backend="host")
        return [digest(w) for w in want]

    def untouched(self, d: int) -> List[str]:
        return [digest(sentinel(d, b, self.dst_capacity)) for b in range(BUFFERS)]

    def delivered(self, rid: str, p: int, d: int, what: str) -> None:
        """The request ended complete on the decode side, and rank d holds exactly its bytes."""
        report = self.peer.ended(rid)
        require(report.error is None, f"{self.engine} {what}: request {rid} failed on the "
                                      f"decode side: {report.error}")
        got = self.peer.digests()[d]
        wrong = [b for b, (g, w) in enumerate(zip(got, self.expected(p, d))) if g != w]
        require(not wrong, f"{self.engine} {what}: decode rank {d} buffers {wrong} differ from "
                           "send_kvcache's result")

    def close(self) -> None:
        self.streamer.close()
        if self.peer is not None:
            self.peer.close()


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class Hooked:
    """A transport that runs ``before(index, notification)`` before each write that carries a
    chunk notification (index: the chunk), and passes everything through. ``drop`` names
    notification kinds to leave off (the data is still written): "chunk <i>", "seal"."""

    def __init__(self, inner: Any, before: Optional[Callable[[int, bytes], None]] = None,
                 drop: Sequence[str] = ()) -> None:
        self.inner, self.before, self.drop = inner, before, set(drop)
        self.peer_epochs = inner.peer_epochs
        self.dropped: List[bytes] = []
        #: The chunk whose write raised, if one did.
        self.failed_at: Optional[int] = None

    def _kept(self, message: bytes) -> bool:
        parsed = parse_message(message)
        kind = None if parsed is None else (
            f"chunk {parsed.index}" if parsed.kind == "chunk" else parsed.kind)
        if kind in self.drop:
            self.dropped.append(message)
            return False
        return True

    def write(self, peer: Any, src: Any, dst: Any, lengths: Any, *, notification: bytes = b"",
              **kwargs: Any) -> int:
        parsed = parse_message(notification) if notification else None
        if self.before is not None and parsed is not None and parsed.kind == "chunk":
            self.before(parsed.index, notification)
        if notification and not self._kept(notification):
            notification = b""
        try:
            return self.inner.write(peer, src, dst, lengths, notification=notification,
                                    **kwargs)
        except BaseException:
            if parsed is not None and self.failed_at is None:
                self.failed_at = parsed.index
            raise

    def notify(self, peer: Any, message: bytes, **kwargs: Any) -> None:
        if self._kept(message):
            self.inner.notify(peer, message, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# --- decode killed ---------------------------------------------------------------------------


def decode_killed(engine: str) -> None:
    for layout, runs, staging, chunks, during in (
            (SMALL, 5, Staging.SRC, BUFFERS, False),
            (LARGE, 200, Staging.BOTH, 3, True)):
        one_kill(engine, layout, runs, staging, chunks, during)


def one_kill(engine: str, layout: Layout, runs: int, staging: Staging, chunks: int,
             during: bool) -> None:
    setup = Setup(engine, layout, runs)
    killed: Dict[str, float] = {}
    try:
        victim = setup.peer

        def kill(index: int, _message: bytes) -> None:
            if index != 1 or killed:
                return
            if during:
                # While chunk 1 (several MiB) is being written.
                def later() -> None:
                    time.sleep(0.002)
                    killed["at"] = time.monotonic()
                    victim.kill()
                threading.Thread(target=later, daemon=True).start()
            else:
                killed["at"] = time.monotonic()
                victim.kill()

        hooked = Hooked(setup.transport, before=kill)
        streamer = Streamer(hooked, timeout=STEP_TIMEOUT)
        p, d = 0, 0
        rid = "killed-1"
        plan, release, slot = setup.plan(p, d, staging, rid)
        released = threading.Event()

        def free() -> None:
            release()
            released.set()

        try:
            streamer.send(setup.remote, plan, rid, chunks=chunks, release=free,
                          token=setup.tokens[rid])
            raise Failure(f"{engine}: a request to a killed decode process succeeded")
        except TransferError as caught:
            error = caught
            elapsed = time.monotonic() - killed["at"]
            text = str(error)
            require(rid in text and str(setup.remote)[:40] in text,
                    f"{engine}: the error names neither the request {rid} nor the peer: {text}")
            require(error.request_id == rid and error.peer == setup.remote,
                    f"{engine}: the error's request_id/peer are {error.request_id!r}, "
                    f"{error.peer!r}")
            bound = ENGINE_TIMEOUT + SLACK
            require(elapsed < bound, f"{engine}: the failure took {elapsed:.1f} s after the kill "
                                     f"(bound {bound} s)")
        require(released.wait(ENGINE_TIMEOUT + SLACK),
                f"{engine}: the staging slot of the failed request was not released")
        live = setup.pool.info().live_slots
        require(live == 0, f"{engine}: {live} prefill slots still live after the failure")
        kind = type(error).__name__
        # The next request, to a decode process that is alive, lands whole.
        setup.start_peer()
        rid = "after-kill"
        plan, release, _ = setup.plan(p, d, staging, rid)
        setup.streamer.send(setup.remote, plan, rid, chunks=chunks, release=release,
                            token=setup.tokens[rid])
        setup.delivered(rid, p, d, "the request after the kill")
        streamer.close()
        where = "2 ms into chunk 1's write" if during else "between chunks 0 and 1"
        print(f"  decode killed {where} ({plan.bytes >> 10} KiB, {staging.name}, {chunks} "
              f"chunks; the write of chunk {hooked.failed_at} failed): {kind} after "
              f"{elapsed * 1000:.0f} ms naming the peer and the request, slot returned, the "
              "next request to a live decode process verified")
    finally:
        setup.close()


# --- prefill killed --------------------------------------------------------------------------


def _prefill_child(conn: Any, placement: Placement, engine: str, runs: int, seed: int) -> None:
    """A prefill process: the same buffers as Setup's (same seed), a stream of 3 chunks whose
    second is cut short: half its segments are written, without a notification, then the
    process reports it and waits to be killed."""
    drive = placement.driver(engine)
    transport = drive.start("prefill")
    source = Source(SMALL, runs, seed)
    local = [transport.register(m) for m in source.memories()]
    pool = mori_tp.StagingPool(source.slot_bytes)
    transport.register(KvMemory((), 0, pool.address, pool.capacity))
    conn.send(("ready", drive.address(transport), drive.sender(transport)))
    _, address, remote, epoch, rid, token, p, d = conn.recv()
    peer = drive.connect(transport, address, epoch)

    class Stalling(Hooked):
        def write(self, peer: Any, src: Any, dst: Any, lengths: Any, *,
                  notification: bytes = b"", **kwargs: Any) -> int:
            parsed = parse_message(notification) if notification else None
            if parsed is not None and parsed.kind == "chunk" and parsed.index == 1:
                half = max(1, len(lengths) // 2)
                self.inner.write(peer, src[:half], dst[:half], lengths[:half], **kwargs)
                conn.send(("partial", half, len(lengths)))
                time.sleep(3600)  # killed here
            return self.inner.write(peer, src, dst, lengths, notification=notification,
                                    **kwargs)

    config = SMALL.config(p, d)
    need = BUFFERS * mori_tp.staging_len(config, len(source.request.src_pages))
    slot = pool.alloc(need)
    plan = plan_request(config, source.request.src_pages, source.request.dst_pages,
                        local=replace(local[p], staging=slot.address, staging_capacity=slot.size),
                        remote=KvMemory.from_dict(remote), staging=Staging.BOTH)
    Streamer(Stalling(transport)).send(peer, plan, rid, chunks=3, token=token)
    conn.send(("error", "the stalled stream returned"))


class Source:
    """Every prefill rank's buffers for ``layout`` and a request of ``runs`` runs, filled from
    ``seed`` (the same in every process), and the largest slot a pair's request needs."""

    def __init__(self, layout: Layout, runs: int, seed: int) -> None:
        self.layout = layout
        self.request = fragmented_request(seed, runs)
        self.capacity = self.request.src_capacity_pages * layout.src_item_len
        rng = np.random.default_rng(seed)
        self.buffers = [[rng.integers(0, 256, self.capacity, dtype=np.uint8)
                         for _ in range(BUFFERS)] for _ in range(layout.p_tp)]
        self.slot_bytes = _round_up(max(
            BUFFERS * mori_tp.staging_len(layout.config(p, d), len(self.request.src_pages))
            for p, d in layout.pairs()), 1 << 16)

    def memories(self) -> List[KvMemory]:
        return [KvMemory(tuple(int(b.ctypes.data) for b in rank), self.capacity)
                for rank in self.buffers]


def prefill_killed(engine: str) -> None:
    runs, seed, p, d, rid = 5, 3, 0, 0, "cut-1"
    source = Source(SMALL, runs, seed)
    drive = driver(engine, engine_timeout=ENGINE_TIMEOUT)
    transport = drive.start("decode", polled=True)
    capacity = source.request.dst_capacity_pages * SMALL.dst_item_len
    buffers = [sentinel(d, b, capacity) for b in range(BUFFERS)]
    memory = transport.register(KvMemory(tuple(int(b.ctypes.data) for b in buffers), capacity))
    pool = mori_tp.StagingPool(source.slot_bytes)
    transport.register(KvMemory((), 0, pool.address, pool.capacity))
    pool.view()[:] = 0
    process, conn = _start_child(_prefill_child, engine, runs, seed,
                                 placement=Placement(engine_timeout=ENGINE_TIMEOUT))
    # The prefill process is killed: nothing of it can land after the timeout.
    receiver = Receiver(transport, linger=0.0)
    try:
        message = _recv(conn, "ready")
        # Its name only (Driver.sender): the decode rank never loads the prefill's address.
        sender = message[2]
        receiver.start()
        config = SMALL.config(p, d)
        need = BUFFERS * mori_tp.staging_len(config, len(source.request.src_pages))
        slot = pool.alloc(need)
        ended = threading.Event()

        def done(_incoming: Any) -> None:
            pool.free(slot)
            ended.set()

        incoming = receiver.expect(rid, config, source.request.dst_pages,
                                   memory=replace(memory, staging=slot.address,
                                                  staging_capacity=slot.size),
                                   staging=Staging.BOTH, backend="host",
                                   timeout=DECODE_TIMEOUT, peer=sender, on_done=done)
        conn.send(("go", drive.address(transport),
                   replace(memory, staging=slot.address, staging_capacity=slot.size).to_dict(),
                   memory.epoch, rid, incoming.token, p, d))
        _, half, total = _recv(conn, "partial")
        process.kill()
        killed = time.monotonic()
        try:
            receiver.wait(incoming, timeout=DECODE_TIMEOUT + SLACK)
            raise Failure(f"{engine}: a request whose sender was killed completed")
        except TransferTimeoutError as error:
            elapsed = time.monotonic() - killed
            text = str(error)
        require(rid in text and "no progress for" in text,
                f"{engine}: the decode error does not name the request and the wait: {text}")
        require(elapsed < DECODE_TIMEOUT + SLACK,
                f"{engine}: the decode rank waited {elapsed:.1f} s (timeout {DECODE_TIMEOUT} s)")
        require(ended.wait(SLACK) and pool.info().live_slots == 0,
                f"{engine}: the decode slot was not freed ({pool.info().live_slots} live)")
        # Chunk 0 (buffers 0-1) arrived whole and was unpacked; chunk 1's first buffer reached
        # the staging slot but was never unpacked; the rest never came.
        want = [sentinel(d, b, capacity) for b in range(BUFFERS)]
        mori_tp.send_kvcache(config, [int(b.ctypes.data) for b in source.buffers[p]],
                             [int(w.ctypes.data) for w in want], src_capacity=source.capacity,
                             dst_capacity=capacity, src_pages=source.request.src_pages,
                             dst_pages=source.request.dst_pages, backend="host")
        first, second = chunk_ranges(BUFFERS, 0, chunks=3)[:2]
        length = mori_tp.staging_len(config, len(source.request.src_pages))
        for b in range(BUFFERS):
            unpacked = first[0] <= b < first[1]
            reference = want[b] if unpacked else sentinel(d, b, capacity)
            require(np.array_equal(buffers[b], reference),
                    f"{engine}: decode buffer {b} is not {'unpacked' if unpacked else 'untouched'}"
                    f" after the sender was killed ({incoming.unpacked()})")
        staged = pool.view()[slot.offset + second[0] * length:slot.offset + second[1] * length]
        require(staged.any(), f"{engine}: chunk 1's partial bytes never reached the slot: the "
                              "case did not cut a transfer short")
        print(f"  prefill killed mid-chunk ({half} of {total} segments of chunk 1 in the slot): "
              f"decode gave up after {elapsed:.1f} s (timeout {DECODE_TIMEOUT} s) naming "
              f"{rid}, slot freed, only chunk 0 unpacked")
    finally:
        receiver.close()
        _stop_child(process, conn, ("stop",))


def _recv(conn: Any, kind: str) -> Tuple[Any, ...]:
    if not conn.poll(STEP_TIMEOUT):
        raise Failure(f"the prefill process sent nothing for {STEP_TIMEOUT} s (waiting for "
                      f"{kind})")
    message = conn.recv()
    if message[0] != kind:
        raise Failure(f"the prefill process answered {message[0]}: {message[1:]}")
    return message


# --- lost notification -----------------------------------------------------------------------


def lost_notification(engine: str) -> None:
    setup = Setup(engine, SMALL, 5)
    try:
        p, d = 0, 0
        for rid, label, drop, layered in (
                ("lost-chunk", "a chunk's notification", ("chunk 1",), False),
                ("lost-seal", "the seal", ("sealed",), True)):
            hooked = Hooked(setup.transport, drop=drop)
            streamer = Streamer(hooked, timeout=STEP_TIMEOUT)
            plan, release, _ = setup.plan(p, d, Staging.BOTH, rid, decode_timeout=DECODE_TIMEOUT)
            start = time.monotonic()
            if layered:
                stream = streamer.open(setup.remote, plan, rid, layers=BUFFERS // 2,
                                       release=release, token=setup.tokens[rid])
                for layer in range(BUFFERS // 2):
                    stream.submit(layer)
                    # Each chunk is written before the seal: the count travels alone.
                    while stream._busy > 0:
                        time.sleep(0.001)
                stream.seal()
                waiting = stream.wait
            else:
                def waiting() -> Any:
                    return streamer.send(setup.remote, plan, rid, chunks=3, release=release,
                                         token=setup.tokens[rid])
            # The decode rank gives up, and the sender's wait must not report success (its
            # answer, done, never comes: issue 44 F01).
            try:
                waiting()
                raise Failure(f"{engine}: with {label} lost the sender reported success")
            except TransferError as error:
                require("the decode rank gave up" in str(error),
                        f"{engine}: with {label} lost the sender failed with {error}")
            require(len(hooked.dropped) == 1, f"{engine}: {len(hooked.dropped)} notifications "
                                              f"dropped, not one ({label})")
            report = setup.peer.ended(rid, timeout=DECODE_TIMEOUT + SLACK)
            elapsed = time.monotonic() - start
            missing = "chunks [1]" if not layered else "not sealed"
            require(report.error is not None and "no progress for" in report.error
                    and rid in report.error and missing in report.error,
                    f"{engine}: with {label} lost the decode side reported {report}")
            require(DECODE_TIMEOUT <= elapsed < DECODE_TIMEOUT + SLACK,
                    f"{engine}: with {label} lost the decode side ended after {elapsed:.1f} s")
            streamer.close()
            print(f"  {label} lost: the decode process gave up after {elapsed:.1f} s: "
                  f"{report.error[:110]}...")
        rid = "never-sent"
        config = SMALL.config(p, d)
        start = time.monotonic()
        setup.peer.expect(rid, d, config, setup.request.dst_pages, int(Staging.NONE), 0,
                          timeout=DECODE_TIMEOUT)
        # Its sender never answers the decode rank's cancel (no stream of it was opened):
        # the pages are held until the connector, which knows the request was never handed
        # to a prefill rank, lets them go.
        time.sleep(DECODE_TIMEOUT + 0.5)
        require(setup.peer.release(rid), f"{engine}: the request never sent was not held")
        report = setup.peer.ended(rid, timeout=SLACK)
        elapsed = time.monotonic() - start
        require(report.error is not None and "not sealed; 0 chunks arrived" in report.error,
                f"{engine}: a request never sent was reported as {report}")
        live = setup.peer.pool_info()[0]
        require(live == 0, f"{engine}: {live} decode slots live after the lost requests")
        print(f"  a request never sent: the decode process gave up after {elapsed:.1f} s "
              f"naming it; no decode slot left live")
        start = time.monotonic()
        try:
            setup.transport.wait_notification(setup.remote, b"never-sent", timeout=1.0)
            raise Failure(f"{engine}: a notification never sent was found")
        except TransferTimeoutError as error:
            elapsed = time.monotonic() - start
            require("never-sent" in str(error) and elapsed < 1.0 + SLACK,
                    f"{engine}: wait_notification ended after {elapsed:.1f} s with {error}")
        print(f"  wait_notification for a message never sent: TransferTimeoutError after "
              f"{elapsed:.1f} s")
    finally:
        setup.close()


# --- restart ---------------------------------------------------------------------------------


def restart(engine: str) -> None:
    setup = Setup(engine, SMALL, 5)
    try:
        p, d = 0, 0
        old_plan, release, _ = setup.plan(p, d, Staging.NONE, "before-restart")
        setup.streamer.send(setup.remote, old_plan, "before-restart", release=release,
                            token=setup.tokens["before-restart"])
        setup.delivered("before-restart", p, d, "before the restart")
        old_epoch = setup.peer.epoch
        setup.peer.kill()
        setup.start_peer()
        require(setup.peer.epoch != old_epoch, f"{engine}: the restarted process has the same "
                                               f"epoch {old_epoch:#x}")
        refusals = []
        for how, attempt in (
                ("send", lambda: setup.transport.send(setup.remote, old_plan,
                                                      request_id="stale")),
                ("a stream", lambda: setup.streamer.send(setup.remote, old_plan, "stale",
                                                         token=new_token())),
                ("a write", lambda: setup.transport.write(
                    setup.remote, *old_plan.addresses(), epoch=old_plan.remote.epoch,
                    request_id="stale"))):
            try:
                attempt()
                raise Failure(f"{engine}: {how} of a plan against the old memory went through")
            except StaleRegistrationError as error:
                require(error.planned == old_epoch and error.current == setup.peer.epoch
                        and "nothing was written" in str(error),
                        f"{engine}: {how} was refused with {error}")
                refusals.append(how)
        require(setup.peer.digests()[d] == setup.untouched(d),
                f"{engine}: the restarted process's buffers changed after the refusals")
        require(setup.peer.call("violations") == [],
                f"{engine}: the restarted process received messages for the refused plan")
        plan, release, _ = setup.plan(p, d, Staging.NONE, "after-restart")
        setup.streamer.send(setup.remote, plan, "after-restart", release=release,
                            token=setup.tokens["after-restart"])
        setup.delivered("after-restart", p, d, "after the restart")
        print(f"  restart: {', '.join(refusals)} against epoch {old_epoch:#x} refused after the "
              f"peer announced {setup.peer.epoch:#x}, its buffers untouched; a new plan "
              "verified")
    finally:
        setup.close()


# --- segments --------------------------------------------------------------------------------


def segments(engine: str) -> None:
    # NONE on tp2to8 writes one segment per token: 40 runs of 1-4 pages of 16 tokens.
    setup = Setup(engine, SMALL, 40, pool_requests=1)
    try:
        p, d = 0, 0
        plan, release, _ = setup.plan(p, d, Staging.NONE, "many")
        limit = 1024
        require(plan.segments > 2 * limit, f"{engine}: the request has only {plan.segments} "
                                           "segments")
        # One chunk: one transport write of every segment.
        result = setup.streamer.send(setup.remote, plan, "many", chunks=1, release=release,
                                     token=setup.tokens["many"])
        setup.delivered("many", p, d, "a request of many segments")
        if engine == "mooncake":
            want = -(-plan.segments // limit)
            require(result.calls == want, f"mooncake: {plan.segments} segments in "
                                          f"{result.calls} calls, not {want}")
            try:
                type(setup.transport)(setup.transport.engine, max_segments_per_call=4096)
                raise Failure("mooncake: max_segments_per_call 4096 was accepted")
            except ValueError as error:
                require("1 to 1024" in str(error) and "4096" in str(error),
                        f"mooncake: the refusal does not give the numbers: {error}")
            print(f"  {plan.segments} segments in {result.calls} calls of at most {limit}, "
                  "every byte; max_segments_per_call=4096 refused with the queue of 1024")
            concurrent(setup, plan.segments)
        else:
            require(result.calls == 1, f"{engine}: {plan.segments} segments in {result.calls} "
                                       "calls")
            print(f"  {plan.segments} segments in one {engine} transfer, every byte")
            large = Setup(engine, LARGE, 200, pool_requests=1)
            try:
                many_writes(large)
            finally:
                large.close()
    finally:
        setup.close()


def concurrent(setup: Setup, count: int) -> None:
    """Four streamers (four writing threads) send a request of ``count`` segments each to the
    same peer at once: 4 x 1024 segments at a time would overflow the engine's queue of 1024
    (+ 1024 waiting); the transport's budget keeps them within it, and all land. The same
    through a transport whose budget admits all four at once shows what the budget prevents
    (reported, not checked: it depends on how fast the engine drains its queue)."""
    errors = together(setup, setup.transport, "together")
    require(not errors, f"mooncake: concurrent sends to one peer failed: {errors[:1]!r}")
    loose = type(setup.transport)(setup.transport.engine, hostname=setup.transport.hostname,
                                  segment_budget=4 * 1024)
    loose.peer_epochs = setup.transport.peer_epochs
    refused = together(setup, loose, "unbudgeted", check=False)
    print(f"  4 writing threads x {count} segments to one peer at once: held within the "
          f"queue, every byte (with a budget of 4096, {len(refused)} of 4 were refused by the "
          "engine)")


def together(setup: Setup, transport: Any, label: str, check: bool = True
             ) -> List[BaseException]:
    """Requests of four sending pairs, from four streamers at once through ``transport``;
    the errors (checked byte for byte when ``check``)."""
    pairs = [(0, 0), (0, 1), (1, 4), (1, 5)]  # pairs of tp2to8 that send
    errors: List[BaseException] = []
    items = []
    for i, (p, d) in enumerate(pairs):
        rid = f"{label}-{i}"
        plan, release, _ = setup.plan(p, d, Staging.NONE, rid,
                                      decode_timeout=STEP_TIMEOUT if check else DECODE_TIMEOUT)
        items.append((p, d, rid, plan, release, Streamer(transport, timeout=STEP_TIMEOUT)))
    barrier = threading.Barrier(len(items))

    def one(item: Tuple[Any, ...]) -> None:
        _, _, rid, plan, release, streamer = item
        try:
            barrier.wait(STEP_TIMEOUT)
            streamer.send(setup.remote, plan, rid, chunks=1, release=release,
                          token=setup.tokens[rid])
        except BaseException as error:  # noqa: B036 - reported below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(STEP_TIMEOUT)
    for item in items:
        item[-1].close()
    if check and not errors:
        for p, d, rid, _, _, _ in items:
            setup.delivered(rid, p, d, "concurrent many-segment requests")
    return errors


def many_writes(setup: Setup) -> None:
    """One NIXL or MORI-IO write of 100000 64-byte segments into decode rank 0's buffers, checked."""
    n, step = 100_000, 80
    dst_memory = setup.peer.memories[1]
    src = setup.src[0][0]
    count = min(n, setup.dst_capacity // step, setup.src_capacity // step)
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(step)
    setup.peer.reset()
    setup.transport.write(setup.remote, np.uint64(src.ctypes.data) + offsets,
                          np.uint64(dst_memory.buffers[0]) + offsets,
                          np.full(count, 64, dtype=np.uint64), timeout=STEP_TIMEOUT,
                          epoch=dst_memory.epoch)
    want = sentinel(1, 0, setup.dst_capacity)
    for at in offsets.astype(np.int64):
        want[at:at + 64] = src[at:at + 64]
    require(setup.peer.digests()[1][0] == digest(want),
            f"{setup.engine}: a write of {count} segments did not land byte for byte")
    print(f"  one {setup.engine} write of {count} segments of 64 bytes, every byte")


CASES: Dict[str, Callable[[str], None]] = {
    "decode-killed": decode_killed,
    "prefill-killed": prefill_killed,
    "lost-notification": lost_notification,
    "restart": restart,
    "segments": segments,
}


def main(engine: str, case: str) -> int:
    if case not in CASES:
        print(f"unknown case {case!r}: one of {', '.join(CASES)}")
        return 2
    status = skip_or_arm(engine, TOTAL_TIMEOUT)
    if status is not None:
        return status
    start = time.monotonic()
    print(f"{engine} {case}: prefill pid {os.getpid()}, 127.0.0.1")
    try:
        CASES[case](engine)
    except (Failure, PeerError) as failure:
        print(f"FAILED: {failure}")
        return 1
    print(f"{engine} {case}: passed in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    run_program(lambda: main(sys.argv[1], sys.argv[2]))
