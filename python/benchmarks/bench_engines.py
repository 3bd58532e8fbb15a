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

Then any page layout (``--layout-cases``; ``--only layouts`` runs just these): the same model
and request kept head-major (HND) or token-major (NHD) by both engines, for tp2to8, tp8to2 and
tp2to8 with prefill pages of 16 tokens and decode pages of 64, 4096 tokens: per-token lists (NHD,
one segment per token per buffer, as connectors build them), HND pages to pages without staging
(``hnd-direct``), and NHD with pair_staging_for's staging (``nhd-staged``), interleaved in rounds
the same way, each verified byte for byte against mori_send_kvcache_pair of its own layout.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

import mori_tp
from mori_tp import Staging
from mori_tp.demo import (
    BOTH,
    LAYOUTS,
    METHODS,
    Demo,
    Row,
    Setup,
    first_sender,
    fragmented_pages,
)
from mori_tp.engines import RequestPlan, plan_request
from mori_tp.engines.loopback import ENGINES, engine_available, run_program, sentinel

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
    per-token lists and the direct plan of section 4 run once a round, the others (cheap)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--staged-runs", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0,
                        help="start no new round once the rounds took this many seconds")
    parser.add_argument("--only", choices=("slices", "layouts"), default=None,
                        help="run only the slice-config part or only the layout part")
    parser.add_argument("--layout-cases", nargs="+", choices=list(LAYOUT_CASES),
                        default=list(LAYOUT_CASES))
    parser.add_argument("--layout-tokens", type=int, default=4096)
    args = parser.parse_args()
    print(f"mori-tp {mori_tp.library_version()} ({mori_tp.library_path}), "
          f"Python {platform.python_version()}, {platform.machine()}", flush=True)
    engines = []
    for engine in args.engines:
        problem = engine_available(engine)
        if problem:
            print(f"skipping {engine}: {problem}")
        else:
            engines.append(engine)
    if args.only != "layouts":
        slices(args, engines)
    if args.only != "slices":
        layouts(args, engines)
    return 0


def slices(args: argparse.Namespace, engines: List[str]) -> None:
    """Section-4 slice configs: per-token, direct, staged and staged BOTH."""
    results: List[Tuple[str, str, int, List[Dict[str, Row]]]] = []
    for engine in engines:
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
                      flush=True)
    print()
    print("| engine | layout | tokens | staging | segments per-token / direct / staged | "
          "median time per-token / direct / staged (ms) | staged vs per-token | "
          "staged vs direct | fewer segments | BOTH: segments, time (ms), vs staged | rounds |")
    print("|---|---|---:|---|---|---|---:|---:|---:|---|---:|")
    misses = []
    for engine, layout, tokens, measured in results:
        first = measured[0]
        speedup = median_ratio(measured, "per-token", "staged")
        versus_direct = median_ratio(measured, "direct", "staged")
        fewer = first["per-token"].segments / first["staged"].segments
        print(f"| {engine} | {layout} | {tokens} | {first['staged'].staging} | "
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
    print("targets: " + ("all met" if not misses else "MISSED:\n  " + "\n  ".join(misses)))


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
                  flush=True)
    print()
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
