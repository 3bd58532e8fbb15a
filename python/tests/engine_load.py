"""Load between two processes on 127.0.0.1 through one transport pair (one engine per process,
one Streamer, one Receiver): many requests in flight, of mixed layouts, sizes, staging modes
and ways of sending, every byte verified, and the processes' memory watched.

- Bursts: 16 lanes plan a request each (slots on both sides, the decode process expecting it),
  wait for each other, then send at once, so that 16 requests are in flight together; a
  lane sends pipelined (1 to 3 chunks, or the automatic rule) or layer by layer in a shuffled
  order.
- Soak: the same lanes send requests back to back for ``--soak-seconds`` (default 30, at most
  60 in CI; ``MORI_TP_SOAK_SECONDS`` sets it under cargo test), one in flight per lane.
- Every request: fresh random bytes on its source pages, then the decode rank's pages it wrote
  must equal what one send_kvcache (host backend) leaves in this process's mirror of that
  lane's decode buffers; after each burst and at the end, every byte of every lane's buffers
  (outside the requests' pages too) must equal the mirror.
- Memory: the resident set size (VmRSS) of both processes is sampled every 0.5 s; after a
  warm-up (the bursts and the first quarter of the soak, at least 5 s), the median of the last
  third of the samples may exceed that of the first third by ``--rss-tolerance-mib`` (default
  :data:`RSS_TOLERANCE_MIB`; why that figure: the constant's comment). Both processes run with
  glibc's allocator set so that RSS follows live memory (:data:`MALLOC_ENV`; the script starts
  itself again with it, before numpy's threads exist):

  - one malloc arena (``MALLOC_ARENA_MAX=1``): per-thread arenas keep what 16 lane threads
    freed and grow the prefill process by 40-60 MiB over the first 30 s before they level off;
  - fixed mmap and trim thresholds of 128 KiB (``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_``): by default glibc raises its mmap threshold to the largest
    block freed (up to 32 MiB), after which the multi-MiB temporaries of large requests stay
    in the heap, and RSS becomes a high-water mark that steps up whenever a new largest set of
    them is live at once. In 30 s soaks through NIXL this moved the prefill's median by up to
    6 MiB with no leak (a 120 s soak stayed flat); with fixed thresholds those blocks are
    mapped and returned, and the medians stayed within 1.1 MiB.

  Both are the allocator's caching, not a leak, and would hide one. ``--leak-kib N`` makes every request of the soak
  keep N KiB alive, a leak for the check to catch (the script prints the smallest leak per
  request its tolerance catches in that run).

    python3 python/tests/engine_load.py mooncake|nixl [--soak-seconds N]

Exit status: 0 passed, 1 failed, 77 skipped (the engine is not installed; with
MORI_TP_REQUIRE_TOOLS=1 that is a failure instead). tests/python.rs runs it under cargo test.
Latency and throughput are printed, not checked (BENCHMARKS.md records a longer run of
``python/benchmarks/bench_engines.py --suites soak``).
"""

from __future__ import annotations

import os
import sys

#: glibc's allocator settings under which RSS follows live memory (see the module docs), for
#: this process and the decode child it starts.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
              "MALLOC_TRIM_THRESHOLD_": "131072"}

if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
    # glibc reads them when a process starts, so start again with them.
    os.environ.update(MALLOC_ENV)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import argparse
import random
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

import mori_tp
from engine_loopback import skip_or_arm
from layouts import Layout, fragmented_request
from mori_tp import Action, Staging
from mori_tp.engines import KvMemory, Streamer, plan_request
from mori_tp.engines.loopback import (
    PeerError,
    Placement,
    StreamPeer,
    digest,
    driver,
    pages_of,
    run_program,
    sentinel,
)

BUFFERS = 6  # K and V of three layers
LAYERS = BUFFERS // 2
LANES = 16
STEP_TIMEOUT = 60.0
#: The layouts requests mix: TP both ways, replicated heads, a non-integer ratio, whole pages.
LAYOUTS: Dict[str, Layout] = {
    "tp2to8": Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=128),
    "tp8to2": Layout(heads=4, p_tp=8, d_tp=2, page_size=16, bytes_per_head=128),
    "h12p6d4": Layout(heads=12, p_tp=6, d_tp=4, page_size=16, bytes_per_head=64),
    "tp4to8": Layout(heads=8, p_tp=4, d_tp=8, page_size=16, bytes_per_head=32),
    "tp1to1": Layout(heads=2, p_tp=1, d_tp=1, page_size=16, bytes_per_head=128),
}
#: Sizes: runs of 1-4 pages; from one page to about 170.
RUNS = (1, 4, 16, 48)
SEEDS_PER_SIZE = 4
STAGINGS = (None, Staging.NONE, Staging.SRC, Staging.DST, Staging.BOTH)
#: Allowed growth of the median RSS from the first third of the soak after the warm-up to the
#: last third, per process, MiB. Measured here (30 s soaks of 16 lanes, MALLOC_ENV, debug
#: library, both engines, a fresh machine): the samples sit on a floor (prefill about 266 MiB
#: through NIXL, 261 through Mooncake) with spikes of up to 7 MiB above it (a few large
#: requests' numpy temporaries, and Mooncake's Python lists of addresses, live at once), and the
#: medians of the thirds moved by -0.4 to +1.1 MiB in six runs (a 120 s NIXL soak: -0.1 MiB).
#: 4 MiB is more than three times the largest drift seen. In a 30 s soak it catches a leak of
#: more than about 5.5 KiB per request through NIXL (about 50 requests/s here) and 12-14 KiB
#: through Mooncake (about 20/s): with --leak-kib 8 (NIXL) and 16 (Mooncake) the prefill's
#: median grew by 7.6 and 6.8 MiB, and the check failed. The script prints the figure of its
#: run; longer soaks catch smaller leaks.
RSS_TOLERANCE_MIB = 4.0
#: At least this much of the soak is warm-up (and a quarter of it).
WARM_UP = 5.0


class Failure(AssertionError):
    pass


def require(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


def rss_kib(pid: int) -> int:
    """VmRSS of process ``pid``, KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise OSError(f"no VmRSS for process {pid}")


@dataclass(frozen=True)
class Shape:
    """One kind of request: a layout and a request of pages."""

    layout_name: str
    layout: Layout
    request: Any
    #: (p, d) pairs of the layout that send.
    pairs: Tuple[Tuple[int, int], ...]
    #: Runs of pages in the request.
    runs: int

    def config(self, p: int, d: int) -> mori_tp.SliceConfig:
        return self.layout.config(p, d)


def shapes() -> List[Shape]:
    out = []
    for name, layout in LAYOUTS.items():
        pairs = tuple((p, d) for p, d in layout.pairs()
                      if layout.config(p, d).action is Action.SEND)
        for runs in RUNS:
            for seed in range(SEEDS_PER_SIZE):
                out.append(Shape(name, layout, fragmented_request(1000 * runs + seed, runs),
                                 pairs, runs))
    return out


@dataclass
class Stats:
    requests: int = 0
    bytes: int = 0
    latencies: List[float] = field(default_factory=list)
    by_layout: Dict[str, int] = field(default_factory=dict)
    by_mode: Dict[str, int] = field(default_factory=dict)

    def add(self, shape: Shape, mode: str, nbytes: int, latency: float) -> None:
        self.requests += 1
        self.bytes += nbytes
        self.latencies.append(latency)
        self.by_layout[shape.layout_name] = self.by_layout.get(shape.layout_name, 0) + 1
        self.by_mode[mode] = self.by_mode.get(mode, 0) + 1

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class Lane:
    """One request at a time: its own prefill buffers in this process, its own decode rank
    (buffers ``index``) in the child, and a mirror of what those must hold."""

    def __init__(self, load: "Load", index: int) -> None:
        self.load, self.index = load, index
        self.rng = random.Random(index)
        self.data = np.random.default_rng(index)
        # Filled now, so that every page is resident from the start (RSS counts pages touched).
        self.src = [self.data.integers(0, 256, load.src_capacity, dtype=np.uint8)
                    for _ in range(BUFFERS)]
        self.mirror = [sentinel(index, b, load.dst_capacity) for b in range(BUFFERS)]
        self.local = load.transport.register(
            KvMemory(tuple(int(b.ctypes.data) for b in self.src), load.src_capacity))
        self.sent = 0
        #: Memory kept alive on purpose (--leak-kib).
        self.leaked: List[Any] = []

    def one(self, stats: Stats, barrier: Optional[threading.Barrier] = None) -> None:
        """Plans, sends and checks one request of a random shape, staging and mode."""
        load = self.load
        shape = self.rng.choice(load.shapes)
        p, d = self.rng.choice(shape.pairs)
        config = shape.config(p, d)
        # Unstaged sides write one segment per token or run of pages (thousands for the
        # largest shapes, which Mooncake's TCP transport moves at about 0.1 ms each): they go
        # with the smaller shapes; the largest move with staging_for's mode or BOTH.
        chosen = self.rng.choice(STAGINGS if shape.runs <= 16 else STAGINGS[::4])
        staging = mori_tp.staging_for(config) if chosen is None else chosen
        request = shape.request
        check = self.sent % load.verify_every == 0
        # Fresh bytes on the request's source pages, and what they must become on decode.
        item = config.src_item_len
        for buffer in self.src if check else ():
            for page in request.src_pages:
                buffer[page * item:(page + 1) * item] = self.data.integers(0, 256, item,
                                                                           dtype=np.uint8)
        mori_tp.send_kvcache(config, [int(b.ctypes.data) for b in self.src],
                             [int(m.ctypes.data) for m in self.mirror],
                             src_capacity=load.src_capacity, dst_capacity=load.dst_capacity,
                             src_pages=request.src_pages, dst_pages=request.dst_pages,
                             backend="host")
        rid = f"lane{self.index}-{self.sent}"
        self.sent += 1
        need = BUFFERS * mori_tp.staging_len(config, len(request.src_pages))
        remote_slot, token = load.peer.expect(rid, self.index, config, request.dst_pages,
                                              int(staging), need if staging.unpacks else 0)
        local, slot = self.local, None
        if staging.packs:
            slot = load.pool.alloc(need, timeout=STEP_TIMEOUT)
            local = replace(local, staging=slot.address, staging_capacity=slot.size)
        remote = replace(load.peer.memories[self.index], staging=remote_slot,
                         staging_capacity=need if remote_slot else 0)
        plan = plan_request(config, request.src_pages, request.dst_pages, local=local,
                            remote=remote, staging=staging)
        release = (lambda: load.pool.free(slot)) if slot is not None else None
        streamed = self.rng.random() < 0.3
        load.in_flight(+1)
        if barrier is not None:
            barrier.wait(STEP_TIMEOUT)
        start = time.monotonic()
        if streamed:
            mode = "layers"
            stream = load.streamer.open(load.remote, plan, rid, layers=LAYERS, release=release,
                                        token=token)
            order = list(range(LAYERS))
            self.rng.shuffle(order)
            for layer in order:
                stream.submit(layer)
            stream.seal()
            stream.wait()
        else:
            chunks = self.rng.choice((None, 1, 2, 3))
            mode = f"chunks={chunks or 'auto'}"
            load.streamer.send(load.remote, plan, rid, chunks=chunks, release=release,
                               token=token)
        report = load.peer.ended(rid)
        load.in_flight(-1)
        require(report.error is None,
                f"{load.engine}: request {rid} ({shape.layout_name} {p}->{d}, {staging.name}, "
                f"{mode}) failed on the decode side: {report.error}")
        if not check:
            stats.add(shape, mode.split("=")[0], plan.bytes, report.finished_at - start)
            return
        got = load.peer.digest_pages(self.index, config.dst_item_len, request.dst_pages)
        want = digest(pages_of(self.mirror, config.dst_item_len, request.dst_pages))
        require(got == want, f"{load.engine}: request {rid} ({shape.layout_name} {p}->{d}, "
                             f"{staging.name}, {mode}): its decode pages differ from "
                             "send_kvcache's result")
        stats.add(shape, mode.split("=")[0], plan.bytes, report.finished_at - start)
        if load.leak_kib:
            self.leaked.append(np.ones(load.leak_kib * 1024, dtype=np.uint8))


class Load:
    """A prefill process (this one) with LANES lanes and a staging pool, and a decode child
    holding one rank per lane and a pool, joined by one engine pair."""

    def __init__(self, engine: str, lanes: int = LANES, placement: Placement = Placement(),
                 hostname: str = "127.0.0.1") -> None:
        self.engine = engine
        self.shapes = shapes()
        self.src_capacity = max(s.request.src_capacity_pages * s.layout.src_item_len
                                for s in self.shapes)
        self.dst_capacity = max(s.request.dst_capacity_pages * s.layout.dst_item_len
                                for s in self.shapes)
        slot = max(BUFFERS * mori_tp.staging_len(s.config(p, d), len(s.request.src_pages))
                   for s in self.shapes for p, d in s.pairs)
        pool_bytes = lanes * -(-slot // (1 << 16)) * (1 << 16)
        self.driver = driver(engine, hostname)
        self.transport = self.driver.start("prefill")
        self.pool = mori_tp.StagingPool(pool_bytes)
        self.transport.register(KvMemory((), 0, self.pool.address, self.pool.capacity))
        self.peer = StreamPeer(engine, [(BUFFERS, self.dst_capacity)] * lanes, pool_bytes,
                               STEP_TIMEOUT, placement=placement)
        self.remote = self.driver.connect(self.transport, self.peer.address, self.peer.epoch)
        self.peer.connect(self.driver.sender(self.transport))
        self.streamer = Streamer(self.transport, timeout=STEP_TIMEOUT)
        self.lanes = [Lane(self, i) for i in range(lanes)]
        self._lock = threading.Lock()
        self._in_flight = 0
        self.most_in_flight = 0
        #: KiB every request keeps alive (a leak, for --leak-kib).
        self.leak_kib = 0
        #: Check the pages of every n-th request of each lane (1: every request; the
        #: benchmark samples, so that checking does not take the cores from the transfers).
        #: Every byte of every lane is checked by check_all either way.
        self.verify_every = 1

    def in_flight(self, change: int) -> None:
        with self._lock:
            self._in_flight += change
            self.most_in_flight = max(self.most_in_flight, self._in_flight)

    def run(self, work: Any, stats: Stats) -> None:
        """``work(lane, stats)`` on a thread per lane; raises the first failure."""
        errors: List[BaseException] = []

        def body(lane: Lane) -> None:
            try:
                work(lane, stats)
            except BaseException as error:  # noqa: B036 - reported below
                errors.append(error)

        threads = [threading.Thread(target=body, args=(lane,)) for lane in self.lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STEP_TIMEOUT * 4)
        if errors:
            raise errors[0]
        require(not any(t.is_alive() for t in threads), f"{self.engine}: a lane is stuck")

    def burst(self, stats: Stats) -> None:
        """Every lane plans one request, then all send at once."""
        barrier = threading.Barrier(len(self.lanes))
        self.run(lambda lane, s: lane.one(s, barrier), stats)

    def soak(self, seconds: float, stats: Stats) -> None:
        deadline = time.monotonic() + seconds

        def loop(lane: Lane, s: Stats) -> None:
            while time.monotonic() < deadline:
                lane.one(s)

        self.run(loop, stats)

    def check_all(self, what: str) -> None:
        """Every byte of every lane's decode buffers against the mirrors."""
        got = self.peer.digests()
        for lane in self.lanes:
            want = [digest(m) for m in lane.mirror]
            wrong = [b for b, (g, w) in enumerate(zip(got[lane.index], want)) if g != w]
            require(not wrong, f"{self.engine} {what}: lane {lane.index}'s decode buffers "
                               f"{wrong} differ from the mirror (outside a request's pages?)")
        live = self.pool.info().live_slots, self.peer.pool_info()[0]
        require(live == (0, 0), f"{self.engine} {what}: staging slots still live (prefill, "
                                f"decode): {live}")

    def close(self) -> None:
        self.streamer.close()
        self.peer.close()


class Watch:
    """Samples the VmRSS of this process and the decode child every ``interval`` seconds."""

    def __init__(self, pids: Sequence[int], interval: float = 0.5) -> None:
        self.pids, self.interval = list(pids), interval
        self.samples: List[Tuple[float, List[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), [rss_kib(pid) for pid in self.pids]))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.samples.append((time.monotonic(), [rss_kib(pid) for pid in self.pids]))

    def growth(self, since: float) -> List[Tuple[float, float, float, float]]:
        """Per process, over the samples after ``since`` cut in thirds: the median RSS of the
        first third and of the last (MiB), the most (MiB), and the least-squares slope
        (KiB/s). A leak raises the last third's median above the first's; a transient peak
        (16 large requests at once) does not."""
        after = [(t, values) for t, values in self.samples if t >= since]
        if len(after) < 6:
            raise Failure(f"{len(after)} RSS samples after the warm-up: too few to compare")
        third = len(after) // 3
        times = [t for t, _ in after]
        out = []
        for i in range(len(self.pids)):
            ys = [v[i] / 1024 for _, v in after]
            tm, ym = statistics.fmean(times), statistics.fmean(ys)
            var = sum((t - tm) ** 2 for t in times)
            slope = sum((t - tm) * (y - ym) for t, y in zip(times, ys)) / var if var else 0.0
            out.append((statistics.median(ys[:third]), statistics.median(ys[-third:]), max(ys),
                        slope * 1024))
        return out


def summary(stats: Stats, seconds: float) -> str:
    return (f"{stats.requests} requests, {stats.bytes / 1e6:.0f} MB in {seconds:.1f} s: "
            f"{stats.requests / seconds:.0f} requests/s, {stats.bytes / seconds / 1e9:.2f} GB/s, "
            f"p50 {stats.percentile(0.5) * 1e3:.1f} ms, p99 {stats.percentile(0.99) * 1e3:.1f} ms")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine")
    parser.add_argument("--soak-seconds", type=float,
                        default=float(os.environ.get("MORI_TP_SOAK_SECONDS", "30")))
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--rss-tolerance-mib", type=float, default=RSS_TOLERANCE_MIB)
    parser.add_argument("--leak-kib", type=int, default=0,
                        help="every request of the soak keeps this many KiB alive: a leak for "
                             "the RSS check to catch")
    args = parser.parse_args(argv)
    require(0 < args.soak_seconds <= 600, f"--soak-seconds {args.soak_seconds} is outside "
                                          "(0, 600]")
    # The soak, the bursts and the process starts, well under the 600 s tests/python.rs allows.
    status = skip_or_arm(args.engine, int(args.soak_seconds + 240))
    if status is not None:
        return status
    load = Load(args.engine)

    try:
        watch = Watch([os.getpid(), load.peer.pid])
        print(f"{args.engine}: prefill pid {os.getpid()} -> decode child {load.peer.pid}, "
              f"127.0.0.1, {len(load.lanes)} lanes, {len(load.shapes)} request shapes")
        for burst in range(args.bursts):
            stats = Stats()
            start = time.monotonic()
            load.burst(stats)
            load.check_all(f"burst {burst}")
            require(load.most_in_flight == len(load.lanes),
                    f"{args.engine}: at most {load.most_in_flight} requests were in flight")
            print(f"  burst {burst}: {len(load.lanes)} requests in flight at once "
                  f"({', '.join(f'{k} {v}' for k, v in sorted(stats.by_layout.items()))}; "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(stats.by_mode.items()))}), every "
                  f"byte; {summary(stats, time.monotonic() - start)}")
        stats = Stats()
        start = time.monotonic()
        warm = start + max(WARM_UP, args.soak_seconds / 4)
        load.leak_kib = args.leak_kib
        load.soak(args.soak_seconds, stats)
        elapsed = time.monotonic() - start
        load.check_all("soak")
        watch.stop()
        print(f"  soak: {summary(stats, elapsed)}; every byte")
        print(f"    layouts: {', '.join(f'{k} {v}' for k, v in sorted(stats.by_layout.items()))}"
              f"; modes: {', '.join(f'{k} {v}' for k, v in sorted(stats.by_mode.items()))}")
        first = watch.samples[0][1]
        grown = []
        for name, start_kib, (early, late, most, slope) in zip(("prefill", "decode"), first,
                                                               watch.growth(warm)):
            print(f"    RSS {name}: {start_kib / 1024:.0f} MiB at start; after the warm-up "
                  f"median {early:.1f} MiB in the first third, {late:.1f} MiB in the last "
                  f"({late - early:+.1f} MiB, tolerance {args.rss_tolerance_mib} MiB), at most "
                  f"{most:.1f} MiB, slope {slope:+.0f} KiB/s")
            if late - early > args.rss_tolerance_mib:
                grown.append(f"{name} +{late - early:.1f} MiB")
        # Requests between the middles of the first and last thirds after the warm-up.
        between = stats.requests * (elapsed - (warm - start)) / elapsed * 2 / 3
        print(f"    the tolerance catches a leak of more than "
              f"{args.rss_tolerance_mib * 1024 / max(between, 1):.1f} KiB per request in this run")
        require(not grown, f"{args.engine}: RSS grew during the soak: {', '.join(grown)} "
                           f"(tolerance {args.rss_tolerance_mib} MiB)")
    except (Failure, PeerError) as failure:
        print(f"FAILED: {failure}")
        return 1
    finally:
        load.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    run_program(lambda: main(sys.argv[1:]))
