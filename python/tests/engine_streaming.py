"""Pipelined and layer-wise streamed requests between two processes on 127.0.0.1 through a real
transfer engine, with staging pools on both sides: this process holds every prefill rank and
writes, a child holds every decode rank and receives with mori_tp.engines.Receiver.

Cases, each checked byte for byte against one send_kvcache per pair (host backend), bytes
outside the slices included:
- pipelined: every sending pair of tp2to8 and h12p6d4, every staging choice, automatic chunks
  and 3 chunks;
- streamed: layers submitted in reverse order behind a simulated compute thread (ready events),
  two layers in one group, the child reporting the chunks in the order sent;
- in flight: every sending pair of tp8to2 at once from four threads, through a decode pool that
  holds two requests (the rest wait for slots: backpressure), completing in any order; and a
  request that completes before one opened earlier;
- violations: a chunk notified twice and a chunk that never comes are reported by the child.

    python3 python/tests/engine_streaming.py mooncake|nixl

Exit status: 0 passed, 1 failed, 77 skipped (the engine is not installed; with
MORI_TP_REQUIRE_TOOLS=1 that is a failure instead). tests/python.rs runs it under cargo test.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any, List, Optional, Tuple

import mori_tp
from engine_loopback import (
    BUFFERS,
    LAYOUTS,
    REQUEST,
    decode_shape,
    expected_digests,
    prefill_buffers,
    skip_or_arm,
    slot_len,
)
from engine_loopback import Prefill as PlainPrefill
from layouts import Layout
from mori_tp import Action, Staging
from mori_tp.engines import KvMemory, Streamer, plan_request
from mori_tp.engines.loopback import Placement, StreamPeer, driver, run_program
from mori_tp.engines.streaming import chunk_message

LAYERS = BUFFERS // 2
STAGINGS: Tuple[Optional[Staging], ...] = (None, Staging.NONE, Staging.SRC, Staging.DST,
                                           Staging.BOTH)
STEP_TIMEOUT = 60.0
#: Below the 300 s that tests/python.rs allows, so that this script reports a hang itself.
TOTAL_TIMEOUT = 270


class Failure(AssertionError):
    pass


def sending_pairs(layout: Layout) -> List[Tuple[int, int]]:
    return [(p, d) for p, d in layout.pairs() if layout.config(p, d).action is Action.SEND]


class Prefill(PlainPrefill):
    """Every prefill rank's buffers (as engine_loopback's) and one StagingPool, registered
    once."""

    def __init__(self, transport: Any) -> None:
        self.capacity, self.buffers = prefill_buffers()
        self.pool = mori_tp.StagingPool(-(-slot_len() * 4 // (1 << 16)) * (1 << 16))
        self.memories = [KvMemory(tuple(int(b.ctypes.data) for b in rank), self.capacity)
                         for rank in self.buffers]
        for memory in self.memories:
            transport.register(memory)
        transport.register(KvMemory((), 0, self.pool.address, self.pool.capacity))


class Run:
    """The cases, with this process's engine at ``hostname`` and the decode child's at
    ``placement`` (default: both on 127.0.0.1)."""

    def __init__(self, engine: str, hostname: str = "127.0.0.1",
                 placement: Placement = Placement()) -> None:
        self.engine = engine
        self.peer_placement = placement
        self.driver = driver(engine, hostname)
        self.transport = self.driver.start("prefill")
        self.prefill = Prefill(self.transport)
        self.decode_capacity, self.decode_ranks = decode_shape()
        # Room for two requests: more in flight must wait for a slot.
        self.peer = StreamPeer(engine, [(BUFFERS, self.decode_capacity)] * self.decode_ranks,
                               2 * -(-slot_len() // (1 << 16)) * (1 << 16), STEP_TIMEOUT,
                               placement=placement)
        # With the child's registration epoch: every plan is checked against it.
        self.remote = self.driver.connect(self.transport, self.peer.address, self.peer.epoch)
        self.peer.connect(self.driver.address(self.transport))
        self.streamer = Streamer(self.transport, timeout=STEP_TIMEOUT)
        self.ids = 0
        self.lock = threading.Lock()

    def request_id(self, label: str) -> str:
        with self.lock:
            self.ids += 1
            return f"{label}-{self.ids}"

    def plan(self, layout: Layout, p: int, d: int, staging: Optional[Staging], rid: str):
        """Slots on both sides and the plan: what a connector does per request."""
        config = layout.config(p, d)
        chosen = mori_tp.staging_for(config) if staging is None else staging
        need = BUFFERS * mori_tp.staging_len(config, len(REQUEST.src_pages))
        remote_slot = self.peer.expect(rid, d, config, REQUEST.dst_pages, int(chosen),
                                       need if chosen.unpacks else 0)
        local = self.prefill.memories[p]
        slot = None
        if chosen.packs:
            slot = self.prefill.pool.alloc(need, timeout=STEP_TIMEOUT)
            local = replace(local, staging=slot.address, staging_capacity=slot.size)
        remote = replace(self.peer.memories[d], staging=remote_slot,
                         staging_capacity=need if remote_slot else 0)
        return plan_request(config, REQUEST.src_pages, REQUEST.dst_pages, local=local,
                            remote=remote, staging=chosen), slot

    def finish(self, rid: str, slot: Any) -> Any:
        report = self.peer.ended(rid)
        if slot is not None:
            self.prefill.pool.free(slot)
        if report.error:
            raise Failure(f"{self.engine}: request {rid} failed on the decode side: "
                          f"{report.error}")
        return report

    def check(self, layout: Layout, want: List[List[str]], what: str) -> None:
        got = self.peer.digests()
        wrong = [(d, b) for d, (g, w) in enumerate(zip(got, want))
                 for b, (x, y) in enumerate(zip(g, w)) if x != y]
        if wrong:
            raise Failure(f"{self.engine} {what}: decode buffers {wrong} differ from "
                          "send_kvcache's result")

    def expected(self, layout: Layout, seed: int) -> List[List[str]]:
        self.prefill.fill(seed)
        return expected_digests(layout, self.prefill, self.decode_capacity, self.decode_ranks)

    # -- the cases --

    def pipelined(self) -> int:
        moved = 0
        for seed, name in enumerate(("tp2to8", "h12p6d4")):
            layout = LAYOUTS[name]
            want = self.expected(layout, seed)
            for staging in STAGINGS:
                for chunks in (None, 3):
                    self.peer.reset()
                    for p, d in sending_pairs(layout):
                        rid = self.request_id("pipelined")
                        plan, slot = self.plan(layout, p, d, staging, rid)
                        result = self.streamer.send(self.remote, plan, rid, chunks=chunks)
                        if (result.segments, result.bytes) != (plan.segments, plan.bytes):
                            raise Failure(f"{rid}: wrote {result}, planned {plan.segments}")
                        self.finish(rid, slot)
                        moved += 1
                    label = "staging_for" if staging is None else staging.name
                    self.check(layout, want, f"pipelined {name} {label} chunks={chunks}")
            print(f"  pipelined {name:8}: every staging, automatic and 3 chunks, every byte")
        return moved

    def streamed(self) -> None:
        layout = LAYOUTS["tp2to8"]
        want = self.expected(layout, 11)
        self.peer.reset()
        order = [LAYERS - 1 - layer for layer in range(LAYERS)]
        for p, d in sending_pairs(layout):
            rid = self.request_id("layers")
            plan, slot = self.plan(layout, p, d, None, rid)
            stream = self.streamer.open(self.remote, plan, rid, layers=LAYERS)
            events = [threading.Event() for _ in range(LAYERS)]

            def compute() -> None:
                for layer in order:
                    time.sleep(0.002)  # a layer's prefill compute
                    events[layer].set()

            worker = threading.Thread(target=compute)
            worker.start()
            stream.submit(order[:2], ready=lambda: events[order[1]].wait(STEP_TIMEOUT))
            for layer in order[2:]:
                stream.submit(layer, ready=lambda layer=layer: events[layer].wait(STEP_TIMEOUT))
            try:
                stream.submit(order[0])
                raise Failure("a layer submitted twice was accepted")
            except mori_tp.InvalidArgumentError:
                pass
            stream.seal()
            stream.wait()
            worker.join(STEP_TIMEOUT)
            report = self.finish(rid, slot)
            sent = [sorted([(l, l + 1) for l in order[:2]] +
                           [(LAYERS + l, LAYERS + l + 1) for l in order[:2]])]
            sent += [[(l, l + 1), (LAYERS + l, LAYERS + l + 1)] for l in order[2:]]
            landed = [sorted(b for a, e in chunk for b in range(a, e)) for chunk in report.chunks]
            expected = [sorted(b for a, e in chunk for b in range(a, e)) for chunk in sent]
            if landed != expected:
                raise Failure(f"{rid}: chunks landed as {report.chunks}, sent as {sent}")
        self.check(layout, want, "streamed by layer")
        print(f"  streamed tp2to8: {LAYERS} layers in reverse order behind ready events, "
              "a layer twice refused, every byte")

    def in_flight(self) -> None:
        layout = LAYOUTS["tp8to2"]
        want = self.expected(layout, 12)
        self.peer.reset()
        pairs = sending_pairs(layout)
        failures: List[BaseException] = []
        finished: List[Tuple[float, str]] = []

        def worker(mine: List[Tuple[int, int]]) -> None:
            try:
                for p, d in mine:
                    rid = self.request_id("flight")
                    plan, slot = self.plan(layout, p, d, Staging.BOTH, rid)
                    self.streamer.send(self.remote, plan, rid)
                    finished.append((self.finish(rid, slot).finished_at, rid))
            except BaseException as error:  # noqa: B036 - reported below
                failures.append(error)

        threads = [threading.Thread(target=worker, args=(pairs[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STEP_TIMEOUT * 4)
        if failures:
            raise Failure(f"{self.engine} in flight: {failures[0]!r}")
        self.check(layout, want, "in flight")
        # Out of order on purpose: B is opened after A and completes first.
        self.peer.reset()
        (pa, da), (pb, db) = pairs[0], pairs[1]
        ra, rb = self.request_id("A"), self.request_id("B")
        plan_a, slot_a = self.plan(layout, pa, da, Staging.BOTH, ra)
        plan_b, slot_b = self.plan(layout, pb, db, Staging.BOTH, rb)
        a = self.streamer.open(self.remote, plan_a, ra, layers=LAYERS)
        a.submit(0)
        self.streamer.send(self.remote, plan_b, rb)
        report_b = self.finish(rb, slot_b)
        a.submit(list(range(1, LAYERS)))
        a.seal()
        report_a = self.finish(ra, slot_a)
        if not report_b.finished_at < report_a.finished_at:
            raise Failure("B, sent whole after A's first layer, did not complete first")
        print(f"  in flight tp8to2: {len(pairs)} requests from 4 threads through a decode pool "
              "of 2 slots, and one completing before an earlier one, every byte")

    def violations(self) -> None:
        layout = LAYOUTS["tp2to8"]
        p, d = sending_pairs(layout)[0]
        rid = self.request_id("dup")
        plan, slot = self.plan(layout, p, d, Staging.NONE, rid)
        src, dst, lengths = plan.addresses([(0, 1)])
        self.transport.write(self.remote, src, dst, lengths,
                             notification=chunk_message(rid, 0, [(0, 1)]), timeout=STEP_TIMEOUT)
        carrier = (int(src[0]), int(dst[0]))
        self.transport.notify(self.remote, chunk_message(rid, 0, [(0, 1)]), carrier=carrier)
        report = self.peer.ended(rid)
        if not report.error or "chunk 0 arrived twice" not in report.error:
            raise Failure(f"a chunk notified twice was not reported: {report}")
        rid = self.request_id("gap")
        config = layout.config(p, d)
        self.peer.expect(rid, d, config, REQUEST.dst_pages, int(Staging.NONE), 0, timeout=2.0)
        self.transport.notify(self.remote, chunk_message(rid, 0, [(0, 1)], sealed=2),
                              carrier=carrier)
        report = self.peer.ended(rid)
        if not report.error or "chunks [1]" not in report.error:
            raise Failure(f"a chunk that never came was not reported: {report}")
        print("  violations: a chunk twice and a chunk never sent are reported by the decode "
              "process")

    def close(self) -> None:
        self.streamer.close()
        self.peer.close()


def main(engine: str) -> int:
    status = skip_or_arm(engine, TOTAL_TIMEOUT)
    if status is not None:
        return status
    start = time.monotonic()
    run = Run(engine)
    try:
        print(f"{engine}: prefill pid {os.getpid()} -> decode child, 127.0.0.1")
        moved = run.pipelined()
        run.streamed()
        run.in_flight()
        run.violations()
    except Failure as failure:
        print(f"FAILED: {failure}")
        return 1
    finally:
        run.close()
    print(f"{engine}: {moved} pipelined requests and the streamed, in-flight and violation "
          f"cases verified in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    run_program(lambda: main(sys.argv[1]))
