"""A prefill rank that stalls past the decode rank's timeout must never write into memory the
decode rank has given to another request, and must never report success (issue 44 F01; the
promise is REFERENCE.md section 17). Two processes on 127.0.0.1 through a real engine: the
decode rank is a StreamPeer child (Receiver with a 1 s request timeout and a 1 s linger, the
defaults' ratio), this process is the prefill rank.

For each stage the stall is placed at, request "old" stalls STALL seconds: before its first
chunk (its ``ready``), between two chunks (a slow layer), inside the engine write of a chunk
(after every check the sender makes: the race a sender-side check cannot close), before the
seal, and after the seal (the seal's notification held). The decode rank gives up after 1 s
and cancels; once the sender has answered (every write of it returned) the decode rank frees
the pages and the slot, and request "new" takes the same pages (and, staged DST, the same
slot). Checked: old's wait() raises, nothing of old is written after the cancel arrived but
the write already in progress, new's pages stay byte-exact after old's stall ended, the
decode rank released old only on its sender's answer, and both pools end empty.

    python3 python/tests/engine_late_writes.py mooncake|nixl

Exit status 0 passed, 1 failed, 77 skipped (engine missing; with MORI_TP_REQUIRE_TOOLS=1 a
failure). tests/python.rs runs it for both engines.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable, List

import mori_tp
from engine_loopback import skip_or_arm
from layouts import Layout
from mori_tp import Staging
from mori_tp.engines import KvMemory, Streamer, TransferError, plan_request
from mori_tp.engines.loopback import StreamPeer, driver, run_program, sentinel

import numpy as np

LAYOUT = Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=32)
NB, LAYERS, PAGES = 6, 3, 16
TIMEOUT = LINGER = 1.0
STALL = 3.0
DST_PAGES = [4, 5, 6, 7]
TOTAL_TIMEOUT = 280


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Case:
    def __init__(self, engine: str, staging: Staging) -> None:
        self.engine = engine
        self.staging = staging
        self.config = LAYOUT.config(0, 0)
        self.drv = driver(engine)
        self.transport = self.drv.start("prefill")
        cap_src, self.cap_dst = PAGES * LAYOUT.src_item_len, PAGES * LAYOUT.dst_item_len
        rng = np.random.default_rng(5)
        self.src = [rng.integers(0, 256, cap_src, dtype=np.uint8) for _ in range(NB)]
        self.cap_src = cap_src
        self.local = self.transport.register(
            KvMemory(tuple(int(b.ctypes.data) for b in self.src), cap_src))
        self.pool = mori_tp.StagingPool(1 << 20)
        self.transport.register(KvMemory((), 0, self.pool.address, self.pool.capacity))
        self.slot_bytes = NB * mori_tp.staging_len(self.config, len(DST_PAGES))
        # One slot of the decode pool fits one request: new reuses old's slot.
        self.peer = StreamPeer(engine, [(NB, self.cap_dst)], 1 << 16, 30.0, linger=LINGER,
                               min_slot=1 << 16)
        self.remote = self.drv.connect(self.transport, self.peer.address, self.peer.epoch)
        self.peer.connect(self.drv.sender(self.transport))
        self.streamer = Streamer(self.transport, timeout=30.0)
        #: (time, what) of every write and notification of request "old" as it starts.
        self.log: List[Any] = []
        self.stall: Callable[[str, bytes], bool] = lambda what, message: False
        self._wrap()

    def _wrap(self) -> None:
        write, notify = self.transport.write, self.transport.notify

        def stalled(what: str, message: bytes) -> None:
            if b" old " in message:
                if self.stall(what, message):
                    time.sleep(STALL)
                self.log.append((time.monotonic(), what, message.split(b" ")[3:5]))

        def writing(peer: Any, src: Any, dst: Any, lengths: Any, **kwargs: Any) -> int:
            stalled("write", kwargs.get("notification", b""))
            return write(peer, src, dst, lengths, **kwargs)

        def notifying(peer: Any, message: bytes, **kwargs: Any) -> None:
            stalled("notify", message)
            return notify(peer, message, **kwargs)

        self.transport.write = writing
        self.transport.notify = notifying

    def plan(self, rid: str, src_pages: List[int]) -> Any:
        slot_addr, token = self.peer.expect(rid, 0, self.config, DST_PAGES, int(self.staging),
                                            self.slot_bytes if self.staging.unpacks else 0,
                                            timeout=TIMEOUT)
        slot = self.pool.alloc(self.slot_bytes)
        memory = replace(self.local, staging=slot.address, staging_capacity=slot.size)
        remote = self.peer.memories[0]
        if slot_addr:
            remote = replace(remote, staging=slot_addr, staging_capacity=self.slot_bytes)
        return plan_request(self.config, src_pages, DST_PAGES, local=memory, remote=remote,
                            staging=self.staging, token=token), slot

    def expected(self, src_pages: List[int]) -> List[bytes]:
        want = [sentinel(0, b, self.cap_dst) for b in range(NB)]
        mori_tp.send_kvcache(self.config, [int(b.ctypes.data) for b in self.src],
                             [int(w.ctypes.data) for w in want], src_capacity=self.cap_src,
                             dst_capacity=self.cap_dst, src_pages=src_pages,
                             dst_pages=DST_PAGES, backend="host")
        return [bytes(w) for w in want]

    def differing(self, want: List[bytes]) -> int:
        item = LAYOUT.dst_item_len
        bad = 0
        for b in range(NB):
            got = self.peer.fetch(0, b)
            for page in DST_PAGES:
                bad += got[page * item:(page + 1) * item] != want[b][page * item:(page + 1) * item]
        return bad

    def run(self, stage: str) -> str:
        self.peer.reset()
        self.log.clear()
        t0 = time.monotonic()
        old_plan, old_slot = self.plan("old", [0, 1, 2, 3])
        stream = self.streamer.open(self.remote, old_plan, "old", layers=LAYERS,
                                    release=lambda: self.pool.free(old_slot))
        slow = lambda: time.sleep(STALL)  # noqa: E731 - a slow layer
        sealed_late = None
        if stage == "before-first":
            stream.submit(0, ready=slow)
            stream.submit(1)
            stream.submit(2)
            stream.seal()
        elif stage == "between":
            stream.submit(0)
            stream.submit(1, ready=slow)
            stream.submit(2, ready=slow)
            stream.seal()
        elif stage == "in-write":
            self.stall = lambda what, m: what == "write" and b"chunk 1 " in m
            for layer in range(LAYERS):
                stream.submit(layer)
            stream.seal()
        elif stage == "before-seal":
            for layer in range(LAYERS):
                stream.submit(layer)
            sealed_late = threading.Timer(STALL, self._seal_late, args=(stream,))
            sealed_late.start()
        elif stage == "after-seal":
            self.stall = lambda what, m: what == "notify" and b" sealed " in m
            for layer in range(LAYERS):
                stream.submit(layer)
            deadline = time.monotonic() + 10
            while stream._written < LAYERS and time.monotonic() < deadline:
                time.sleep(0.01)
            stream.seal()  # the count goes alone, and its notification is held
        else:
            raise ValueError(stage)
        report = self.peer.ended("old", timeout=30)
        ended = time.monotonic() - t0
        require(report.error is not None, f"{stage}: old did not fail on the decode rank")
        # Released only on the sender's answer (not by the linger: the cancel reached it).
        require("released" not in (report.error or "") and not report.released,
                f"{stage}: old was released without its sender's answer: {report.released}")
        new_plan, new_slot = self.plan("new", [8, 9, 10, 11])
        self.stall = lambda what, m: False
        result = self.streamer.send(self.remote, new_plan, "new",
                                    release=lambda: self.pool.free(new_slot))
        require(result.bytes == new_plan.bytes, f"{stage}: new moved {result.bytes} bytes")
        new_report = self.peer.ended("new", timeout=30)
        require(new_report.error is None, f"{stage}: new failed: {new_report.error}")
        want = self.expected([8, 9, 10, 11])
        require(self.differing(want) == 0, f"{stage}: new landed wrong")
        try:
            stream.wait(30)
            raise AssertionError(f"{stage}: old's wait() reported success")
        except TransferError as error:
            why = str(error)
        if sealed_late is not None:
            sealed_late.join()
            require(self.sealed_late is not None, f"{stage}: the late seal did not raise")
        # Every stall is over: nothing of old may land any more.
        time.sleep(max(0.0, STALL + 0.5 - (time.monotonic() - t0)))
        time.sleep(0.5)
        bad = self.differing(want)
        require(bad == 0, f"{stage}: {bad} of {NB * len(DST_PAGES)} pages of the completed "
                          "request 'new' were overwritten by old's late writes")
        require(stream.released(10), f"{stage}: old's slot not released")
        require(self.peer.pool_info() == (0, 0), f"{stage}: decode pool holds "
                                                 f"{self.peer.pool_info()}")
        require(self.pool.info().live_slots == 0, f"{stage}: prefill pool holds slots")
        return (f"old failed on decode, held, and released at {ended:.1f} s on its sender's "
                f"answer; old's wait raised ({why[:70]}...); 'new' byte-exact after the stall")

    def _seal_late(self, stream: Any) -> None:
        self.sealed_late = None
        try:
            stream.seal()
        except TransferError as error:
            self.sealed_late = error

    def close(self) -> None:
        self.streamer.close()
        self.peer.close()


STAGES = ("before-first", "between", "in-write", "before-seal", "after-seal")


def main(engine: str) -> int:
    skip_or_arm(engine, TOTAL_TIMEOUT)
    failures = 0
    for staging in (Staging.SRC, Staging.DST):
        case = Case(engine, staging)
        try:
            for stage in STAGES:
                if staging is Staging.DST and stage in ("before-seal", "after-seal"):
                    continue  # the slot's reuse is the same as the pages' there
                try:
                    print(f"{engine} {staging.name} {stage}: {case.run(stage)}", flush=True)
                except AssertionError as error:
                    failures += 1
                    print(f"FAIL {engine} {staging.name} {stage}: {error}", flush=True)
        finally:
            case.close()
    print("engine_late_writes:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("mooncake", "nixl"):
        print(__doc__)
        sys.exit(2)
    run_program(lambda: main(sys.argv[1]))
