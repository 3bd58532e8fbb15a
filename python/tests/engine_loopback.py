"""Two processes on 127.0.0.1 joined by a real transfer engine: this one holds every prefill
rank of a layout and writes (the initiator), a child holds every decode rank (the target).

Slice configs: for each layout (tp2to8, tp8to2, tp4to8 and the non-integer H=12 P6->D4; page
size 16; fragmented pages; three layers, K and V) and each staging choice (staging_for's, NONE,
SRC, DST, BOTH), every sending pair moves its request through the engine, the child unpacks the
staged ones, and every byte of every decode buffer must equal what mori_tp_kvcache_send (host
backend) leaves in a copy of the same sentinel-filled buffers, bytes outside the slices
included. A negative control drops one segment and requires the check to fail, at that segment.

Pair configs (any page layout): HND to HND with 4 and 8 KV heads (TP 2->8, 8->2), NHD to HND,
page size 16 -> 64 and 64 -> 16, and a partial last page, each with pair_staging_for's choice
and NONE (the partial page in every mode), checked against mori_tp_pair_send the same way;
each case has a negative control (one dropped segment, or a plan made for a decode layout the
decode rank does not have) that must fail the check.

    python3 python/tests/engine_loopback.py mooncake|nixl|mori_io

Exit status: 0 passed, 1 failed, 77 skipped (the engine is not installed; with
MORI_TP_REQUIRE_TOOLS=1 that is a failure instead). tests/python.rs runs it under cargo test.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

import mori_tp
import pair_oracle
from layouts import Layout, fragmented_request, tools_required
from mori_tp import Action, Staging
from mori_tp.engines import KvMemory, RequestPlan, plan_request
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
from pair_oracle import Deployment

BUFFERS = 6  # K and V of three layers
#: None: staging_for's choice; then every mode forced.
STAGINGS: Tuple[Optional[Staging], ...] = (None, Staging.NONE, Staging.SRC, Staging.DST,
                                           Staging.BOTH)
#: Pair cases move with the library's choice and pages to pages (the composition law of the
#: other modes is in test_pair.py), except the partial page, which moves in every mode.
PAIR_STAGINGS: Tuple[Optional[Staging], ...] = (None, Staging.NONE)
REQUEST = fragmented_request(seed=2024, runs=5)
STEP_TIMEOUT = 60.0
#: Below the 300 s that tests/python.rs allows, so that this script reports a hang itself.
TOTAL_TIMEOUT = 240


class Failure(AssertionError):
    pass


class SliceCase:
    """A layout of uniform slice configs: whole token-major pages of one size (REQUEST)."""

    stagings = STAGINGS

    def __init__(self, name: str, layout: Layout) -> None:
        self.name, self.layout = name, layout
        self.p_tp, self.d_tp = layout.p_tp, layout.d_tp
        self.src_capacity = REQUEST.src_capacity_pages * layout.src_item_len
        self.dst_capacity = REQUEST.dst_capacity_pages * layout.dst_item_len

    def pairs(self):
        return self.layout.pairs()

    def config(self, p: int, d: int) -> Any:
        return self.layout.config(p, d)

    def staging_bytes(self, config: Any) -> int:
        return BUFFERS * mori_tp.staging_len(config, len(REQUEST.src_pages))

    def plan(self, config: Any, local: KvMemory, remote: KvMemory,
             staging: Optional[Staging]) -> RequestPlan:
        return plan_request(config, REQUEST.src_pages, REQUEST.dst_pages, local=local,
                            remote=remote, staging=staging)

    def receive_request(self) -> Any:
        return tuple(REQUEST.dst_pages)

    def send(self, config: Any, src: Sequence[int], dst: Sequence[int], src_capacity: int,
             dst_capacity: int) -> None:
        mori_tp.send_kvcache(config, src, dst, src_capacity=src_capacity,
                             dst_capacity=dst_capacity, src_pages=REQUEST.src_pages,
                             dst_pages=REQUEST.dst_pages, backend="host")


class PairCase(SliceCase):
    """A deployment of pair configs: its own layouts, page sizes and request of tokens."""

    def __init__(self, name: str, deployment: Deployment, tokens: int, seed: int,
                 negative: str, stagings: Tuple[Optional[Staging], ...] = PAIR_STAGINGS) -> None:
        self.name, self.deployment, self.negative = name, deployment, negative
        self.stagings = stagings
        self.p_tp, self.d_tp = deployment.p_tp, deployment.d_tp
        self.pages = deployment.request(tokens, seed)
        self.request = self.pages.api()
        prefill, decode = deployment.layouts(0, 0, self.pages)
        self.src_capacity = pair_oracle.capacity(prefill, self.pages.src_capacity_pages)
        self.dst_capacity = pair_oracle.capacity(decode, self.pages.dst_capacity_pages)

    def pairs(self):
        return self.deployment.pairs()

    def config(self, p: int, d: int) -> Any:
        return mori_tp.pair_config(*self.deployment.layouts(p, d, self.pages))

    def staging_bytes(self, config: Any) -> int:
        return BUFFERS * mori_tp.pair_staging_len(config, self.request.num_tokens)

    def plan(self, config: Any, local: KvMemory, remote: KvMemory,
             staging: Optional[Staging]) -> RequestPlan:
        return plan_request(config, self.request, local=local, remote=remote, staging=staging)

    def receive_request(self) -> Any:
        return self.request

    def send(self, config: Any, src: Sequence[int], dst: Sequence[int], src_capacity: int,
             dst_capacity: int) -> None:
        mori_tp.send_kvcache_pair(config, src, dst, src_capacity=src_capacity,
                                  dst_capacity=dst_capacity, request=self.request,
                                  backend="host")

    def misread(self) -> "PairCase":
        """The same request planned for a decode layout of the other kind (HND for NHD and the
        reverse): what a prefill rank does with a wrong handshake."""
        kind = "nhd" if self.deployment.dst_kind == "hnd" else "hnd"
        wrong = PairCase(self.name, replace(self.deployment, dst_kind=kind), 0, 0, "")
        wrong.pages, wrong.request = self.pages, self.request
        return wrong


CASES: List[SliceCase] = [
    SliceCase("tp2to8", Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=32)),
    SliceCase("tp8to2", Layout(heads=4, p_tp=8, d_tp=2, page_size=16, bytes_per_head=32)),
    SliceCase("tp4to8", Layout(heads=8, p_tp=4, d_tp=8, page_size=16, bytes_per_head=32)),
    SliceCase("h12p6d4", Layout(heads=12, p_tp=6, d_tp=4, page_size=16, bytes_per_head=32)),
    PairCase("hnd 2to8", Deployment("", 4, 2, 8, "hnd", 16, "hnd", 16, 32), 192, 1, "drop"),
    PairCase("hnd 8to2", Deployment("", 8, 8, 2, "hnd", 16, "hnd", 16, 32), 192, 2, "layout"),
    PairCase("nhd>hnd", Deployment("", 8, 2, 4, "nhd", 16, "hnd", 16, 32), 192, 3, "layout"),
    PairCase("16to64", Deployment("", 8, 4, 8, "hnd", 16, "hnd", 64, 32), 256, 4, "drop"),
    PairCase("64to16", Deployment("", 8, 8, 4, "nhd", 64, "nhd", 16, 32), 256, 5, "drop"),
    PairCase("partial", Deployment("", 4, 2, 4, "hnd", 16, "nhd", 64, 32), 173, 6, "drop",
             STAGINGS),
]

#: The uniform cases by name (the pipelined and streamed tests take theirs from here).
LAYOUTS = {case.name: case for case in CASES if not isinstance(case, PairCase)}


def prefill_buffers() -> Tuple[int, List[List["np.ndarray"]]]:
    """(capacity, buffers per rank) for every prefill rank of every case."""
    ranks = max(case.p_tp for case in CASES)
    capacity = max(case.src_capacity for case in CASES)
    return capacity, [[np.zeros(capacity, dtype=np.uint8) for _ in range(BUFFERS)]
                      for _ in range(ranks)]


def decode_shape() -> Tuple[int, int]:
    """(capacity of each buffer, ranks) the decode child holds for every case."""
    return (max(case.dst_capacity for case in CASES), max(case.d_tp for case in CASES))


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


def sending(case: SliceCase) -> List[Tuple[Tuple[int, int], Any]]:
    """((p, d), config) of every pair of ``case`` that sends."""
    configs = ((pair, case.config(*pair)) for pair in case.pairs())
    return [(pair, config) for pair, config in configs if config.action is Action.SEND]


def slot_len() -> int:
    """The most staging bytes any pair's request needs (BUFFERS x staging_len)."""
    return max(case.staging_bytes(config) for case in CASES for _, config in sending(case))


def max_pairs() -> int:
    return max(len(sending(case)) for case in CASES)


def expected_buffers(case: SliceCase, prefill: Prefill, decode_capacity: int, d: int,
                     buffers: Sequence[int]) -> List["np.ndarray"]:
    """Decode rank ``d``'s ``buffers`` after one host send per pair of ``case``."""
    want = [sentinel(d, b, decode_capacity) for b in buffers]
    if d < case.d_tp:
        for p in range(case.p_tp):
            case.send(case.config(p, d), [prefill.memories[p].buffers[b] for b in buffers],
                      [int(w.ctypes.data) for w in want], prefill.capacity, decode_capacity)
    return want


def expected_digests(case: SliceCase, prefill: Prefill, decode_capacity: int,
                     decode_ranks: int) -> List[List[str]]:
    """Every decode buffer after one host send per pair."""
    return [[digest(w) for w in expected_buffers(case, prefill, decode_capacity, d,
                                                 range(BUFFERS))]
            for d in range(decode_ranks)]


class Run:
    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.driver = driver(engine)
        self.transport = self.driver.start("prefill")
        self.prefill = Prefill(self.transport)
        self.decode_capacity, self.decode_ranks = decode_shape()
        self.peer = DecodePeer(engine, [(BUFFERS, self.decode_capacity)] * self.decode_ranks,
                               self.prefill.slot * max_pairs(), STEP_TIMEOUT)
        # With the child's registration epoch: every plan is checked against it.
        self.remote = self.driver.connect(self.transport, self.peer.address,
                                          self.peer.memories[0].epoch)
        self.peer.connect(self.driver.sender(self.transport))
        self.tags = 0

    def tag(self) -> bytes:
        self.tags += 1
        return f"loopback-{self.tags}".encode()

    def plans(self, case: SliceCase, staging: Optional[Staging]):
        """(pair, plan, Receive) of every sending pair, each with its own staging slots."""
        out = []
        slot = 0
        for (p, d), config in sending(case):
            local = replace(self.prefill.memories[p],
                            staging=self.prefill.memories[p].staging + slot,
                            staging_capacity=self.prefill.slot)
            remote = replace(self.peer.memories[d], staging=self.peer.pool[0] + slot,
                             staging_capacity=self.prefill.slot)
            plan = case.plan(config, local, remote, staging)
            receive = Receive(d, config, case.receive_request(), int(plan.staging), slot,
                              self.prefill.slot, self.tag())
            out.append(((p, d), plan, receive))
            slot += self.prefill.slot
        return out

    def mismatches(self, want: List[List[str]]) -> List[Tuple[int, int]]:
        """The (decode rank, buffer) pairs whose bytes differ from the expected ones."""
        got = self.peer.digests()
        return [(d, b) for d, (have_rank, want_rank) in enumerate(zip(got, want))
                for b, (have, wanted) in enumerate(zip(have_rank, want_rank)) if have != wanted]

    def first_wrong_byte(self, case: SliceCase, d: int, b: int) -> int:
        data = self.peer.fetch(d, b)
        want = expected_buffers(case, self.prefill, self.decode_capacity, d, [b])[0]
        return first_difference(data, want.tobytes())

    def layout_cases(self, seed: int, case: SliceCase) -> int:
        self.prefill.fill(seed)
        want = expected_digests(case, self.prefill, self.decode_capacity, self.decode_ranks)
        moved = 0
        for staging in case.stagings:
            self.peer.reset()
            plans = self.plans(case, staging)
            for _, plan, receive in plans:
                result = self.driver.send(self.transport, self.remote, plan, receive.tag,
                                          STEP_TIMEOUT)
                if (result.segments, result.bytes) != (plan.segments, plan.bytes):
                    raise Failure(f"{case.name}: send reported {result} for {plan.segments} "
                                  "segments")
                moved += 1
            self.peer.receive([receive for _, _, receive in plans])
            label = "staging_for" if staging is None else staging.name
            wrong = self.mismatches(want)
            if wrong:
                d, b = wrong[0]
                raise Failure(
                    f"{self.engine} {case.name} {label}: {len(wrong)} decode buffers differ "
                    f"from the host send's result; decode rank {d} buffer {b} first at byte "
                    f"{self.first_wrong_byte(case, d, b)}"
                )
            modes = sorted({plan.staging.name for _, plan, _ in plans})
            segments = sum(plan.segments for _, plan, _ in plans)
            print(f"  {case.name:8} {label:11} {len(plans)} sending pairs ({', '.join(modes)}), "
                  f"{segments} segments: every decode byte as the host send leaves it")
        return moved

    def negative_control(self, case: SliceCase, staging: Staging) -> None:
        """Drops one segment of one pair and requires the check to fail (for NONE: at the
        dropped segment's first byte)."""
        self.prefill.fill(7)
        want = expected_digests(case, self.prefill, self.decode_capacity, self.decode_ranks)
        self.peer.reset()
        plans = self.plans(case, staging)
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
            raise Failure(f"{self.engine} {case.name}: dropping one segment ({staging.name}) "
                          "went unnoticed")
        if wrong != [(d, 0)]:
            raise Failure(f"{self.engine} {case.name}: dropping one segment of decode rank {d} "
                          f"buffer 0 ({staging.name}) changed the check of {wrong}")
        at = self.first_wrong_byte(case, d, 0)
        if staging is Staging.NONE and not dropped_at <= at < dropped_end:
            raise Failure(
                f"{self.engine} {case.name}: first wrong byte {at} is outside the dropped "
                f"segment [{dropped_at}, {dropped_end})"
            )
        print(f"  {case.name:8} negative control ({staging.name}): dropping one segment of pair "
              f"({p}, {d}) fails the check, at decode rank {d} buffer 0 byte {at}")

    def wrong_layout_control(self, case: PairCase) -> None:
        """Every pair planned for a decode layout of the other kind must fail the check."""
        self.prefill.fill(8)
        want = expected_digests(case, self.prefill, self.decode_capacity, self.decode_ranks)
        self.peer.reset()
        wrong_case = case.misread()
        plans = self.plans(wrong_case, Staging.NONE)
        for _, plan, receive in plans:
            self.driver.send(self.transport, self.remote, plan, receive.tag, STEP_TIMEOUT)
        self.peer.receive([receive for _, _, receive in plans])
        wrong = self.mismatches(want)
        if not wrong:
            raise Failure(f"{self.engine} {case.name}: a plan for decode layout "
                          f"{wrong_case.deployment.dst_kind} went unnoticed")
        print(f"  {case.name:8} negative control: planned for a {wrong_case.deployment.dst_kind} "
              f"decode layout, {len(wrong)} decode buffers fail the check")

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
        for seed, case in enumerate(CASES):
            sends += run.layout_cases(seed, case)
        run.negative_control(CASES[0], Staging.NONE)
        run.negative_control(CASES[0], Staging.BOTH)
        for case in CASES:
            if isinstance(case, PairCase) and case.negative == "drop":
                run.negative_control(case, mori_tp.pair_staging_for(case.config(0, 0)))
            elif isinstance(case, PairCase):
                run.wrong_layout_control(case)
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
