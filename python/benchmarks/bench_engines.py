"""Per-token lists vs mori-tp direct vs mori-tp staged, through real transfer engines between two
processes on 127.0.0.1, for the four layouts of ``mori_tp.demo`` at 4096 and 16384 tokens, 8
layers (16 buffers), page size 16, 256-byte heads, fragmented pages (runs of 1-16 pages).

    cargo build --release
    PYTHONPATH=python python3 python/benchmarks/bench_engines.py [--engines mooncake nixl]

Every run is verified byte for byte (as in the demo). The methods run interleaved, in rounds:
per-token once, direct once, staged (staging_for's mode) and staged with BOTH sides
``--staged-runs`` times each (they are cheap; the fastest counts), so that all see the same
machine load; each ratio is taken within a round, and the table
shows the median over the rounds (``--rounds``, fewer once the rounds took ``--budget``
seconds). Prints a Markdown table and whether the targets hold: staged >= 10x faster than
per-token on tp2to8 and tp8to2, >= 20x fewer segments there, and staged never slower than
direct.

Then any page layout (``--layout-cases``; ``--suites layouts`` runs just these): the same model
and request kept head-major (HND) or token-major (NHD) by both engines, for tp2to8, tp8to2 and
tp2to8 with prefill pages of 16 tokens and decode pages of 64, 4096 tokens: per-token lists (NHD,
one segment per token per buffer, as connectors build them), HND pages to pages without staging
(``hnd-direct``), and NHD with pair_staging_for's staging (``nhd-staged``), interleaved in rounds
the same way, each verified byte for byte against mori_tp_pair_send of its own layout.

The staged suite (``--suites staged``) also moves each request in the mode and chunk count the
streamer's cost model chooses (``Streamer.choose``, the decode process expecting it with
``staging=BY_SENDER``): the model learns the transport's costs from the suite's own writes and
the decode process's unpacks, and the "chosen" column shows what it chose and how fast that ran,
"chosen vs best fixed" the time of the row's best fixed method (named: the highest median
fraction of the contiguous write) over the chosen one's, within a round (median over the rounds;
0.95 or more: within 5%), and "chosen vs fixed modes" the same against the faster of the two
fixed rules issue 32 measured (staging_for's mode and BOTH, each pipelined in the automatic chunk
count). Each fixed method runs once, untimed, before the
rounds (the model's first requests); within a round every method runs once in turn,
``--staged-runs`` times over, in an order shuffled each round (the same seed every run).

Then load (``--suites soak``): python/tests/engine_load.py's mix of requests (five layouts,
four sizes, every staging mode, pipelined or layer by layer) sent back to back from 1, 4 and 16
lanes (``--soak-lanes``) through one transport pair for ``--soak-seconds`` each, every byte
verified: requests/s, GB/s, p50, p99 and p99.9 latency (plan done, from the first write until
the decode process has the request), and both processes' RSS at the start and the end.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import mori_tp
from mori_tp import Staging
from mori_tp.demo import BOTH, LAYOUTS, METHODS, Demo, Row, Setup, first_sender, fragmented_pages
from mori_tp.engines import (
    BY_SENDER,
    KvMemory,
    RequestPlan,
    Streamer,
    chunk_ranges,
    plan_request,
)
from mori_tp.engines.loopback import (
    ENGINES,
    StreamPeer,
    digest,
    driver,
    engine_available,
    run_program,
    sentinel,
)
from mori_tp.engines.streaming import chunk_message

TARGET_LAYOUTS = ("tp2to8", "tp8to2")

LAYOUT_METHODS = ("per-token", "hnd-direct", "nhd-staged")
#: Named cases of the layout benchmark: (layout of mori_tp.demo, prefill and decode page size).
LAYOUT_CASES: Dict[str, Tuple[str, int, int]] = {
    "tp2to8": ("tp2to8", 16, 16),
    "tp8to2": ("tp8to2", 16, 16),
    "tp2to8-p16to64": ("tp2to8", 16, 64),
}


def rounds(demo: Demo, count: int, staged_runs: int, budget: float,
           methods: Sequence[str] = (*METHODS, BOTH)) -> List[Dict[str, Row]]:
    """``count`` rounds (fewer past ``budget`` seconds) of every method, interleaved; the
    per-token lists and the direct plan of REFERENCE.md section 5 run once a round, the others (cheap)
    ``staged_runs`` times, the fastest counting."""
    out: List[Dict[str, Row]] = []
    start = time.monotonic()
    while len(out) < count and (not out or time.monotonic() - start < budget):
        out.append({m: demo.measure(m, 1 if m in ("per-token", "direct") else staged_runs)
                    for m in methods})
    return out


@dataclass(frozen=True)
class LayoutSetup:
    """One request of one pair of a named layout, each side's page size chosen."""

    case: str
    tokens: int
    layers: int
    head_bytes: int
    pair: Tuple[int, int]
    seed: int = 1

    def layouts(self, kind: str) -> Tuple[mori_tp.Layout, mori_tp.Layout]:
        """Both ranks' layouts, NHD or HND (``kind``)."""
        layout, src_page, dst_page = LAYOUT_CASES[self.case]
        heads, prefill_tp, decode_tp, _ = LAYOUTS[layout]
        make = getattr(mori_tp.Layout, kind)
        return (make(heads, prefill_tp, self.pair[0], src_page, self.head_bytes),
                make(heads, decode_tp, self.pair[1], dst_page, self.head_bytes))


class LayoutDemo(Demo):
    """One request moved three ways between two layouts of the same model: per-token lists
    and staged with NHD pages, pages to pages with HND pages."""

    warm_method = "nhd-staged"

    def __init__(self, engine: str, setup: LayoutSetup, timeout: float = 120.0) -> None:
        self.engine, self.setup, self.timeout = engine, setup, timeout
        self.layouts = {kind: setup.layouts(kind) for kind in ("nhd", "hnd")}
        self.configs = {kind: mori_tp.pair_config(*layouts)
                        for kind, layouts in self.layouts.items()}
        self.config = self.configs["nhd"]
        if self.config.action is not mori_tp.Action.SEND:
            raise ValueError(f"{setup.case}: pair {setup.pair} does not send")
        prefill, decode = self.layouts["nhd"]
        self.src_pages, _, src_cap, _ = fragmented_pages(
            -(-setup.tokens // prefill.page_size), setup.seed)
        _, self.dst_pages, _, dst_cap = fragmented_pages(
            -(-setup.tokens // decode.page_size), setup.seed + 1)
        self.request = mori_tp.Request(self.src_pages, self.dst_pages, setup.tokens)
        self.staged_with = mori_tp.pair_staging_for(self.config)
        self.num_buffers = 2 * setup.layers
        # HND and NHD pages of a rank have the same size: one set of buffers serves both.
        self.src_capacity = src_cap * prefill.page_stride
        self.dst_capacity = dst_cap * decode.page_stride
        self.dst_page_bytes = decode.page_stride
        self.staging_bytes = self.num_buffers * mori_tp.pair_staging_len(self.config,
                                                                         setup.tokens)
        self._connect(setup.seed)

    def _expected(self) -> Dict[str, List[bytes]]:
        out = {}
        for kind, config in self.configs.items():
            want = [sentinel(0, b, self.dst_capacity) for b in range(self.num_buffers)]
            mori_tp.send_kvcache_pair(
                config, self.local.buffers, [int(w.ctypes.data) for w in want],
                src_capacity=self.src_capacity, dst_capacity=self.dst_capacity,
                request=self.request, backend="host")
            out[kind] = [w.tobytes() for w in want]
        return out

    def expected_for(self, method: str) -> List[bytes]:
        return self.expected["hnd" if method.startswith("hnd") else "nhd"]

    def receive_request(self) -> Any:
        return self.request

    def per_token(self) -> Tuple["np.ndarray", "np.ndarray", "np.ndarray"]:
        """One segment per token: its moved heads, contiguous in an NHD token slot."""
        config = self.config
        tokens = np.arange(self.setup.tokens, dtype=np.uint64)

        def offsets(layout: mori_tp.Layout, pages: Sequence[int], first: int) -> "np.ndarray":
            page_size = np.uint64(layout.page_size)
            return (np.asarray(pages, dtype=np.uint64)[tokens // page_size]
                    * np.uint64(layout.page_stride) + np.uint64(layout.offset)
                    + tokens % page_size * np.uint64(layout.token_stride)
                    + np.uint64(first * layout.head_stride))

        sizes = np.full(len(tokens), config.num_heads * config.src.head_bytes, dtype=np.uint64)
        return (offsets(config.src, self.src_pages, config.src_first_local),
                offsets(config.dst, self.dst_pages, config.dst_first_local), sizes)

    def plan(self, method: str) -> RequestPlan:
        kind, staging = {"hnd-direct": ("hnd", Staging.NONE),
                         "nhd-staged": ("nhd", self.staged_with)}[method]
        return plan_request(self.configs[kind], self.request, local=self.local,
                            remote=self.remote, staging=staging)


def median_ratio(rows: List[Dict[str, Row]], slow: str, fast: str) -> float:
    return statistics.median(r[slow].best / r[fast].best for r in rows)


def median_ms(rows: List[Dict[str, Row]], method: str) -> float:
    return statistics.median(r[method].best for r in rows) * 1e3


# --- staging pools, pipelining, streaming, requests in flight --------------------------------

MIB = 1 << 20


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class StreamBench:
    """One prefill process (this one) and a decode child (:class:`StreamPeer`) with staging
    pools on both sides, moving ``setup``'s request with the streaming machinery. Times run
    from the first pack or write until the decode process has received (and unpacked) the
    request, on the one clock both processes share (CLOCK_MONOTONIC)."""

    def __init__(self, engine: str, setup: Setup, pool_requests: int = 2,
                 timeout: float = 120.0) -> None:
        self.engine = engine
        self.setup = setup
        self.timeout = timeout
        self.config = setup.config()
        self.src_pages, self.dst_pages, src_cap, dst_cap = fragmented_pages(
            -(-setup.tokens // setup.page_size), setup.seed)
        self.layers = setup.layers
        self.num_buffers = 2 * setup.layers
        self.src_capacity = src_cap * self.config.src_item_len
        self.dst_capacity = dst_cap * self.config.dst_item_len
        self.need = self.num_buffers * mori_tp.staging_len(self.config, len(self.src_pages))
        rng = np.random.default_rng(setup.seed)
        self.sources = [rng.integers(0, 256, self.src_capacity, dtype=np.uint8)
                        for _ in range(self.num_buffers)]
        self.local = KvMemory(tuple(int(x.ctypes.data) for x in self.sources),
                              self.src_capacity)
        pool_bytes = pool_requests * _round_up(self.need, 1 << 16)
        self.pool = mori_tp.StagingPool(pool_bytes)
        self.driver = driver(engine)
        self.transport = self.driver.start("prefill")
        self.transport.register(self.local)
        self.transport.register(KvMemory((), 0, self.pool.address, self.pool.capacity))
        self.peer = StreamPeer(engine, [(self.num_buffers, self.dst_capacity)], pool_bytes,
                               timeout)
        try:
            self.remote = self.peer.memories[0]
            self.handle = self.driver.connect(self.transport, self.peer.address)
            self.peer.connect(self.driver.sender(self.transport))
            self.streamer = Streamer(self.transport, timeout=timeout)
            want = [sentinel(0, b, self.dst_capacity) for b in range(self.num_buffers)]
            mori_tp.send_kvcache(self.config, self.local.buffers,
                                 [int(w.ctypes.data) for w in want],
                                 src_capacity=self.src_capacity, dst_capacity=self.dst_capacity,
                                 src_pages=self.src_pages, dst_pages=self.dst_pages,
                                 backend="host")
            self.expected = [digest(w) for w in want]
            self._ids = 0
            self._tokens: Dict[str, str] = {}
            #: What the cost model chose for each chosen() request, and how long choose took.
            self.choices: List[Any] = []
            self.choose_seconds: List[float] = []
            self._lock = threading.Lock()
            # First use of the engine, the pools and the pages: paid once per process.
            self.contiguous()
            self.pipelined(Staging.BOTH, None, verify=True)
        except BaseException:
            self.peer.close()
            raise

    def close(self) -> None:
        self.streamer.close()
        self.peer.close()

    def _id(self, label: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{label}-{self._ids}"

    def prepare(self, staging: Staging, buffers: Optional[Tuple[int, ...]] = None):
        """Slots on both sides and the plan (untimed: a connector's handshake does this)."""
        rid = self._id(staging.name.lower())
        local, remote = self.local, self.remote
        if buffers is not None:
            local = replace(local, buffers=tuple(local.buffers[b] for b in buffers))
            remote = replace(remote, buffers=tuple(remote.buffers[b] for b in buffers))
        need = len(local.buffers) * mori_tp.staging_len(self.config, len(self.src_pages))
        slot_address, token = self.peer.expect(rid, 0, self.config, self.dst_pages,
                                               int(staging), need if staging.unpacks else 0,
                                               buffers=buffers)
        self._tokens[rid] = token
        remote = replace(remote, staging=slot_address,
                         staging_capacity=need if slot_address else 0)
        slot = None
        if staging.packs:
            slot = self.pool.alloc(need, timeout=self.timeout)
            local = replace(local, staging=slot.address, staging_capacity=slot.size)
        plan = plan_request(self.config, self.src_pages, self.dst_pages, local=local,
                            remote=remote, staging=staging)
        return rid, plan, slot

    def finish(self, rid: str, slot: Any) -> float:
        report = self.peer.ended(rid)
        if slot is not None:
            self.pool.free(slot)
        if report.error:
            raise AssertionError(f"{self.engine}: {rid} failed on the decode side: "
                                 f"{report.error}")
        if report.unpack_seconds > 0:
            # The decode process's unpack speed, for the cost model (a connector whose decode
            # rank reports it does the same; otherwise the model takes the pack's).
            self.streamer.costs.observe_copy("unpack", self.need, report.unpack_seconds)
        return report.finished_at

    def verify(self, what: str) -> None:
        got = self.peer.digests()[0]
        wrong = [b for b, (x, y) in enumerate(zip(got, self.expected)) if x != y]
        if wrong:
            raise AssertionError(f"{self.engine} {what}: decode buffers {wrong} differ from "
                                 "send_kvcache's result")

    def contiguous(self) -> float:
        """One segment of the request's bytes, prefill pool to decode pool, through the same
        engine and the same completion message: the engine's own limit for these bytes."""
        rid = self._id("contiguous")
        slot_address, token = self.peer.expect(rid, 0, self.config, self.dst_pages,
                                               int(Staging.NONE), self.need)
        slot = self.pool.alloc(self.need, timeout=self.timeout)
        message = chunk_message(rid, token, 0, [(0, self.num_buffers)], sealed=1,
                                staging=Staging.NONE)
        start = time.monotonic()
        self.transport.write(self.handle, [slot.address], [slot_address], [self.need],
                             notification=message, timeout=self.timeout)
        return self.finish(rid, slot) - start

    def pipelined(self, staging: Staging, chunks: Optional[int], verify: bool = False) -> float:
        if verify:
            self.peer.reset()
        rid, plan, slot = self.prepare(staging)
        start = time.monotonic()
        self.streamer.send(self.handle, plan, rid, chunks=chunks, token=self._tokens[rid])
        seconds = self.finish(rid, slot) - start
        if verify:
            self.verify(f"{staging.name} in {chunks or 'auto'} chunks")
        return seconds

    def one_layer(self, staging: Staging) -> float:
        """One layer's K and V as a request of their own."""
        rid, plan, slot = self.prepare(staging, buffers=(0, self.layers))
        start = time.monotonic()
        self.streamer.send(self.handle, plan, rid, token=self._tokens[rid])
        return self.finish(rid, slot) - start

    def behind_compute(self, staging: Staging, compute: float, streamed: bool,
                       verify: bool = False) -> float:
        """Seconds from the end of the last layer's (simulated) compute until the decode
        process has the request: streamed layer by layer, or sent whole after the compute."""
        if verify:
            self.peer.reset()
        rid, plan, slot = self.prepare(staging)
        ready = [threading.Event() for _ in range(self.layers)]
        ended = [0.0] * self.layers

        def prefill() -> None:
            for layer in range(self.layers):
                time.sleep(compute)  # the layer's forward pass, on the GPU in a real engine
                ended[layer] = time.monotonic()
                ready[layer].set()

        worker = threading.Thread(target=prefill)
        worker.start()
        if streamed:
            stream = self.streamer.open(self.handle, plan, rid, layers=self.layers,
                                        token=self._tokens[rid])
            for layer in range(self.layers):
                stream.submit(layer, ready=lambda layer=layer: ready[layer].wait(self.timeout))
            stream.seal()
            stream.wait()
        else:
            ready[-1].wait(self.timeout)
            self.streamer.send(self.handle, plan, rid, token=self._tokens[rid])
        worker.join(self.timeout)
        seconds = self.finish(rid, slot) - ended[-1]
        if verify:
            self.verify(f"{'streamed' if streamed else 'whole'} behind compute")
        return seconds

    def in_flight(self, concurrency: int, requests: int, staging: Staging) -> Dict[str, float]:
        """``requests`` requests from ``concurrency`` threads at once, each waiting for pool
        slots on both sides; latency from a request's start (slots included) to its arrival."""
        self.peer.reset()
        latencies: List[float] = []
        failures: List[BaseException] = []
        counter = iter(range(requests))
        lock = threading.Lock()

        def worker() -> None:
            try:
                while True:
                    with lock:
                        if next(counter, None) is None:
                            return
                    start = time.monotonic()
                    rid, plan, slot = self.prepare(staging)
                    self.streamer.send(self.handle, plan, rid, token=self._tokens[rid])
                    latencies.append(self.finish(rid, slot) - start)
            except BaseException as error:  # noqa: B036 - reported below
                failures.append(error)

        start = time.monotonic()
        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.timeout * 10)
        elapsed = time.monotonic() - start
        if failures:
            raise failures[0]
        self.verify(f"{concurrency} in flight")
        latencies.sort()
        return {
            "requests_per_s": len(latencies) / elapsed,
            "gb_per_s": len(latencies) * self.need / elapsed / 1e9,
            "p50": latencies[len(latencies) // 2],
            "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        }

    def chosen(self, verify: bool = False) -> float:
        """One request in the mode and chunk count the streamer's cost model chooses: the
        decode process expects it with staging=BY_SENDER and a slot for the modes that
        unpack; the choice (untimed, as the plan is) goes into ``self.choices``."""
        if verify:
            self.peer.reset()
        rid = self._id("chosen")
        slot_address, self._tokens[rid] = self.peer.expect(rid, 0, self.config, self.dst_pages,
                                                           BY_SENDER, self.need)
        remote = replace(self.remote, staging=slot_address, staging_capacity=self.need)
        start = time.perf_counter()
        choice = self.streamer.choose(self.handle, self.config, self.src_pages, self.dst_pages,
                                      remote=remote, request_id=rid)
        self.choose_seconds.append(time.perf_counter() - start)
        self.choices.append(choice)
        local, slot = self.local, None
        if choice.staging.packs:
            slot = self.pool.alloc(self.need, timeout=self.timeout)
            local = replace(local, staging=slot.address, staging_capacity=slot.size)
        plan = plan_request(self.config, self.src_pages, self.dst_pages, local=local,
                            remote=remote, staging=choice.staging)
        start = time.monotonic()
        self.streamer.send(self.handle, plan, rid, chunks=choice.chunks,
                           token=self._tokens[rid])
        seconds = self.finish(rid, slot) - start
        if verify:
            self.verify(f"chosen {choice.staging.name} in {choice.chunks} chunks")
        return seconds


def _best(runs: int, measure: Callable[[], float]) -> float:
    """The fastest of ``runs`` runs: the one least disturbed by other work on the machine."""
    return min(measure() for _ in range(runs))


def _rounds(count: int, budget: float, measure: Callable[[], Dict[str, float]]
            ) -> List[Dict[str, float]]:
    out: List[Dict[str, float]] = []
    start = time.monotonic()
    while len(out) < count and (not out or time.monotonic() - start < budget):
        out.append(measure())
    return out


def _median(rows: List[Dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _choices(picks: List[Any]) -> str:
    """The cost model's most frequent choice, "MODE/chunks", and how often it chose otherwise."""
    counts = collections.Counter(f"{c.staging.name}/{c.chunks}" for c in picks)
    (top, n), *others = counts.most_common()
    if not others:
        return top
    return f"{top} ({n} of {len(picks)}; " + ", ".join(f"{k}: {v}" for k, v in others) + ")"


def _versus_best_fixed(rows: List[Dict[str, float]],
                       fixed: Optional[Sequence[str]] = None) -> str:
    """The best fixed method of the row (the highest median fraction of the contiguous write;
    among ``fixed``, default every method but the chosen), and the median over the rounds of
    its time over the chosen one's within a round (1: as fast as the best; 0.95: 5% slower)."""
    if fixed is None:
        fixed = [k for k in rows[0] if k not in ("contiguous", "chosen")]
    best = max(fixed, key=lambda k: statistics.median(r["contiguous"] / r[k] for r in rows))
    return f"{statistics.median(r[best] / r['chosen'] for r in rows):.2f} ({best})"


def staged_suite(args: argparse.Namespace, engine: str) -> List[str]:
    """Staged (sequential and pipelined) against one contiguous write of the same bytes."""
    lines = []
    for layout in ("tp2to8", "tp8to2"):
        for tokens in args.tokens:
            setup = Setup(layout, tokens, args.layers, 16, 256, first_sender(layout))
            bench = StreamBench(engine, setup)
            chosen = mori_tp.staging_for(bench.config)
            auto = len(chunk_ranges(bench.num_buffers, bench.need // bench.num_buffers))
            picks: List[Any] = []

            def chosen_run() -> float:
                made = len(bench.choices)
                seconds = bench.chosen()
                picks.extend(bench.choices[made:])
                return seconds

            methods: List[Tuple[str, Callable[[], float]]] = [
                ("contiguous", bench.contiguous),
                ("sequential", lambda: bench.pipelined(chosen, 1)),
                ("sequential BOTH", lambda: bench.pipelined(Staging.BOTH, 1)),
                ("pipelined", lambda: bench.pipelined(chosen, None)),
                ("pipelined BOTH", lambda: bench.pipelined(Staging.BOTH, None)),
                ("chosen", chosen_run),
                *((f"BOTH {c}", lambda c=c: bench.pipelined(Staging.BOTH, c))
                  for c in args.chunks),
            ]
            order, shuffler = list(range(len(methods))), random.Random(1)
            try:
                # Each fixed method once, untimed: the cost model learns the transport from
                # these first requests, as it would from a deployment's.
                for name, measure in methods:
                    if name != "chosen":
                        measure()

                def one_round() -> Dict[str, float]:
                    bench.pipelined(chosen, None, verify=True)
                    bench.pipelined(Staging.BOTH, None, verify=True)
                    bench.chosen(verify=True)
                    # Every method once in turn, --staged-runs times over (the fastest run
                    # counts), in an order shuffled each round: no method keeps the place after
                    # another, whose warm caches or idle cores it would inherit.
                    shuffler.shuffle(order)
                    best = {name: math.inf for name, _ in methods}
                    for _ in range(args.staged_runs):
                        for i in order:
                            name, measure = methods[i]
                            best[name] = min(best[name], measure())
                    return best

                rows = _rounds(args.rounds, args.budget, one_round)
            finally:
                bench.close()
            print(f"{engine} {layout} {tokens}: Streamer.choose took "
                  f"{statistics.median(bench.choose_seconds) * 1e3:.2f} ms (median of "
                  f"{len(bench.choose_seconds)}); last choice: {bench.choices[-1].describe()}",
                  file=sys.stderr, flush=True)
            ratio = {k: statistics.median(r["contiguous"] / r[k] for r in rows)
                     for k in rows[0] if k != "contiguous"}
            ms = {k: _median(rows, k) * 1e3 for k in rows[0]}
            line = (f"| {engine} | {layout} | {tokens} | {bench.need / MIB:.0f} MiB | "
                    f"{chosen.name} | {auto} | {ms['contiguous']:.1f} | "
                    f"{ms['sequential']:.1f} ({ratio['sequential']:.2f}) | "
                    f"{ms['sequential BOTH']:.1f} ({ratio['sequential BOTH']:.2f}) | "
                    f"{ms['pipelined']:.1f} ({ratio['pipelined']:.2f}) | "
                    f"{ms['pipelined BOTH']:.1f} ({ratio['pipelined BOTH']:.2f}) | "
                    f"{_choices(picks)}: {ms['chosen']:.1f} ({ratio['chosen']:.2f}) | "
                    f"{_versus_best_fixed(rows)} | "
                    f"{_versus_best_fixed(rows, ('pipelined', 'pipelined BOTH'))} | " +
                    ", ".join(f"{c}: {ratio[f'BOTH {c}']:.2f}" for c in args.chunks) +
                    f" | {len(rows)} |")
            print(line, file=sys.stderr, flush=True)
            lines.append(line)
    return lines


def streaming_suite(args: argparse.Namespace, engine: str) -> List[str]:
    """Streamed layer by layer against whole after compute: the tail after the last layer."""
    lines = []
    for layout in ("tp2to8", "tp8to2"):
        tokens = args.tokens[0]
        setup = Setup(layout, tokens, args.layers, 16, 256, first_sender(layout))
        bench = StreamBench(engine, setup)
        staging = Staging.BOTH
        try:
            def one_round() -> Dict[str, float]:
                runs = args.staged_runs
                bench.behind_compute(staging, args.compute, False, verify=True)
                bench.behind_compute(staging, args.compute, True, verify=True)
                return {
                    "layer": _best(runs, lambda: bench.one_layer(staging)),
                    "whole": _best(runs, lambda: bench.behind_compute(staging, args.compute,
                                                                      False)),
                    "streamed": _best(runs, lambda: bench.behind_compute(staging, args.compute,
                                                                         True)),
                }

            rows = _rounds(args.rounds, args.budget, one_round)
        finally:
            bench.close()
        per_layer = statistics.median(r["streamed"] / r["layer"] for r in rows)
        gain = statistics.median(r["whole"] / r["streamed"] for r in rows)
        line = (f"| {engine} | {layout} | {tokens} | {args.layers} x {args.compute * 1e3:.0f} ms "
                f"| {staging.name} | {_median(rows, 'layer') * 1e3:.1f} | "
                f"{_median(rows, 'whole') * 1e3:.1f} | {_median(rows, 'streamed') * 1e3:.1f} | "
                f"{per_layer:.2f} | {gain:.1f}x | {len(rows)} |")
        print(line, file=sys.stderr, flush=True)
        lines.append(line)
    return lines


def inflight_suite(args: argparse.Namespace, engine: str) -> List[str]:
    """1, 4 and 16 requests in flight through one transport pair with pools of 8 requests."""
    lines = []
    layout, tokens = "tp2to8", args.tokens[0]
    setup = Setup(layout, tokens, args.layers, 16, 256, first_sender(layout))
    bench = StreamBench(engine, setup, pool_requests=8)
    try:
        for concurrency in (1, 4, 16):
            result = bench.in_flight(concurrency, args.requests, Staging.BOTH)
            line = (f"| {engine} | {layout} | {tokens} | {concurrency} | {args.requests} | "
                    f"{result['requests_per_s']:.0f} | {result['gb_per_s']:.2f} | "
                    f"{result['p50'] * 1e3:.1f} | {result['p99'] * 1e3:.1f} |")
            print(line, file=sys.stderr, flush=True)
            lines.append(line)
    finally:
        bench.close()
    return lines


def soak_suite(args: argparse.Namespace, engine: str) -> List[str]:
    """python/tests/engine_load.py's mixed requests (five layouts, four sizes, every staging,
    pipelined or by layer) from 1, 4 and 16 lanes for ``--soak-seconds`` each, one transport
    pair, every byte verified: throughput, latency percentiles and both processes' RSS."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import engine_load

    lines = []
    for lanes in args.soak_lanes:
        load = engine_load.Load(engine, lanes=lanes)
        load.verify_every = args.soak_verify_every
        try:
            load.soak(min(5.0, args.soak_seconds), engine_load.Stats())  # warm-up
            watch = engine_load.Watch([os.getpid(), load.peer.pid])
            stats = engine_load.Stats()
            start = time.monotonic()
            load.soak(args.soak_seconds, stats)
            elapsed = time.monotonic() - start
            load.check_all("soak")
            watch.stop()
        finally:
            load.close()
        rss = [(first, last) for first, last in zip(watch.samples[0][1], watch.samples[-1][1])]
        line = (f"| {engine} | {lanes} | {args.soak_verify_every} | {elapsed:.0f} | "
                f"{stats.requests} | {stats.bytes / max(stats.requests, 1) / 1e6:.2f} | "
                f"{stats.requests / elapsed:.0f} | {stats.bytes / elapsed / 1e9:.3f} | "
                f"{stats.percentile(0.5) * 1e3:.1f} | {stats.percentile(0.99) * 1e3:.1f} | "
                f"{stats.percentile(0.999) * 1e3:.1f} | "
                + " | ".join(f"{a / 1024:.0f} -> {b / 1024:.0f}" for a, b in rss) + " |")
        print(line, file=sys.stderr, flush=True)
        lines.append(line)
    return lines


#: benches/regenerate pastes what follows this line (each suite prints it before its table) into
#: BENCHMARKS.md; everything else goes to stderr.
RESULTS = "== results =="

SUITES = ("methods", "layouts", "staged", "streaming", "inflight", "soak")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--staged-runs", type=int, default=5,
                        help="runs of each cheap method per round (the fastest counts)")
    parser.add_argument("--budget", type=float, default=60.0,
                        help="start no new round once the rounds took this many seconds")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument("--chunks", nargs="*", type=int, default=[2, 8, 16],
                        help="staged suite: fixed chunk counts measured beside the automatic")
    parser.add_argument("--compute", type=float, default=0.002,
                        help="streaming suite: seconds of simulated compute per layer")
    parser.add_argument("--requests", type=int, default=48,
                        help="inflight suite: requests per concurrency level")
    parser.add_argument("--layout-cases", nargs="+", choices=list(LAYOUT_CASES),
                        default=list(LAYOUT_CASES), help="layouts suite: the cases")
    parser.add_argument("--layout-tokens", type=int, default=4096,
                        help="layouts suite: tokens per request")
    parser.add_argument("--soak-seconds", type=float, default=60.0,
                        help="soak suite: seconds per number of lanes")
    parser.add_argument("--soak-lanes", nargs="+", type=int, default=[1, 4, 16],
                        help="soak suite: requests in flight (one per lane)")
    parser.add_argument("--soak-verify-every", type=int, default=1,
                        help="soak suite: check each lane's n-th requests as they land (all "
                             "bytes of every lane are checked at the end either way)")
    args = parser.parse_args()
    print(f"mori-tp {mori_tp.library_version()} ({mori_tp.library_path}), "
          f"Python {platform.python_version()}, {platform.machine()}", file=sys.stderr,
          flush=True)
    if "methods" in args.suites:
        methods_suite(args)
    engines = [e for e in args.engines if not engine_available(e)]
    if "layouts" in args.suites:
        layouts(args, engines)
    tables = {
        "staged": ("Staged against one contiguous write (ms; in brackets contiguous / staged, "
                   "the fraction of the engine's own limit)",
                   "| engine | layout | tokens | bytes | staging_for | auto chunks | contiguous "
                   "| sequential | sequential BOTH | pipelined | pipelined BOTH | chosen "
                   "| chosen vs best fixed | chosen vs fixed modes | BOTH, n chunks | rounds |\n"
                   "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
                   staged_suite),
        "streaming": ("Streamed by layer against whole after compute: ms from the end of the last "
                      "layer's compute until decode has the request",
                      "| engine | layout | tokens | compute | staging | one layer alone | whole "
                      "| streamed | streamed / one layer | whole / streamed | rounds |\n"
                      "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
                      streaming_suite),
        "inflight": ("Requests in flight through one transport pair, pools of 8 requests (BOTH)",
                     "| engine | layout | tokens | in flight | requests | requests/s | GB/s | "
                     "p50 (ms) | p99 (ms) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|",
                     inflight_suite),
        "soak": ("Mixed requests back to back (engine_load.py's mix), one per lane, every byte "
                 "verified",
                 "| engine | lanes | checked 1 in | seconds | requests | MB/request | "
                 "requests/s | GB/s | p50 (ms) | p99 (ms) | p99.9 (ms) | RSS prefill (MiB) | "
                 "RSS decode (MiB) |\n"
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
                 soak_suite),
    }
    for suite in SUITES[2:]:
        if suite not in args.suites:
            continue
        title, header, run = tables[suite]
        lines = []
        for engine in engines:
            lines += run(args, engine)
        print(f"{RESULTS}\n\n{title}:\n\n{header}")
        print("\n".join(lines), flush=True)
    return 0


def methods_suite(args: argparse.Namespace) -> None:
    """Per-token vs direct vs staged (the demo's methods)."""
    results: List[Tuple[str, str, int, List[Dict[str, Row]]]] = []
    for engine in args.engines:
        problem = engine_available(engine)
        if problem:
            print(f"skipping {engine}: {problem}", file=sys.stderr)
            continue
        for layout in args.layouts:
            for tokens in args.tokens:
                setup = Setup(layout, tokens, args.layers, 16, 256, first_sender(layout))
                demo = Demo(engine, setup)
                try:
                    measured = rounds(demo, args.rounds, args.staged_runs, args.budget)
                finally:
                    demo.close()
                results.append((engine, layout, tokens, measured))
                print(f"{engine:8} {layout:8} {tokens:6} tokens, {len(measured)} rounds: " +
                      ", ".join(f"{m} {measured[0][m].segments} segs "
                                f"{median_ms(measured, m):.1f} ms" for m in METHODS),
                      file=sys.stderr, flush=True)
    print(f"{RESULTS}\n")
    print(f"One request, {args.layers} layers ({2 * args.layers} buffers), page size 16, 256-byte "
          "heads, fragmented pages; times are medians over the rounds, \"A vs B\" the median "
          "over the rounds of B's time / A's time within a round (above 1: A is faster):\n")
    print("| engine | layout | tokens | moved | staging | segments per-token / direct / staged | "
          "median time per-token / direct / staged (ms) | staged vs per-token | "
          "staged vs direct | fewer segments | BOTH: segments, time (ms), vs staged | rounds |")
    print("|---|---|---:|---:|---|---|---|---:|---:|---:|---|---:|")
    misses = []
    for engine, layout, tokens, measured in results:
        first = measured[0]
        speedup = median_ratio(measured, "per-token", "staged")
        versus_direct = median_ratio(measured, "direct", "staged")
        fewer = first["per-token"].segments / first["staged"].segments
        print(f"| {engine} | {layout} | {tokens} | {first['per-token'].bytes / MIB:.0f} MiB | "
              f"{first['staged'].staging} | "
              f"{first['per-token'].segments} / {first['direct'].segments} / "
              f"{first['staged'].segments} | {median_ms(measured, 'per-token'):.1f} / "
              f"{median_ms(measured, 'direct'):.1f} / {median_ms(measured, 'staged'):.1f} | "
              f"{speedup:.1f}x | {versus_direct:.1f}x | {fewer:.0f}x | "
              f"{first[BOTH].segments}, {median_ms(measured, BOTH):.1f}, "
              f"{median_ratio(measured, 'staged', BOTH):.2f}x | {len(measured)} |")
        if layout in TARGET_LAYOUTS and speedup < 10:
            misses.append(f"{engine} {layout} {tokens}: staged only {speedup:.1f}x faster "
                          "than per-token (target 10x)")
        if layout in TARGET_LAYOUTS and fewer < 20:
            misses.append(f"{engine} {layout} {tokens}: only {fewer:.0f}x fewer segments "
                          "(target 20x)")
        if versus_direct < 1:
            misses.append(f"{engine} {layout} {tokens}: staged slower than direct "
                          f"({versus_direct:.2f}x)")
    print()
    print("Targets (staged at least 10x faster than per-token lists on tp2to8 and tp8to2, with at "
          "least 20x fewer segments; staged never slower than direct): "
          + ("all met." if not misses else "MISSED:\n\n- " + "\n- ".join(misses)))


def layouts(args: argparse.Namespace, engines: List[str]) -> None:
    """Pair configs: per-token lists (NHD), HND pages to pages, NHD staged."""
    results: List[Tuple[str, str, List[Dict[str, Row]]]] = []
    for engine in engines:
        for case in args.layout_cases:
            setup = LayoutSetup(case, args.layout_tokens, args.layers, 256,
                                first_sender(LAYOUT_CASES[case][0]))
            demo = LayoutDemo(engine, setup)
            try:
                measured = rounds(demo, args.rounds, args.staged_runs, args.budget,
                                  LAYOUT_METHODS)
            finally:
                demo.close()
            results.append((engine, case, measured))
            print(f"{engine:8} {case:15} {args.layout_tokens:6} tokens, {len(measured)} rounds: "
                  + ", ".join(f"{m} {measured[0][m].segments} segs "
                              f"{median_ms(measured, m):.1f} ms" for m in LAYOUT_METHODS),
                  file=sys.stderr, flush=True)
    print(f"{RESULTS}\n")
    print(f"One request of {args.layout_tokens} tokens, {args.layers} layers, 256-byte heads, "
          "fragmented pages, NHD or HND on both sides; times are medians over the rounds, "
          "\"A vs B\" the median over the rounds of B's time / A's time within a round:\n")
    print("| engine | case | nhd-staged staging | segments per-token / hnd-direct / nhd-staged | "
          "median time per-token / hnd-direct / nhd-staged (ms) | hnd-direct vs per-token | "
          "nhd-staged vs per-token | nhd-staged vs hnd-direct | rounds |")
    print("|---|---|---|---|---|---:|---:|---:|---:|")
    for engine, case, measured in results:
        first = measured[0]
        # "A vs B": B's time over A's, in the same round (how many times faster A is).
        print(f"| {engine} | {case} | {first['nhd-staged'].staging} | "
              + " / ".join(str(first[m].segments) for m in LAYOUT_METHODS) + " | "
              + " / ".join(f"{median_ms(measured, m):.1f}" for m in LAYOUT_METHODS) + " | "
              f"{median_ratio(measured, 'per-token', 'hnd-direct'):.1f}x | "
              f"{median_ratio(measured, 'per-token', 'nhd-staged'):.1f}x | "
              f"{median_ratio(measured, 'hnd-direct', 'nhd-staged'):.2f}x | {len(measured)} |")


if __name__ == "__main__":
    run_program(main)
