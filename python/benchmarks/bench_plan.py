"""Plan building from Python: mori_tp against the numpy per-token construction serving stacks use.

Today's disaggregation connectors build one (source offset, destination offset, length) triple per
token of every page with numpy broadcasting, then turn the arrays into Python lists for the
transfer engine. This script times that construction and mori_tp's plan functions on the same
inputs, side by side in one run, and prints the ratios:

- array output: numpy per-token arrays vs ``plan_segments(..., as_arrays=True)`` (and ``plan``,
  the rects a 2D-copy engine takes directly);
- list output: numpy per-token arrays + ``.tolist()`` vs ``plan_segments(...)`` lists.

Run from the repository root (numpy is needed here, never by the package itself):

    cargo build --release
    python3 -m pip install numpy
    PYTHONPATH=python python3 python/benchmarks/bench_plan.py [--quick]

Progress goes to stderr; stdout ends with a line ``== results ==`` and a Markdown table, which
``benches/regenerate`` pastes into BENCHMARKS.md.
"""

import argparse
import sys
import time
from typing import Callable, List, Tuple

import numpy as np

import mori_tp

HEAD_BYTES = 128 * 2  # Llama-3.1-70B: head_dim 128, bf16


def config(page_size: int) -> mori_tp.SliceConfig:
    """Llama-3.1-70B (8 KV heads) from prefill TP 4 to decode TP 8: one head of each 2-head token."""
    return mori_tp.slice_config(
        prefill_tp_size=4, prefill_tp_rank=1, decode_tp_size=8, decode_tp_rank=3,
        total_kv_heads=8, page_size=page_size,
        src_item_len=page_size * 2 * HEAD_BYTES, dst_item_len=page_size * HEAD_BYTES,
    )


def request(pages: int, fragmented: bool, seed: int = 7) -> Tuple[np.ndarray, np.ndarray]:
    """Page indices as int32 arrays: one run, or runs of 1-16 pages with gaps on each side."""
    if not fragmented:
        return np.arange(pages, dtype=np.int32), np.arange(pages, dtype=np.int32)
    rng = np.random.default_rng(seed)
    src: List[int] = []
    dst: List[int] = []
    s = d = 0
    while len(src) < pages:
        run = min(int(rng.integers(1, 17)), pages - len(src))
        s += int(rng.integers(0, 3))
        d += int(rng.integers(0, 3))
        src.extend(range(s, s + run))
        dst.extend(range(d, d + run))
        s += run
        d += run
    return np.asarray(src, dtype=np.int32), np.asarray(dst, dtype=np.int32)


def numpy_per_token(c: mori_tp.SliceConfig, src: np.ndarray, dst: np.ndarray):
    """The serving stacks' construction: broadcast page bases over token slots, flatten."""
    slots = np.arange(c.page_size, dtype=np.int64)
    local = (src.astype(np.int64)[:, None] * c.src_item_len
             + slots[None, :] * c.bytes_per_token_src + c.src_head_slice_offset).reshape(-1)
    remote = (dst.astype(np.int64)[:, None] * c.dst_item_len
              + slots[None, :] * c.bytes_per_token_dst + c.dst_head_slice_offset).reshape(-1)
    sizes = np.full(local.shape, c.heads_bytes_per_token_to_send, dtype=np.int64)
    return local, remote, sizes


def numpy_per_token_lists(c: mori_tp.SliceConfig, src: np.ndarray, dst: np.ndarray):
    local, remote, sizes = numpy_per_token(c, src, dst)
    return local.tolist(), remote.tolist(), sizes.tolist()


def best_of(fn: Callable[[], object], seconds: float = 0.3) -> float:
    """Fastest of repeated calls: the least disturbed by a shared, noisy machine."""
    fn()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="time each measurement repeats for (the fastest call counts)")
    parser.add_argument("--quick", action="store_true",
                        help="32k tokens only, 0.02 s per measurement: checks that it runs")
    args = parser.parse_args()
    seconds = 0.02 if args.quick else args.seconds
    token_counts = (32 * 1024,) if args.quick else (32 * 1024, 128 * 1024)
    print(f"mori_tp {mori_tp.library_version()} from {mori_tp.library_path}, "
          f"numpy {np.__version__}", file=sys.stderr)
    rows = []
    worst_array = float("inf")
    for tokens in token_counts:
        for page_size in (1, 16):
            for fragmented in (False, True):
                c = config(page_size)
                src, dst = request(tokens // page_size, fragmented)
                # Same bytes, offset for offset: the comparison is only fair if this holds.
                ours = mori_tp.plan_segments(c, src, dst, as_arrays=True)
                theirs = numpy_per_token(c, src, dst)
                assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
                rects = len(mori_tp.plan(c, src, dst, as_arrays=True))

                t_np = best_of(lambda: numpy_per_token(c, src, dst), seconds)
                t_np_list = best_of(lambda: numpy_per_token_lists(c, src, dst), seconds)
                t_segs_arr = best_of(lambda: mori_tp.plan_segments(c, src, dst, as_arrays=True),
                                     seconds)
                t_rects_arr = best_of(lambda: mori_tp.plan(c, src, dst, as_arrays=True), seconds)
                t_segs_list = best_of(lambda: mori_tp.plan_segments(c, src, dst), seconds)
                worst_array = min(worst_array, t_np_list / t_segs_arr, t_np_list / t_rects_arr)

                def cell(t: float) -> str:
                    return f"{t * 1e6:.0f} us, {t_np_list / t:.1f}x"

                name = (f"{tokens // 1024}k, page {page_size}, "
                        f"{'fragmented' if fragmented else 'contiguous'}")
                rows.append(f"| {name} | {len(theirs[0])} | {rects} | {t_np_list * 1e6:.0f} us | "
                            f"{cell(t_np)} | {cell(t_segs_arr)} | {cell(t_rects_arr)} | "
                            f"{cell(t_segs_list)} |")
                print(rows[-1], file=sys.stderr, flush=True)
    # benches/regenerate pastes what follows this line into BENCHMARKS.md.
    print("== results ==\n")
    print("Llama-3.1-70B KV (8 heads x 128 x bf16), prefill TP 4 -> decode TP 8, one layer "
          "buffer; times: the fastest of repeated calls; x: the numpy per-token construction "
          "ending in lists, divided by the time shown (above 1: faster than it):\n")
    print("| request | segments | rects | numpy per-token, lists | numpy per-token, arrays | "
          "`plan_segments(as_arrays=True)` | `plan(as_arrays=True)` | `plan_segments` lists |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(f"\nArray output against numpy per-token lists: {worst_array:.1f}x or more in every "
          "case (target: 10x).")


if __name__ == "__main__":
    main()
