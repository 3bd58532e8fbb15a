"""Per-token lists vs mori-tp direct vs mori-tp staged, through real transfer engines between two
processes on 127.0.0.1, for the four layouts of ``mori_tp.demo`` at 4096 and 16384 tokens, 8
layers (16 buffers), page size 16, 256-byte heads, fragmented pages (runs of 1-16 pages).

    cargo build --release
    PYTHONPATH=python python3 python/benchmarks/bench_engines.py [--engines mooncake nixl]

Every run is verified byte for byte (as in the demo). Each method runs up to ``--repeat`` times
(fewer when one run takes over ``--budget`` seconds) and the fastest run counts: the machines
are shared, so the fastest run is the one least disturbed. Prints a Markdown table of ratios
measured in the same run, and whether the targets hold:
staged >= 10x faster than per-token on tp2to8 and tp8to2, >= 20x fewer segments there, and
staged never slower than direct.
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Dict, List, Tuple

import mori_tp
from mori_tp.demo import LAYOUTS, METHODS, Demo, Row, Setup, first_sender
from mori_tp.engines.loopback import ENGINES, engine_available

TARGET_LAYOUTS = ("tp2to8", "tp8to2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--budget", type=float, default=10.0,
                        help="stop repeating a method once its runs took this many seconds")
    args = parser.parse_args()
    print(f"mori-tp {mori_tp.library_version()} ({mori_tp.library_path}), "
          f"Python {platform.python_version()}, {platform.machine()}", flush=True)
    results: List[Tuple[str, str, int, Dict[str, Row]]] = []
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
                    rows = {m: demo.measure(m, args.repeat, args.budget) for m in METHODS}
                finally:
                    demo.close()
                results.append((engine, layout, tokens, rows))
                print(f"{engine:8} {layout:8} {tokens:6} tokens: " + ", ".join(
                    f"{m} {r.segments} segs {r.best * 1e3:.1f} ms ({len(r.seconds)} runs)"
                    for m, r in rows.items()), flush=True)
    print()
    print("| engine | layout | tokens | staging | segments per-token / direct / staged | "
          "time per-token / direct / staged (ms) | staged vs per-token | staged vs direct | "
          "fewer segments | staged GB/s |")
    print("|---|---|---:|---|---|---|---:|---:|---:|---:|")
    misses = []
    for engine, layout, tokens, rows in results:
        token, direct, staged = rows["per-token"], rows["direct"], rows["staged"]
        speedup = token.best / staged.best
        versus_direct = direct.best / staged.best
        fewer = token.segments / staged.segments
        print(f"| {engine} | {layout} | {tokens} | {staged.staging} | {token.segments} / "
              f"{direct.segments} / {staged.segments} | {token.best * 1e3:.1f} / "
              f"{direct.best * 1e3:.1f} / {staged.best * 1e3:.1f} | {speedup:.1f}x | "
              f"{versus_direct:.1f}x | {fewer:.0f}x | {staged.bytes / staged.best / 1e9:.2f} |")
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
    sys.exit(main())
