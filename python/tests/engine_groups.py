"""Two processes on 127.0.0.1 joined by a real transfer engine, moving requests of several
groups of a hybrid model (hybrid.py: HND full-attention KV pages, a sliding window's pages,
DeepSeek V3.2's per-token indexer keys and scales, a Mamba2 conv state slot of three parts and
an SSM state) from a prefill engine of TP 2 and PP 2 (stages of 4 and 2 layers) to a decode
engine of TP 4 and PP 1. This process holds every prefill rank; a child holds every decode
rank. Each (prefill rank, decode rank) request is one GroupsPlan: packed, written as one
engine call (NIXL: with its notification), and unpacked by the child with unpack_groups.
Every byte of every decode buffer must equal what the oracle of hybrid.py leaves in the same
sentinel-filled buffers, untouched bytes included, with the library's staging modes and with a
random mode per group. A negative control drops one group's segments of one request and
requires the check to fail in that group's buffers.

    python3 python/tests/engine_groups.py mooncake|nixl|mori_io

Exit status: 0 passed, 1 failed, 77 skipped (the engine is not installed; with
MORI_TP_REQUIRE_TOOLS=1 that is a failure instead). tests/python.rs runs it under cargo test.
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

import hybrid
import mori_tp
from engine_loopback import skip_or_arm
from hybrid import Hybrid, Part
from mori_tp import Staging
from mori_tp.engines import KvMemory, plan_groups
from mori_tp.engines.loopback import (
    DecodePeer,
    GroupPart,
    ReceiveGroups,
    digest,
    driver,
    run_program,
    sentinel,
)

MODEL = Hybrid()
PREFILL_TP, DECODE_TP = 2, 4
PREFILL_PP = [4, 2]
DECODE_PP = [6]
SETS = ("full", "swa", "indexer", "mamba")
STEP_TIMEOUT = 60.0
#: Below the 300 s that tests/python.rs allows, so that this script reports a hang itself.
TOTAL_TIMEOUT = 240


class Failure(AssertionError):
    pass


def stage_layers(partition: List[int], stage: int) -> List[int]:
    start = sum(partition[:stage])
    return list(range(start, start + partition[stage]))


#: The decode child's buffer sets: one "rank" of DecodePeer per (decode rank, set).
DECODE_LAYERS = stage_layers(DECODE_PP, 0)
DECODE_SHAPES = [MODEL.set_shapes(1, DECODE_TP, DECODE_LAYERS) for _ in range(DECODE_TP)]


def child_rank(d: int, set_name: str) -> int:
    return d * len(SETS) + SETS.index(set_name)


class Prefill:
    """Every prefill rank (stage, TP rank) of the parent: its buffer sets, and a staging pool
    shared by its requests, registered with the transport once."""

    def __init__(self, transport) -> None:
        self.sets: Dict[Tuple[int, int], Dict[str, List[np.ndarray]]] = {}
        self.capacity: Dict[Tuple[int, int], Dict[str, int]] = {}
        for stage in range(len(PREFILL_PP)):
            layers = stage_layers(PREFILL_PP, stage)
            for p in range(PREFILL_TP):
                shapes = MODEL.set_shapes(0, PREFILL_TP, layers)
                self.sets[stage, p] = {name: [np.zeros(size, dtype=np.uint8) for _ in range(count)]
                                       for name, (count, size) in shapes.items()}
                self.capacity[stage, p] = {name: size for name, (_, size) in shapes.items()}
                for name, buffers in self.sets[stage, p].items():
                    if buffers:
                        transport.register(KvMemory(tuple(int(b.ctypes.data) for b in buffers),
                                                    self.capacity[stage, p][name]))
        self.pool = np.zeros(1 << 20, dtype=np.uint8)
        transport.register(KvMemory((), 0, int(self.pool.ctypes.data), self.pool.nbytes))

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for sets in self.sets.values():
            for buffers in sets.values():
                for data in buffers:
                    data[:] = rng.integers(0, 256, data.nbytes, dtype=np.uint8)

    def ptrs(self, stage: int, p: int) -> Dict[str, List[int]]:
        return {name: [int(b.ctypes.data) for b in buffers]
                for name, buffers in self.sets[stage, p].items()}


def decode_initial() -> Dict[int, Dict[str, List[bytearray]]]:
    """Every decode buffer as the child starts it (DecodePeer's sentinel bytes)."""
    out = {}
    for d, shapes in enumerate(DECODE_SHAPES):
        out[d] = {name: [bytearray(sentinel(child_rank(d, name), b, size).tobytes())
                         for b in range(count)] for name, (count, size) in shapes.items()}
    return out


class Run:
    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.driver = driver(engine)
        self.transport = self.driver.start("prefill")
        self.prefill = Prefill(self.transport)
        ranks = [(count, size) for shapes in DECODE_SHAPES for name in SETS
                 for count, size in [shapes[name]]]
        self.peer = DecodePeer(engine, ranks, 1 << 20, STEP_TIMEOUT)
        self.remote = self.driver.connect(self.transport, self.peer.address)
        self.peer.connect(self.driver.sender(self.transport))
        self.tags = 0

    def decode_ptrs(self, d: int) -> Dict[str, List[int]]:
        return {name: list(self.peer.memories[child_rank(d, name)].buffers) for name in SETS}

    def decode_capacity(self, d: int) -> Dict[str, int]:
        return {name: self.peer.memories[child_rank(d, name)].capacity for name in SETS}

    def requests(self, pages, staging) -> List[Tuple[Tuple[int, int, int], List[Part], list]]:
        """Every (stage, prefill rank, decode rank) request: its parts and its groups."""
        out = []
        for stage in range(len(PREFILL_PP)):
            shared = mori_tp.pp_layers(PREFILL_PP, DECODE_PP, stage, 0)
            layers = [layer for layer, _, _ in shared.layers()]
            for p in range(PREFILL_TP):
                for d in range(DECODE_TP):
                    parts = MODEL.parts(pages, PREFILL_TP, p, layers, DECODE_TP, d,
                                        DECODE_LAYERS)
                    groups = hybrid.groups(parts, self.prefill.ptrs(stage, p), self.decode_ptrs(d),
                                           self.prefill.capacity[stage, p], self.decode_capacity(d),
                                           staging)
                    out.append(((stage, p, d), parts, groups))
        return out

    def expected(self, requests) -> Dict[int, Dict[str, List[bytearray]]]:
        want = decode_initial()
        for (stage, p, d), parts, _ in requests:
            src = {name: [b.tobytes() for b in buffers]
                   for name, buffers in self.prefill.sets[stage, p].items()}
            hybrid.oracle(parts, src, want[d])
        return want

    def mismatches(self, want) -> List[Tuple[int, str, int]]:
        got = self.peer.digests()
        out = []
        for d in range(DECODE_TP):
            for name in SETS:
                for b, data in enumerate(want[d][name]):
                    if got[child_rank(d, name)][b] != digest(data):
                        out.append((d, name, b))
        return out

    def move(self, seed: int, staging, label: str, drop: Optional[Tuple[int, int]] = None) -> list:
        """Every request of the model through the engine; ``drop`` = (request, group) leaves
        that group's segments out of that request's write. Returns the mismatches."""
        self.prefill.fill(seed)
        self.peer.reset()
        pages = MODEL.request_pages(seed)
        requests = self.requests(pages, staging)
        want = self.expected(requests)
        slot = 0
        receives = []
        segments = 0
        for index, (_, parts, groups) in enumerate(requests):
            _, total = mori_tp.groups_info(groups)
            plan = plan_groups(groups, local_staging=int(self.prefill.pool.ctypes.data) + slot,
                               local_staging_capacity=total.src_staging_bytes,
                               remote_staging=self.peer.pool[0] + slot,
                               remote_staging_capacity=total.dst_staging_bytes)
            tag = f"groups-{self.tags}".encode()
            self.tags += 1
            if drop is not None and drop[0] == index:
                plan.pack(backend="host")
                src, dst, lengths = plan.addresses()
                keep = np.ones(len(lengths), dtype=bool)
                at = 0
                for g, (group, info) in enumerate(zip(plan.groups, plan.infos)):
                    count = info.num_segments * group.num_buffers
                    if g == drop[1]:
                        keep[at:at + count] = False
                    at += count
                self.driver.write(self.transport, self.remote, src[keep], dst[keep], lengths[keep],
                                  tag, STEP_TIMEOUT)
            else:
                result = self.driver.send(self.transport, self.remote, plan, tag, STEP_TIMEOUT)
                if (result.segments, result.bytes) != (plan.segments, plan.bytes):
                    raise Failure(f"send reported {result} for {plan.segments} segments")
            segments += plan.segments
            d = requests[index][0][2]
            receives.append(ReceiveGroups(
                tuple(GroupPart(child_rank(d, part.set), tuple(part.dst_buffers), group.config,
                                group.request, int(group.staging), group.first_token)
                      for part, group in zip(parts, groups)),
                slot, total.dst_staging_bytes, tag))
            slot += max(total.src_staging_bytes, total.dst_staging_bytes)
            if slot > self.prefill.pool.nbytes:
                raise Failure(f"the requests need more than the {self.prefill.pool.nbytes}-byte "
                              "staging pools")
        self.peer.receive(receives)
        wrong = self.mismatches(want)
        if drop is None:
            modes = sorted({Staging(g.staging).name for _, _, groups in requests for g in groups})
            if wrong:
                raise Failure(f"{self.engine} {label}: decode buffers {wrong[:6]} (of "
                              f"{len(wrong)}) differ from the oracle's")
            groups = sum(len(request[2]) for request in requests)
            print(f"  {label:23} {len(requests)} requests, {groups} groups ({', '.join(modes)}), "
                  f"{segments} segments: every decode byte as the oracle leaves it")
        return wrong

    def close(self) -> None:
        self.peer.close()


def main(engine: str) -> int:
    status = skip_or_arm(engine, TOTAL_TIMEOUT)
    if status is not None:
        return status
    start = time.monotonic()
    run = Run(engine)
    try:
        print(f"{engine}: prefill TP {PREFILL_TP} PP {PREFILL_PP} (pid {os.getpid()}) -> decode "
              f"TP {DECODE_TP} PP {DECODE_PP}, 127.0.0.1")
        run.move(11, None, "library's modes")
        rng = random.Random(12)
        # Each request's groups are made once, for its plan and for the child's unpack alike.
        run.move(12, lambda i, config: rng.choice(list(Staging)), "a random mode per group")
        # Negative control: leave out the conv state's B part of the request from prefill
        # rank (stage 0, TP rank 0) to decode rank 0, whose B it sends (one group, replicated).
        requests = run.requests(MODEL.request_pages(13), None)
        index = next(i for i, ((s, p, d), _, _) in enumerate(requests) if (s, p, d) == (0, 0, 0))
        parts = requests[index][1]
        group = next(g for g, part in enumerate(parts) if part.name.startswith("conv B"))
        wrong = run.move(13, None, "negative control", drop=(index, group))
        expected_set = parts[group].set
        if not wrong:
            raise Failure(f"{engine}: dropping the segments of {parts[group].name} went unnoticed")
        if any((d, name) != (0, expected_set) for d, name, _ in wrong):
            raise Failure(f"{engine}: dropping {parts[group].name} of decode rank 0 changed the "
                          f"check of {wrong}")
        print(f"  negative control: dropping {parts[group].name} of request (stage 0, rank 0) -> "
              f"decode rank 0 fails the check, in {len(wrong)} of its {expected_set} buffers")
    except Failure as failure:
        print(f"FAILED: {failure}")
        return 1
    finally:
        run.close()
    print(f"{engine}: requests of several groups moved and verified in "
          f"{time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    run_program(lambda: main(sys.argv[1]))
