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
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Dict, List, Tuple

import mori_tp
from mori_tp.demo import BOTH, LAYOUTS, METHODS, Demo, Row, Setup, first_sender
from mori_tp.engines.loopback import ENGINES, engine_available, run_program

TARGET_LAYOUTS = ("tp2to8", "tp8to2")


def rounds(demo: Demo, count: int, staged_runs: int, budget: float) -> List[Dict[str, Row]]:
    """``count`` rounds (fewer past ``budget`` seconds) of every method, interleaved."""
    out: List[Dict[str, Row]] = []
    start = time.monotonic()
    while len(out) < count and (not out or time.monotonic() - start < budget):
        out.append({m: demo.measure(m, 1 if m in ("per-token", "direct") else staged_runs)
                    for m in (*METHODS, BOTH)})
    return out


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
    args = parser.parse_args()
    print(f"mori-tp {mori_tp.library_version()} ({mori_tp.library_path}), "
          f"Python {platform.python_version()}, {platform.machine()}", flush=True)
    results: List[Tuple[str, str, int, List[Dict[str, Row]]]] = []
    for engine in args.engines:
        problem = engine_available(engine)
        if problem:
            print(f"skipping {engine}: {problem}")
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
    return 0


if __name__ == "__main__":
    run_program(main)
