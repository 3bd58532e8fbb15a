"""Moves one request between two processes through a real transfer engine, three ways, and
checks every byte::

    python -m mori_tp.demo --engine mooncake        # or --engine nixl

This process is a prefill rank (the initiator); a child process is the decode rank (the
target), both on 127.0.0.1. The request (page size 16, fragmented pages, K and V of every
layer) goes from prefill rank ``p`` to decode rank ``d``:

- ``per-token``: one segment per token per buffer, as today's connectors build them;
- ``direct``: mori-tp's segments without staging (:func:`mori_tp.plan_segments`);
- ``staged``: mori-tp's staging (:func:`mori_tp.staging_for`): pack, few segments, unpack.

After each, the decode buffers must equal what :func:`mori_tp.send_kvcache` (host backend)
produces from the same source bytes, bytes outside the slice included. Time is measured from
the first pack or write until the decode rank has unpacked, after one untimed small write and
one untimed staged request (a first use of the engine and of the staging regions costs tens of
milliseconds once per process). Needs numpy and the chosen engine
(see ``mori_tp.engines.mooncake`` and ``mori_tp.engines.nixl``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

import mori_tp
from mori_tp import Staging
from mori_tp.engines import KvMemory, RequestPlan, plan_request
from mori_tp.engines.loopback import (
    ENGINES,
    DecodePeer,
    Receive,
    digest,
    driver,
    engine_available,
    first_difference,
    run_program,
    sentinel,
)

#: Named layouts: (KV heads, prefill TP, decode TP, what it stands for).
LAYOUTS: Dict[str, Tuple[int, int, int, str]] = {
    "tp2to8": (4, 2, 8, "Qwen2.5-7B-like, 4 KV heads"),
    "tp8to2": (8, 8, 2, "Llama-3.1-70B-like, 8 KV heads"),
    "tp4to8": (8, 4, 8, "Llama-3.1-70B-like, 8 KV heads"),
    "h12p6d4": (12, 6, 4, "12 KV heads, a non-integer TP ratio"),
}

METHODS = ("per-token", "direct", "staged")
#: Also accepted by Demo.run: staged with BOTH sides, whatever staging_for says.
BOTH = "staged-both"


@dataclass(frozen=True)
class Setup:
    layout: str
    tokens: int
    layers: int
    page_size: int
    head_bytes: int
    pair: Tuple[int, int]
    seed: int = 1

    @property
    def heads(self) -> int:
        return LAYOUTS[self.layout][0]

    @property
    def prefill_tp(self) -> int:
        return LAYOUTS[self.layout][1]

    @property
    def decode_tp(self) -> int:
        return LAYOUTS[self.layout][2]

    def bytes_per_token(self, tp: int) -> int:
        return max(1, self.heads // tp) * self.head_bytes

    def config(self) -> mori_tp.SliceConfig:
        return mori_tp.slice_config(
            prefill_tp_size=self.prefill_tp, prefill_tp_rank=self.pair[0],
            decode_tp_size=self.decode_tp, decode_tp_rank=self.pair[1],
            total_kv_heads=self.heads, page_size=self.page_size,
            src_item_len=self.page_size * self.bytes_per_token(self.prefill_tp),
            dst_item_len=self.page_size * self.bytes_per_token(self.decode_tp),
        )


def first_sender(layout: str, decode_rank: int = 0) -> Tuple[int, int]:
    """The lowest prefill rank that sends to ``decode_rank``."""
    heads, prefill_tp, decode_tp, _ = LAYOUTS[layout]
    for p in range(prefill_tp):
        config = mori_tp.slice_config(
            prefill_tp_size=prefill_tp, prefill_tp_rank=p, decode_tp_size=decode_tp,
            decode_tp_rank=decode_rank, total_kv_heads=heads, page_size=1,
            src_item_len=max(1, heads // prefill_tp), dst_item_len=max(1, heads // decode_tp),
        )
        if config.action is mori_tp.Action.SEND:
            return p, decode_rank
    raise ValueError(f"{layout}: no prefill rank sends to decode rank {decode_rank}")


def fragmented_pages(pages: int, seed: int) -> Tuple[List[int], List[int], int, int]:
    """``pages`` page pairs in runs of 1-16 pages, the runs shuffled and spaced apart
    independently on each side; returns both lists and each side's capacity in pages."""
    rng = random.Random(seed)
    runs = []
    while sum(runs) < pages:
        runs.append(min(rng.randint(1, 16), pages - sum(runs)))

    def lay_out() -> Tuple[List[int], int]:
        order = list(range(len(runs)))
        rng.shuffle(order)
        starts = [0] * len(runs)
        position = 0
        for run in order:
            position += rng.randint(0, 3)
            starts[run] = position
            position += runs[run]
        out = []
        for run, length in enumerate(runs):
            out.extend(range(starts[run], starts[run] + length))
        return out, position + 1

    src, src_capacity = lay_out()
    dst, dst_capacity = lay_out()
    return src, dst, src_capacity, dst_capacity


def per_token_segments(config: mori_tp.SliceConfig, src_pages: Sequence[int],
                       dst_pages: Sequence[int]) -> Tuple["np.ndarray", "np.ndarray", "np.ndarray"]:
    """One buffer's per-token list, as connectors build it today: for each page pair and token
    slot, ``page * item_len + slot * bytes_per_token + head_slice_offset`` on each side."""
    slots = np.arange(config.page_size, dtype=np.uint64)
    src = (np.asarray(src_pages, dtype=np.uint64)[:, None] * np.uint64(config.src_item_len)
           + slots * np.uint64(config.bytes_per_token_src)
           + np.uint64(config.src_head_slice_offset)).ravel()
    dst = (np.asarray(dst_pages, dtype=np.uint64)[:, None] * np.uint64(config.dst_item_len)
           + slots * np.uint64(config.bytes_per_token_dst)
           + np.uint64(config.dst_head_slice_offset)).ravel()
    sizes = np.full(len(src), config.heads_bytes_per_token_to_send, dtype=np.uint64)
    return src, dst, sizes


@dataclass
class Row:
    method: str
    staging: str
    segments: int
    bytes: int
    calls: int
    seconds: List[float]
    pack: float
    write: float
    unpack: float

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


class Demo:
    """One prefill process with its engine and a decode child, ready to move ``setup``'s
    request repeatedly."""

    def __init__(self, engine: str, setup: Setup, timeout: float = 120.0,
                 staging: Optional[Staging] = None) -> None:
        self.engine = engine
        self.setup = setup
        self.timeout = timeout
        self.config = setup.config()
        #: The staging of the "staged" method: staging_for's unless chosen.
        self.staged_with = mori_tp.staging_for(self.config) if staging is None else staging
        if self.config.action is not mori_tp.Action.SEND:
            raise ValueError(f"{setup.layout}: pair {setup.pair} is {self.config.action.name}, "
                             "not SEND")
        self.src_pages, self.dst_pages, src_cap, dst_cap = fragmented_pages(
            -(-setup.tokens // setup.page_size), setup.seed)
        self.num_buffers = 2 * setup.layers
        self.src_capacity = src_cap * self.config.src_item_len
        self.dst_capacity = dst_cap * self.config.dst_item_len
        self.staging_bytes = self.num_buffers * mori_tp.staging_len(self.config,
                                                                    len(self.src_pages))
        #: Bytes of one decode page, to locate a wrong byte.
        self.dst_page_bytes = self.config.dst_item_len
        self._connect(setup.seed)

    def _connect(self, seed: int) -> None:
        """Source buffers of random bytes and a staging region, this process's engine and the
        decode child; then the expected decode bytes and the warm-up."""
        rng = np.random.default_rng(seed)
        self.sources = [rng.integers(0, 256, self.src_capacity, dtype=np.uint8)
                        for _ in range(self.num_buffers)]
        self.staging = np.zeros(max(self.staging_bytes, 1), dtype=np.uint8)
        self.local = KvMemory(tuple(int(s.ctypes.data) for s in self.sources), self.src_capacity,
                              int(self.staging.ctypes.data), self.staging_bytes)
        self._tags = 0
        self.driver = driver(self.engine)
        self.transport = self.driver.start("prefill")
        self.transport.register(self.local)
        self.peer_process = DecodePeer(self.engine, [(self.num_buffers, self.dst_capacity)],
                                       self.staging_bytes, self.timeout)
        try:
            self.remote = self.peer_process.memories[0]
            self.peer = self.driver.connect(self.transport, self.peer_process.address)
            self.peer_process.connect(self.driver.sender(self.transport))
            self.expected = self._expected()
            self._warm_up()
        except BaseException:
            self.peer_process.close()
            raise

    #: The method _warm_up runs once, untimed.
    warm_method = "staged"

    def expected_for(self, method: str) -> List[bytes]:
        """What the decode buffers must hold after ``method``."""
        return self.expected

    def _expected(self) -> Any:
        """What the decode buffers must hold: sentinel bytes, then one send_kvcache."""
        want = [sentinel(0, b, self.dst_capacity) for b in range(self.num_buffers)]
        mori_tp.send_kvcache(
            self.config, self.local.buffers, [int(w.ctypes.data) for w in want],
            src_capacity=self.src_capacity, dst_capacity=self.dst_capacity,
            src_pages=self.src_pages, dst_pages=self.dst_pages, backend="host",
        )
        return [w.tobytes() for w in want]

    def _warm_up(self) -> None:
        """One small write, then one untimed staged request: no method pays for the engine's
        connection setup or for the first use of the staging regions (page faults, the
        engine's first look at a memory range), which a connector pays once per process."""
        tag = self._tag()
        one = np.ones(1, dtype=np.uint64)
        self.driver.write(self.transport, self.peer, one * np.uint64(self.local.buffers[0]),
                          one * np.uint64(self.remote.buffers[0]), one, tag, self.timeout)
        self.peer_process.receive([Receive(0, self.config, self.receive_request(), 0, 0, 0,
                                           tag)])
        self.run(self.warm_method)

    def close(self) -> None:
        self.peer_process.close()

    def _tag(self) -> bytes:
        self._tags += 1
        return f"demo-{self._tags}".encode()

    def receive_request(self) -> Any:
        """What the decode rank's unpack_request takes for this request."""
        return tuple(self.dst_pages)

    def per_token(self) -> Tuple["np.ndarray", "np.ndarray", "np.ndarray"]:
        """One buffer's per-token list."""
        return per_token_segments(self.config, self.src_pages, self.dst_pages)

    def plan(self, method: str) -> RequestPlan:
        """The plan of a mori-tp ``method``."""
        chosen = {"direct": Staging.NONE, "staged": self.staged_with, BOTH: Staging.BOTH}[method]
        return plan_request(self.config, self.src_pages, self.dst_pages, local=self.local,
                            remote=self.remote, staging=chosen)

    def run(self, method: str) -> Tuple[float, int, int, int, str, float, float, float]:
        """Moves the request once with ``method``; checks every byte; returns (seconds,
        segments, bytes, calls, staging, pack, write, unpack)."""
        self.peer_process.reset()
        tag = self._tag()
        timeout = self.timeout
        start = time.perf_counter()
        if method == "per-token":
            local, remote, sizes = self.per_token()
            src_bases = np.asarray(self.local.buffers, dtype=np.uint64)[:, None]
            dst_bases = np.asarray(self.remote.buffers, dtype=np.uint64)[:, None]
            src = (src_bases + local).ravel()
            dst = (dst_bases + remote).ravel()
            lengths = np.tile(sizes, self.num_buffers)
            write_start = time.perf_counter()
            calls = self.driver.write(self.transport, self.peer, src, dst, lengths, tag, timeout)
            write = time.perf_counter() - write_start
            staging, pack, segments, moved = None, 0.0, len(lengths), int(lengths.sum())
            receive = Receive(0, self.config, self.receive_request(), Staging.NONE, 0, 0, tag)
        else:
            plan = self.plan(method)
            result = self.driver.send(self.transport, self.peer, plan, tag, timeout)
            staging, pack, write = result.staging, result.pack_seconds, result.write_seconds
            segments, moved, calls = result.segments, result.bytes, result.calls
            slot_len = self.staging_bytes if staging.unpacks else 0
            receive = Receive(0, plan.config, self.receive_request(), int(staging), 0,
                              slot_len, tag)
        unpack = self.peer_process.receive([receive])
        seconds = time.perf_counter() - start
        self.verify(method)
        return (seconds, segments, moved, calls, staging.name if staging is not None else "-",
                pack, write, unpack)

    def verify(self, method: str) -> None:
        got = self.peer_process.digests()[0]
        for b, (have, want) in enumerate(zip(got, self.expected_for(method))):
            if have != digest(want):
                data = self.peer_process.fetch(0, b)
                at = first_difference(data, want)
                item = self.dst_page_bytes
                raise AssertionError(
                    f"{self.engine} {method}: decode buffer {b} differs from send_kvcache's "
                    f"result first at byte {at} (page {at // item}, byte {at % item} of it)"
                )

    def measure(self, method: str, repeat: int, budget: float = float("inf")) -> Row:
        """Runs ``method`` up to ``repeat`` times (fewer once the runs took ``budget``
        seconds); the fastest run counts."""
        runs = []
        start = time.monotonic()
        while len(runs) < repeat and (not runs or time.monotonic() - start < budget):
            runs.append(self.run(method))
        fastest = min(runs)
        return Row(method, fastest[4], fastest[1], fastest[2], fastest[3],
                   [r[0] for r in runs], fastest[5], fastest[6], fastest[7])


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms"


def describe(engine: str, demo: Demo) -> str:
    s, c = demo.setup, demo.config
    heads, p_tp, d_tp, what = LAYOUTS[s.layout]
    return (
        f"engine {engine} on 127.0.0.1; layout {s.layout} ({what}): prefill TP {p_tp} -> "
        f"decode TP {d_tp}, pair prefill {s.pair[0]} -> decode {s.pair[1]}\n"
        f"request: {len(demo.src_pages) * s.page_size} tokens in {len(demo.src_pages)} "
        f"fragmented pages of {s.page_size}, {s.layers} layers ({demo.num_buffers} buffers)\n"
        f"slice: {c.heads_bytes_per_token_to_send} B of a {c.bytes_per_token_src} B prefill "
        f"token into a {c.bytes_per_token_dst} B decode token; staging_for: "
        f"{mori_tp.staging_for(c).name}, staged method: {demo.staged_with.name}"
    )


def table(rows: Sequence[Row]) -> str:
    base = rows[0]
    lines = [f"{'method':<10} {'staging':<8} {'segments':>9} {'bytes':>10} {'calls':>6} "
             f"{'time':>10} {'pack':>8} {'write':>9} {'unpack':>8} {'GB/s':>7} "
             f"{'speedup':>8} {'fewer segs':>10}  verified"]
    for row in rows:
        lines.append(
            f"{row.method:<10} {row.staging:<8} {row.segments:>9} {_size(row.bytes):>10} "
            f"{row.calls:>6} {_ms(row.best):>10} {_ms(row.pack):>8} {_ms(row.write):>9} "
            f"{_ms(row.unpack):>8} {row.bytes / row.best / 1e9:>7.3f} "
            f"{base.best / row.best:>7.1f}x {base.segments / max(row.segments, 1):>9.0f}x  "
            "every byte"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mori_tp.demo",
        description="Move one KV-cache request between two processes through a transfer "
                    "engine: per-token lists, mori-tp direct and mori-tp staged; verify "
                    "every byte; print segments, bytes, time and GB/s.",
    )
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2to8")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--head-bytes", type=int, default=256,
                        help="bytes per KV head per token (head_dim x dtype size)")
    parser.add_argument("--pair", default=None,
                        help="P,D: the prefill and decode ranks (default: decode rank 0 and "
                             "its first sender)")
    parser.add_argument("--staging", choices=[s.name.lower() for s in Staging], default=None,
                        help="the staged method's staging (default: staging_for's choice)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per method (best shown)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds any one step may take")
    args = parser.parse_args(argv)
    problem = engine_available(args.engine)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    pair = (tuple(int(x) for x in args.pair.split(",")) if args.pair
            else first_sender(args.layout))
    setup = Setup(args.layout, args.tokens, args.layers, args.page_size, args.head_bytes, pair)
    staging = Staging[args.staging.upper()] if args.staging else None
    demo = Demo(args.engine, setup, args.timeout, staging)
    try:
        print(describe(args.engine, demo))
        rows = [demo.measure(method, args.repeat) for method in METHODS]
    finally:
        demo.close()
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    run_program(main)
