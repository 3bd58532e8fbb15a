"""Helpers for the tests of any page layout (mori_tp.Layout, PairConfig, Request): deployments
whose two sides keep pages differently, their requests, and an oracle restated from the
documented formulas that copies element by element and finds the segments of every order
itself. Nothing here calls the pair functions it checks, except to build layouts by hand."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mori_tp
from layouts import _lay_out, owned_heads, sender
from mori_tp import Action, CopyRect, Staging

#: How a side keeps a page: token-major, head-major, token-major with a page header and padded
#: token slots, or head-major with each head holding its own run of pages (vLLM's LHBNC).
KINDS = ("nhd", "hnd", "padded", "outside")


def local_heads(heads: int, tp: int) -> int:
    return len(owned_heads(heads, tp, 0))


def make_layout(kind: str, heads: int, tp: int, rank: int, page_size: int, head_bytes: int,
                pages: int) -> mori_tp.Layout:
    """One rank's layout of ``kind``; ``pages`` is the page count of a buffer (the run each head
    holds when heads are outside pages)."""
    if kind == "nhd":
        return mori_tp.Layout.nhd(heads, tp, rank, page_size, head_bytes)
    if kind == "hnd":
        return mori_tp.Layout.hnd(heads, tp, rank, page_size, head_bytes)
    n = local_heads(heads, tp)
    if kind == "padded":
        token_stride = n * head_bytes + 3
        return mori_tp.Layout(heads, tp, rank, page_size, head_bytes,
                              page_stride=16 + page_size * token_stride + 5, offset=16,
                              token_stride=token_stride, head_stride=head_bytes)
    if kind == "outside":
        page_stride = page_size * head_bytes
        return mori_tp.Layout(heads, tp, rank, page_size, head_bytes, page_stride=page_stride,
                              offset=0, token_stride=head_bytes, head_stride=pages * page_stride)
    raise ValueError(f"unknown layout kind {kind!r}")


def extent(layout: mori_tp.Layout) -> int:
    """Bytes from a page's start to the end of its last element."""
    n = local_heads(layout.total_kv_heads, layout.tp_size)
    return (layout.offset + (layout.page_size - 1) * layout.token_stride
            + (n - 1) * layout.head_stride + layout.head_bytes)


def capacity(layout: mori_tp.Layout, pages: int) -> int:
    """Bytes of a buffer holding ``pages`` pages of ``layout``."""
    return (pages - 1) * layout.page_stride + extent(layout)


def element(layout: mori_tp.Layout, page: int, slot: int, local: int) -> int:
    return page * layout.page_stride + layout.offset + slot * layout.token_stride \
        + local * layout.head_stride


def head_major(layout: mori_tp.Layout) -> bool:
    return layout.page_size > 1 and layout.head_stride > layout.token_stride


@dataclass(frozen=True)
class Moved:
    """What a pair moves by the ownership rule, found by search: the action, the moved global
    heads and where the first sits among each rank's local heads."""

    action: Action
    heads: range
    src_first_local: int
    dst_first_local: int


def moved(heads: int, p_tp: int, p: int, d_tp: int, d: int) -> Moved:
    src, dst = owned_heads(heads, p_tp, p), owned_heads(heads, d_tp, d)
    shared = range(max(src.start, dst.start), min(src.stop, dst.stop))
    if not shared:
        return Moved(Action.NOT_PAIRED, range(0), 0, 0)
    sent = [h for h in shared if sender(heads, p_tp, d_tp, d, h) == p]
    if not sent:
        return Moved(Action.SKIP_REPLICA, range(0), 0, 0)
    assert sent == list(range(sent[0], sent[-1] + 1)), "a pair moves consecutive heads"
    return Moved(Action.SEND, range(sent[0], sent[-1] + 1), sent[0] - src.start,
                 sent[0] - dst.start)


@dataclass
class Request:
    """A request's tokens, each side's pages and each side's buffer size in pages."""

    num_tokens: int
    src_pages: List[int]
    dst_pages: List[int]
    src_capacity_pages: int
    dst_capacity_pages: int

    def api(self) -> mori_tp.Request:
        return mori_tp.Request(self.src_pages, self.dst_pages, self.num_tokens)


def scattered_pages(rng: random.Random, count: int) -> Tuple[List[int], int]:
    """``count`` distinct pages in runs of 1..3, the runs shuffled and spaced apart; and the
    pages a buffer needs to hold them."""
    lengths: List[int] = []
    while sum(lengths) < count:
        lengths.append(min(rng.randint(1, 3), count - sum(lengths)))
    starts, pages = _lay_out(rng, lengths)
    out: List[int] = []
    for start, length in zip(starts, lengths):
        out.extend(range(start, start + length))
    return out, max(pages, 1)


@dataclass(frozen=True)
class Deployment:
    """Prefill and decode engines that keep pages differently: KV heads, TP sizes, and each
    side's layout kind and page size."""

    name: str
    heads: int
    p_tp: int
    d_tp: int
    src_kind: str
    src_page_size: int
    dst_kind: str
    dst_page_size: int
    head_bytes: int = 8

    def request(self, num_tokens: int, seed: int) -> Request:
        rng = random.Random(seed)
        src, src_cap = scattered_pages(rng, -(-num_tokens // self.src_page_size))
        dst, dst_cap = scattered_pages(rng, -(-num_tokens // self.dst_page_size))
        return Request(num_tokens, src, dst, src_cap, dst_cap)

    def layouts(self, p: int, d: int, request: Request) -> Tuple[mori_tp.Layout, mori_tp.Layout]:
        return (make_layout(self.src_kind, self.heads, self.p_tp, p, self.src_page_size,
                            self.head_bytes, request.src_capacity_pages),
                make_layout(self.dst_kind, self.heads, self.d_tp, d, self.dst_page_size,
                            self.head_bytes, request.dst_capacity_pages))

    def pairs(self):
        for p in range(self.p_tp):
            for d in range(self.d_tp):
                yield p, d

    def moved(self, p: int, d: int) -> Moved:
        return moved(self.heads, self.p_tp, p, self.d_tp, d)


def send(src_layout: mori_tp.Layout, dst_layout: mori_tp.Layout, what: Moved, request: Request,
         src: bytes, dst: bytearray) -> None:
    """The oracle's transfer into ``dst``: every moved head of every token, one by one."""
    hb = src_layout.head_bytes
    for k in range(request.num_tokens):
        for j in range(len(what.heads)):
            s = element(src_layout, request.src_pages[k // src_layout.page_size],
                        k % src_layout.page_size, what.src_first_local + j)
            t = element(dst_layout, request.dst_pages[k // dst_layout.page_size],
                        k % dst_layout.page_size, what.dst_first_local + j)
            dst[t:t + hb] = src[s:s + hb]


def packed(src_layout: mori_tp.Layout, what: Moved, request: Request, src: bytes) -> bytes:
    """One buffer's part of a token-major staging region (BOTH): element (k, j) at
    ``(k * n + j) * head_bytes``."""
    hb = src_layout.head_bytes
    out = bytearray()
    for k in range(request.num_tokens):
        for j in range(len(what.heads)):
            s = element(src_layout, request.src_pages[k // src_layout.page_size],
                        k % src_layout.page_size, what.src_first_local + j)
            out += src[s:s + hb]
    return bytes(out)


def elements(tokens: int, heads: int, chunk: Optional[int]) -> List[Tuple[int, int]]:
    """The (token, head) elements token-major (``chunk`` None) or head-major in chunks."""
    if chunk is None:
        return [(k, j) for k in range(tokens) for j in range(heads)]
    out = []
    for start in range(0, tokens, chunk):
        stop = min(start + chunk, tokens)
        out += [(k, j) for j in range(heads) for k in range(start, stop)]
    return out


def order_segments(src_layout: mori_tp.Layout, dst_layout: mori_tp.Layout, what: Moved,
                   request: Request) -> List[List[List[int]]]:
    """Pages to pages, the segments of each order: token-major, then head-major in chunks of
    the prefill page size, the decode page size and the whole request. A segment is a run of
    elements contiguous on both sides, as [source offset, destination offset, length]."""
    hb = src_layout.head_bytes
    orders = []
    for chunk in (None, src_layout.page_size, dst_layout.page_size,
                  max(request.num_tokens, 1)):
        out: List[List[int]] = []
        for k, j in elements(request.num_tokens, len(what.heads), chunk):
            s = element(src_layout, request.src_pages[k // src_layout.page_size],
                        k % src_layout.page_size, what.src_first_local + j)
            t = element(dst_layout, request.dst_pages[k // dst_layout.page_size],
                        k % dst_layout.page_size, what.dst_first_local + j)
            if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == t:
                out[-1][2] += hb
            else:
                out.append([s, t, hb])
        orders.append(out)
    return orders


def _columns(segments: List[List[int]]) -> Tuple[List[int], List[int], List[int]]:
    return ([s for s, _, _ in segments], [t for _, t, _ in segments],
            [n for _, _, n in segments])


def segments(src_layout: mori_tp.Layout, dst_layout: mori_tp.Layout, what: Moved,
             request: Request) -> Tuple[List[int], List[int], List[int]]:
    """The segments of the order with the fewest (ties to the first listed)."""
    orders = order_segments(src_layout, dst_layout, what, request)
    fewest = min(len(o) for o in orders)
    return _columns(next(o for o in orders if len(o) == fewest))


def rects(src_layout: mori_tp.Layout, dst_layout: mori_tp.Layout, what: Moved,
          request: Request) -> List[CopyRect]:
    """pair_plan's rects: among the orders whose segments are fewest, the greedy rects of the
    one whose rects are fewest (ties to the first listed)."""
    orders = order_segments(src_layout, dst_layout, what, request)
    fewest = min(len(o) for o in orders)
    candidates = [greedy_rects(*_columns(o)) for o in orders if len(o) == fewest]
    least = min(len(r) for r in candidates)
    return next(r for r in candidates if len(r) == least)


def greedy_rects(local: List[int], remote: List[int], sizes: List[int]) -> List[CopyRect]:
    """Segments grouped from the front into rects: a rect grows while the next segment has its
    width and both offsets advance by its pitches, which its second segment fixes (when both
    are at least the width)."""
    rects: List[CopyRect] = []
    for s, t, n in zip(local, remote, sizes):
        if rects and rects[-1].width == n:
            r = rects[-1]
            last_s = r.src_offset + (r.height - 1) * r.src_pitch
            last_t = r.dst_offset + (r.height - 1) * r.dst_pitch
            if r.height == 1 and s - last_s >= n and t - last_t >= n:
                rects[-1] = r._replace(src_pitch=s - last_s, dst_pitch=t - last_t, height=2)
                continue
            if r.height > 1 and (s - last_s, t - last_t) == (r.src_pitch, r.dst_pitch):
                rects[-1] = r._replace(height=r.height + 1)
                continue
        rects.append(CopyRect(s, t, n, n, n, 1))
    return rects


def full(layout: mori_tp.Layout, n: int, token_major: bool) -> bool:
    """Whether a side's pages hold the moved heads and nothing else, back to back in an order."""
    ps, hb = layout.page_size, layout.head_bytes
    if layout.page_stride != ps * n * hb:
        return False
    if token_major:
        return ((n == 1 or layout.head_stride == hb)
                and (ps == 1 or layout.token_stride == n * hb))
    return ((ps == 1 or layout.token_stride == hb)
            and (n == 1 or layout.head_stride == ps * hb))


def staging_for(src_layout: mori_tp.Layout, dst_layout: mori_tp.Layout, what: Moved) -> Staging:
    """The documented rule: stage nothing when both sides are full in one order (head-major
    also with one page size), else only the decode side when the prefill side is full in some
    order, else only the prefill side when the decode side is, else both."""
    if what.action is not Action.SEND:
        return Staging.NONE
    n = len(what.heads)
    if full(src_layout, n, True) and full(dst_layout, n, True):
        return Staging.NONE
    if (full(src_layout, n, False) and full(dst_layout, n, False)
            and src_layout.page_size == dst_layout.page_size):
        return Staging.NONE
    if full(src_layout, n, True) or full(src_layout, n, False):
        return Staging.DST
    if full(dst_layout, n, True) or full(dst_layout, n, False):
        return Staging.SRC
    return Staging.BOTH
