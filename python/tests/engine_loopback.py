"""Two processes on 127.0.0.1 joined by a real transfer engine: this one holds every prefill
rank of a layout and writes (the initiator), a child holds every decode rank (the target).

For each layout (tp2to8, tp8to2, tp4to8 and the non-integer H=12 P6->D4; page size 16;
fragmented pages; three layers, K and V) and each staging choice (staging_for's, NONE, SRC,
DST, BOTH), every sending pair moves its request through the engine, the child unpacks the
staged ones, and every byte of every decode buffer must equal what mori_send_kvcache (host
backend) leaves in a copy of the same sentinel-filled buffers, bytes outside the slices
included. A negative control drops one segment and requires the check to fail, at that segment.

    python3 python/tests/engine_loopback.py mooncake|nixl

Exit status: 0 passed, 1 failed, 77 skipped (the engine is not installed; with
MORI_TP_REQUIRE_TOOLS=1 that is a failure instead). tests/python.rs runs it under cargo test.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from typing import List, Optional, Tuple

import numpy as np

import mori_tp
from layouts import Layout, fragmented_request, tools_required
from mori_tp import Action, Staging
from mori_tp.engines import KvMemory, plan_request
from mori_tp.engines.loopback import (
    DecodePeer,
    Receive,
    digest,
    driver,
    engine_available,
    first_difference,
    run_program,
    sentinel,
)

LAYOUTS = {
    "tp2to8": Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=32),
    "tp8to2": Layout(heads=4, p_tp=8, d_tp=2, page_size=16, bytes_per_head=32),
    "tp4to8": Layout(heads=8, p_tp=4, d_tp=8, page_size=16, bytes_per_head=32),
    "h12p6d4": Layout(heads=12, p_tp=6, d_tp=4, page_size=16, bytes_per_head=32),
}
BUFFERS = 6  # K and V of three layers
#: None: staging_for's choice; then every mode forced.
STAGINGS: Tuple[Optional[Staging], ...] = (None, Staging.NONE, Staging.SRC, Staging.DST,
                                           Staging.BOTH)
REQUEST = fragmented_request(seed=2024, runs=5)
STEP_TIMEOUT = 60.0
#: Below the 300 s that tests/python.rs allows, so that this script reports a hang itself.
TOTAL_TIMEOUT = 240


class Failure(AssertionError):
    pass


def prefill_buffers() -> Tuple[int, List[List["np.ndarray"]]]:
    """(capacity, buffers per rank) for every prefill rank of every layout."""
    ranks = max(layout.p_tp for layout in LAYOUTS.values())
    capacity = REQUEST.src_capacity_pages * max(l.src_item_len for l in LAYOUTS.values())
    return capacity, [[np.zeros(capacity, dtype=np.uint8) for _ in range(BUFFERS)]
                      for _ in range(ranks)]


def decode_shape() -> Tuple[int, int]:
    """(capacity of each buffer, ranks) the decode child holds for every layout."""
    return (REQUEST.dst_capacity_pages * max(l.dst_item_len for l in LAYOUTS.values()),
            max(l.d_tp for l in LAYOUTS.values()))


class Prefill:
    """Every prefill rank's buffers and a staging pool in this process, registered once."""

    def __init__(self, transport) -> None:
        self.capacity, self.buffers = prefill_buffers()
        self.slot = slot_len()
        self.pool = np.zeros(self.slot * max_pairs(), dtype=np.uint8)
        self.memories = [KvMemory(tuple(int(b.ctypes.data) for b in rank), self.capacity,
                                  int(self.pool.ctypes.data), self.pool.nbytes)
                         for rank in self.buffers]
        for rank, memory in enumerate(self.memories):
            transport.register(memory if rank == 0 else replace(memory, staging=0,
                                                                staging_capacity=0))

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for rank in self.buffers:
            for data in rank:
                data[:] = rng.integers(0, 256, data.nbytes, dtype=np.uint8)


def slot_len() -> int:
    """The most staging bytes any pair's request needs (BUFFERS x staging_len)."""
    widest = max(min(l.bytes_per_token(l.p_tp), l.bytes_per_token(l.d_tp))
                 for l in LAYOUTS.values())
    return BUFFERS * len(REQUEST.src_pages) * 16 * widest


def max_pairs() -> int:
    return max(sum(l.config(p, d).action is Action.SEND for p, d in l.pairs())
               for l in LAYOUTS.values())


def expected_digests(layout: Layout, prefill: Prefill, decode_capacity: int,
                     decode_ranks: int) -> List[List[str]]:
    """Every decode buffer after one send_kvcache per pair on the host backend."""
    out = []
    for d in range(decode_ranks):
        want = [sentinel(d, b, decode_capacity) for b in range(BUFFERS)]
        if d < layout.d_tp:
            for p in range(layout.p_tp):
                mori_tp.send_kvcache(
                    layout.config(p, d), prefill.memories[p].buffers,
                    [int(w.ctypes.data) for w in want],
                    src_capacity=prefill.capacity, dst_capacity=decode_capacity,
                    src_pages=REQUEST.src_pages, dst_pages=REQUEST.dst_pages, backend="host",
                )
        out.append([digest(w) for w in want])
    return out


class Run:
    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.driver = driver(engine)
        self.transport = self.driver.start("prefill")
        self.prefill = Prefill(self.transport)
        self.decode_capacity, self.decode_ranks = decode_shape()
        self.peer = DecodePeer(engine, [(BUFFERS, self.decode_capacity)] * self.decode_ranks,
                               self.prefill.slot * max_pairs(), STEP_TIMEOUT)
        self.remote = self.driver.connect(self.transport, self.peer.address)
        self.peer.connect(self.driver.address(self.transport))
        self.tags = 0

    def tag(self) -> bytes:
        self.tags += 1
        return f"loopback-{self.tags}".encode()

    def plans(self, layout: Layout, staging: Optional[Staging]):
        """(pair, plan, Receive) of every sending pair, each with its own staging slots."""
        out = []
        slot = 0
        for p, d in layout.pairs():
            config = layout.config(p, d)
            if config.action is not Action.SEND:
                continue
            local = replace(self.prefill.memories[p],
                            staging=self.prefill.memories[p].staging + slot,
                            staging_capacity=self.prefill.slot)
            remote = replace(self.peer.memories[d], staging=self.peer.pool[0] + slot,
                             staging_capacity=self.prefill.slot)
            plan = plan_request(config, REQUEST.src_pages, REQUEST.dst_pages,
                                local=local, remote=remote, staging=staging)
            receive = Receive(d, config, tuple(REQUEST.dst_pages), int(plan.staging), slot,
                              self.prefill.slot, self.tag())
            out.append(((p, d), plan, receive))
            slot += self.prefill.slot
        return out

    def mismatches(self, want: List[List[str]]) -> List[Tuple[int, int]]:
        """The (decode rank, buffer) pairs whose bytes differ from the expected ones."""
        got = self.peer.digests()
        return [(d, b) for d, (have_rank, want_rank) in enumerate(zip(got, want))
                for b, (have, wanted) in enumerate(zip(have_rank, want_rank)) if have != wanted]

    def first_wrong_byte(self, layout: Layout, d: int, b: int) -> int:
        data = np.frombuffer(self.peer.fetch(d, b), dtype=np.uint8).copy()
        want = sentinel(d, b, self.decode_capacity)
        if d < layout.d_tp:
            for p in range(layout.p_tp):
                mori_tp.send_kvcache(
                    layout.config(p, d), [self.prefill.memories[p].buffers[b]],
                    [int(want.ctypes.data)], src_capacity=self.prefill.capacity,
                    dst_capacity=self.decode_capacity, src_pages=REQUEST.src_pages,
                    dst_pages=REQUEST.dst_pages, backend="host",
                )
        return first_difference(data.tobytes(), want.tobytes())

    def layout_cases(self, name: str, layout: Layout, seed: int) -> int:
        self.prefill.fill(seed)
        want = expected_digests(layout, self.prefill, self.decode_capacity, self.decode_ranks)
        moved = 0
        for staging in STAGINGS:
            self.peer.reset()
            plans = self.plans(layout, staging)
            for _, plan, receive in plans:
                result = self.driver.send(self.transport, self.remote, plan, receive.tag,
                                          STEP_TIMEOUT)
                if (result.segments, result.bytes) != (plan.segments, plan.bytes):
                    raise Failure(f"{name}: send reported {result} for {plan.segments} segments")
                moved += 1
            self.peer.receive([receive for _, _, receive in plans])
            label = "staging_for" if staging is None else staging.name
            wrong = self.mismatches(want)
            if wrong:
                d, b = wrong[0]
                raise Failure(
                    f"{self.engine} {name} {label}: {len(wrong)} decode buffers differ from "
                    f"send_kvcache's result; decode rank {d} buffer {b} first at byte "
                    f"{self.first_wrong_byte(layout, d, b)}"
                )
            modes = sorted({plan.staging.name for _, plan, _ in plans})
            print(f"  {name:8} {label:11} {len(plans)} sending pairs ({', '.join(modes)}): "
                  "every decode byte as send_kvcache leaves it")
        return moved

    def negative_control(self, staging: Staging) -> None:
        """Drops one segment of one pair and requires the check to fail (for NONE: at the
        dropped segment's first byte)."""
        layout = LAYOUTS["tp2to8"]
        self.prefill.fill(7)
        want = expected_digests(layout, self.prefill, self.decode_capacity, self.decode_ranks)
        self.peer.reset()
        plans = self.plans(layout, staging)
        (p, d), dropped_plan, dropped_receive = plans[0]
        for _, plan, receive in plans:
            # What send() does, with one segment left out of the write.
            plan.pack(backend="host")
            src, dst, lengths = plan.addresses()
            if plan is dropped_plan:
                # The middle segment of the first buffer with several, or the first one.
                drop = len(plan.lengths) // 2
                keep = np.ones(len(lengths), dtype=bool)
                keep[drop] = False
                dropped_at = int(plan.dst_offsets[drop])
                dropped_end = dropped_at + int(plan.lengths[drop])
                src, dst, lengths = src[keep], dst[keep], lengths[keep]
            self.driver.write(self.transport, self.remote, src, dst, lengths, receive.tag,
                              STEP_TIMEOUT)
        self.peer.receive([receive for _, _, receive in plans])
        wrong = self.mismatches(want)
        if not wrong:
            raise Failure(f"{self.engine}: dropping one segment ({staging.name}) went unnoticed")
        if wrong != [(d, 0)]:
            raise Failure(f"{self.engine}: dropping one segment of decode rank {d} buffer 0 "
                          f"({staging.name}) changed the check of {wrong}")
        at = self.first_wrong_byte(layout, d, 0)
        if staging is Staging.NONE and not dropped_at <= at < dropped_end:
            raise Failure(
                f"{self.engine}: first wrong byte {at} is outside the dropped segment "
                f"[{dropped_at}, {dropped_end})"
            )
        print(f"  negative control ({staging.name}): dropping one segment of pair ({p}, {d}) "
              f"fails the check, at decode rank {d} buffer 0 byte {at}")

    def close(self) -> None:
        self.peer.close()


def skip_or_arm(engine: str, total_timeout: int) -> Optional[int]:
    """The exit status when ``engine`` is missing (77 skipped, 1 under MORI_TP_REQUIRE_TOOLS),
    else None after arming an alarm that ends the process after ``total_timeout`` seconds."""
    problem = engine_available(engine)
    if problem:
        if tools_required():
            print(f"FAILED: {problem} (MORI_TP_REQUIRE_TOOLS=1: a missing engine fails)")
            return 1
        print(f"SKIPPED: {problem}")
        return 77
    # A last resort above the per-step timeouts: nothing here may hang the test run.
    signal.signal(signal.SIGALRM, lambda *_: (print(f"FAILED: still running after "
                                                     f"{total_timeout} s", flush=True),
                                               os._exit(124)))
    signal.alarm(total_timeout)
    return None


def main(engine: str) -> int:
    status = skip_or_arm(engine, TOTAL_TIMEOUT)
    if status is not None:
        return status
    start = time.monotonic()
    run = Run(engine)
    try:
        print(f"{engine}: prefill pid {os.getpid()} -> decode child, 127.0.0.1")
        sends = 0
        for seed, (name, layout) in enumerate(LAYOUTS.items()):
            sends += run.layout_cases(name, layout, seed)
        run.negative_control(Staging.NONE)
        run.negative_control(Staging.BOTH)
    except Failure as failure:
        print(f"FAILED: {failure}")
        return 1
    finally:
        run.close()
    print(f"{engine}: {sends} requests moved and verified in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    run_program(lambda: main(sys.argv[1]))
