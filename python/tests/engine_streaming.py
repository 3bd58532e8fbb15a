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
- violations: a chunk notified twice and a chunk that never comes are reported by the child,
  and a message without the request's token is ignored and recorded;
- refusals: an expect the child refuses keeps no staging slot;
- strangers: a completion forged under this process's name without the request's token ends
  nothing and changes no byte; over NIXL the child cannot read this process's memory;
- chosen by cost: the prefill rank chooses each request's staging mode and chunk count
  (Streamer.choose), the decode child takes it from the notifications (staging=BY_SENDER):
  costs set so that each of the four modes is the cheapest, then costs the streamer learns
  from this engine's own writes.

    python3 python/tests/engine_streaming.py mooncake|nixl|mori_io

Exit status: 0 passed, 1 failed, 77 skipped (the engine is not installed; with
MORI_TP_REQUIRE_TOOLS=1 that is a failure instead). tests/python.rs runs it under cargo test.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

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
from mori_tp.engines import (
    BY_SENDER,
    CopyCosts,
    CostModel,
    KvMemory,
    Streamer,
    TransportCosts,
    new_token,
    plan_request,
)
from mori_tp.engines.loopback import PeerError, Placement, StreamPeer, driver, run_program
from mori_tp.engines.streaming import abort_message, chunk_message

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
        self.peer.connect(self.driver.sender(self.transport))
        self.streamer = Streamer(self.transport, timeout=STEP_TIMEOUT)
        self.ids = 0
        self.lock = threading.Lock()
        #: Each request's token, as the decode child drew it at expect (what a connector sends
        #: the prefill rank with the slot and pages).
        self.tokens: Dict[str, str] = {}

    def request_id(self, label: str) -> str:
        with self.lock:
            self.ids += 1
            return f"{label}-{self.ids}"

    def plan(self, layout: Layout, p: int, d: int, staging: Optional[Staging], rid: str):
        """Slots on both sides and the plan: what a connector does per request."""
        config = layout.config(p, d)
        chosen = mori_tp.staging_for(config) if staging is None else staging
        need = BUFFERS * mori_tp.staging_len(config, len(REQUEST.src_pages))
        remote_slot, self.tokens[rid] = self.peer.expect(rid, d, config, REQUEST.dst_pages,
                                                         int(chosen), need if chosen.unpacks
                                                         else 0)
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
                        result = self.streamer.send(self.remote, plan, rid, chunks=chunks,
                                                    token=self.tokens[rid])
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
            stream = self.streamer.open(self.remote, plan, rid, layers=LAYERS,
                                        token=self.tokens[rid])
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
                    self.streamer.send(self.remote, plan, rid, token=self.tokens[rid])
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
        a = self.streamer.open(self.remote, plan_a, ra, layers=LAYERS, token=self.tokens[ra])
        a.submit(0)
        self.streamer.send(self.remote, plan_b, rb, token=self.tokens[rb])
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
        token = self.tokens[rid]
        src, dst, lengths = plan.addresses([(0, 1)])
        self.transport.write(self.remote, src, dst, lengths,
                             notification=chunk_message(rid, token, 0, [(0, 1)],
                                                        staging=Staging.NONE),
                             timeout=STEP_TIMEOUT)
        carrier = int(dst[0])
        self.transport.notify(self.remote, chunk_message(rid, token, 0, [(0, 1)],
                                                         staging=Staging.NONE),
                              carrier=carrier)
        # The decode rank holds the failed request's pages until its sender answers that
        # every write of it returned (protocol v4): this raw sender answers as a Streamer does.
        self.transport.notify(self.remote, abort_message(rid, token, "every write returned"),
                              carrier=carrier)
        report = self.peer.ended(rid)
        if not report.error or "chunk 0 arrived twice" not in report.error:
            raise Failure(f"a chunk notified twice was not reported: {report}")
        rid = self.request_id("gap")
        config = layout.config(p, d)
        _, token = self.peer.expect(rid, d, config, REQUEST.dst_pages, int(Staging.NONE), 0,
                                    timeout=2.0)
        # A stranger's messages (without the token) change nothing ...
        self.transport.notify(self.remote, chunk_message(rid, "f" * 32, 0, [(0, BUFFERS)],
                                                         sealed=1, staging=Staging.NONE),
                              carrier=carrier)
        self.transport.notify(self.remote, chunk_message(rid, token, 0, [(0, 1)], sealed=2,
                                                         staging=Staging.NONE),
                              carrier=carrier)
        time.sleep(2.5)  # the decode rank's 2 s timeout fails it; then the sender answers
        self.transport.notify(self.remote, abort_message(rid, token, "every write returned"),
                              carrier=carrier)
        report = self.peer.ended(rid)
        if not report.error or "chunks [1]" not in report.error:
            raise Failure(f"a chunk that never came was not reported: {report}")
        # ... and are recorded.
        seen = self.peer.call("violations")
        if not any(f"request {rid}: a chunk message" in v and "without the request's token"
                   in v for v in seen):
            raise Failure(f"a message without the request's token was not reported: {seen}")
        print("  violations: a chunk twice and a chunk never sent are reported by the decode "
              "process, a message without the request's token is ignored and recorded")

    def refusals(self) -> None:
        """An expect the decode child refuses (an id the protocol cannot carry, an id already
        expected) gives its slot back at once; the one it accepted frees its slot when it
        ends (issue 33.13)."""
        layout = LAYOUTS["tp2to8"]
        p, d = sending_pairs(layout)[0]
        config = layout.config(p, d)
        live = self.peer.pool_info()[0]
        accepted, refused = [], []
        for rid in ("bad id", "dup-x", "dup-x"):
            try:
                self.peer.expect(rid, d, config, REQUEST.dst_pages, int(Staging.DST), 4096,
                                 timeout=1.0)
                accepted.append(rid)
            except PeerError as error:
                refused.append(str(error))
        if accepted != ["dup-x"] or "printable ASCII" not in refused[0] \
                or "already expected" not in refused[1]:
            raise Failure(f"expect: accepted {accepted}, refused {refused}")
        if self.peer.pool_info()[0] != live + 1:
            raise Failure(f"refused expects kept slots: {self.peer.pool_info()} live, "
                          f"{live} before")
        report = self.peer.ended("dup-x")
        if not report.error or "no progress" not in report.error:
            raise Failure(f"the request never sent ended as {report}")
        if self.peer.pool_info()[0] != live:
            raise Failure(f"the ended request kept its slot: {self.peer.pool_info()}")
        print("  refusals: a refused expect gives its slot back, the request accepted frees "
              "its slot once it ends")

    def forge(self, message: bytes) -> None:
        """Sends ``message`` to the decode child as a stranger that never handshook with it,
        under this process's own name on the engine (agent name, session id)."""
        if self.engine == "mori_io":
            # A side channel of its own, sending to the child's under this process's key.
            from mori_tp.engines.mori_io import SideChannel

            self._mallory = SideChannel(self.driver.hostname)
            self._mallory.send(self.peer.address["side_channel"], self.transport.key, message)
            return
        if self.engine == "nixl":
            from mori_tp.engines.nixl import NixlTransport

            self._mallory = NixlTransport.start(self.transport.name)
            self._mallory.notify(self._mallory.add_peer(self.peer.address), message)
            return
        import mooncake.engine as engine
        from mori_tp.engines.mooncake import MooncakeTransport

        self._mallory = MooncakeTransport.start(self.driver.hostname)
        status = self._mallory.engine.batch_transfer_sync(
            self.remote, [self._mallory._scratch_address()], [self.peer.memories[0].buffers[0]],
            [1], engine.TransferOpcode.Read,
            engine.TransferNotify(self.transport.session_id, message.decode()))
        if status != 0:
            raise Failure(f"mooncake: the forged notification was not sent ({status})")

    def strangers(self) -> None:
        """A stranger names itself after this process and sends a request's completion
        without its token (issue 40.1, probe_5): the request stays open, its pages untouched,
        and its real sender completes it. The decode child cannot read this process's memory
        over NIXL: it never loads this process's metadata (issue 40.5)."""
        layout = LAYOUTS["tp2to8"]
        want = self.expected(layout, 13)
        self.peer.reset()
        untouched = self.peer.digests()
        pairs = sending_pairs(layout)
        p, d = pairs[0]
        rid = self.request_id("victim")
        plan, slot = self.plan(layout, p, d, Staging.DST, rid)
        self.forge(chunk_message(rid, new_token(), 0, [(0, BUFFERS)], sealed=1,
                                 staging=Staging.DST))
        try:
            report = self.peer.ended(rid, timeout=2.0)
            raise Failure(f"{self.engine}: a stranger's message ended request {rid}: {report}")
        except PeerError:
            pass
        seen = self.peer.call("violations")
        if not any(f"request {rid}: a chunk message" in v and "without the request's token"
                   in v for v in seen):
            raise Failure(f"{self.engine}: the forged message was not recorded: {seen}")
        if self.peer.digests() != untouched:
            raise Failure(f"{self.engine}: a forged message changed the decode buffers")
        self.streamer.send(self.remote, plan, rid, token=self.tokens[rid])
        self.finish(rid, slot)
        for p, d in pairs[1:]:
            rid = self.request_id("after")
            plan, slot = self.plan(layout, p, d, None, rid)
            self.streamer.send(self.remote, plan, rid, token=self.tokens[rid])
            self.finish(rid, slot)
        self.check(layout, want, "after a stranger's message")
        outcome = self.peer.call("try_read", self.prefill.memories[0].buffers[0], 64)
        if self.engine == "nixl" and not outcome.startswith("refused"):
            raise Failure(f"nixl: the decode child read this process's memory: {outcome}")
        print(f"  strangers: a completion forged under this process's name, without the "
              f"token, ignored and recorded, the request then completed, every byte; a "
              f"one-sided read of this process's memory by the decode child: {outcome}")

    def plan_chosen(self, streamer: Streamer, layout: Layout, p: int, d: int, rid: str):
        """What a connector does per request when the sender chooses the staging: the decode
        child expects it with staging=BY_SENDER and a slot for the modes that unpack; this
        rank chooses with the streamer's cost model, takes its own slot if the mode packs,
        and plans."""
        config = layout.config(p, d)
        need = BUFFERS * mori_tp.staging_len(config, len(REQUEST.src_pages))
        remote_slot, self.tokens[rid] = self.peer.expect(rid, d, config, REQUEST.dst_pages,
                                                         BY_SENDER, need)
        remote = replace(self.peer.memories[d], staging=remote_slot, staging_capacity=need)
        choice = streamer.choose(self.remote, config, REQUEST.src_pages, REQUEST.dst_pages,
                                 remote=remote, request_id=rid)
        local = self.prefill.memories[p]
        slot = None
        if choice.staging.packs:
            slot = self.prefill.pool.alloc(need, timeout=STEP_TIMEOUT)
            local = replace(local, staging=slot.address, staging_capacity=slot.size)
        return plan_request(config, REQUEST.src_pages, REQUEST.dst_pages, local=local,
                            remote=remote, staging=choice.staging), slot, choice

    def chosen(self) -> int:
        """Each request's mode and chunks chosen by cost, byte for byte in the mode chosen:
        first with costs set so that each of the four modes is the cheapest for its layout,
        then with the costs the streamer learns from this engine's writes."""
        moved = 0
        cases = (
            # (layout, transport, copies, the mode they make the cheapest)
            ("tp2to8", TransportCosts(0.0, 1e10), CopyCosts(1e3), Staging.NONE),
            ("tp2to8", TransportCosts(1e-3, 1e10), CopyCosts(1e11, 1e3), Staging.SRC),
            ("tp8to2", TransportCosts(1e-3, 1e10), CopyCosts(1e3, 1e11), Staging.DST),
            ("tp8to2", TransportCosts(1e-3, 1e10), CopyCosts(1e11), Staging.BOTH),
        )
        for seed, (name, transport, copy, want) in enumerate(cases, 20):
            layout = LAYOUTS[name]
            want_digests = self.expected(layout, seed)
            self.peer.reset()
            with Streamer(self.transport, timeout=STEP_TIMEOUT,
                          costs=CostModel(transport, copy)) as streamer:
                for p, d in sending_pairs(layout):
                    rid = self.request_id(f"chosen-{want.name.lower()}")
                    plan, slot, choice = self.plan_chosen(streamer, layout, p, d, rid)
                    if choice.staging is not want:
                        raise Failure(f"{rid}: the model chose {choice.describe()}, expected "
                                      f"{want.name}")
                    streamer.send(self.remote, plan, rid, chunks=choice.chunks,
                                  token=self.tokens[rid])
                    self.finish(rid, slot)
                    moved += 1
            self.check(layout, want_digests, f"chosen {want.name} on {name}")
        print(f"  chosen by cost: costs set for each of NONE, SRC, DST, BOTH, each chosen and "
              "taken from the notifications by the decode child, every byte")
        # Costs learnt from this engine: staging_for's mode and the mode with the fewest
        # segments in turn, then the model's choice.
        layout = LAYOUTS["tp2to8"]
        want_digests = self.expected(layout, 30)
        picks: List[str] = []
        with Streamer(self.transport, timeout=STEP_TIMEOUT) as streamer:
            for round_ in range(2):
                self.peer.reset()
                for p, d in sending_pairs(layout):
                    rid = self.request_id("learnt")
                    plan, slot, choice = self.plan_chosen(streamer, layout, p, d, rid)
                    picks.append(f"{choice.staging.name}/{choice.chunks} ({choice.reason})")
                    streamer.send(self.remote, plan, rid, chunks=choice.chunks,
                                  token=self.tokens[rid])
                    self.finish(rid, slot)
                    moved += 1
                self.check(layout, want_digests, f"learnt costs, round {round_}")
            learnt = streamer.costs.transport_costs(self.remote)
        if learnt is None or not any(p.endswith("(model)") for p in picks):
            raise Failure(f"{self.engine}: the streamer learnt no costs from its writes: "
                          f"{picks}")
        print(f"  chosen by learnt costs ({learnt.describe()}): {', '.join(picks)}; every "
              "byte")
        return moved

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
        run.refusals()
        run.strangers()
        moved += run.chosen()
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
