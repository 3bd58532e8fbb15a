"""Helpers shared by the Python tests: REFERENCE.md's head ownership restated independently of
the library, the head arithmetic serving stacks use today, deterministic fragmented requests,
and KV buffers whose bytes say what they hold."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Dict, List, Tuple

import mori_tp

def tools_required() -> bool:
    """Whether a missing optional tool (numpy, an engine) must fail instead of skipping: CI sets
    MORI_TP_REQUIRE_TOOLS to anything but empty or 0, as the Rust tests read it."""
    return os.environ.get("MORI_TP_REQUIRE_TOOLS", "") not in ("", "0")


NOT_PAIRED, SEND, SKIP_REPLICA = (
    mori_tp.Action.NOT_PAIRED,
    mori_tp.Action.SEND,
    mori_tp.Action.SKIP_REPLICA,
)


def valid_tp(heads: int, tp: int) -> bool:
    """REFERENCE.md section 3: H and T divide one way or the other."""
    return heads % tp == 0 or tp % heads == 0


def valid_tp_sizes(heads: int, largest: int = 16) -> List[int]:
    return [tp for tp in range(1, largest + 1) if valid_tp(heads, tp)]


def owned_heads(heads: int, tp: int, rank: int) -> range:
    """The global heads rank ``rank`` owns, in the order they sit inside a token."""
    if tp <= heads:
        per = heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // heads)
    return range(head, head + 1)


def first_owner(heads: int, tp: int, head: int) -> int:
    """The lowest rank owning ``head``, found by search rather than by formula."""
    return next(rank for rank in range(tp) if head in owned_heads(heads, tp, rank))


def sender(heads: int, p_tp: int, d_tp: int, decode_rank: int, head: int) -> int:
    """``sender(d, h) = first(P, h) + (j * rS) / rD``, REFERENCE.md section 3."""
    r_s, r_d = max(1, p_tp // heads), max(1, d_tp // heads)
    j = decode_rank - first_owner(heads, d_tp, head)
    return first_owner(heads, p_tp, head) + (j * r_s) // r_d


@dataclass(frozen=True)
class Layout:
    """A deployment: KV heads, TP sizes, tokens per page and bytes per head."""

    heads: int
    p_tp: int
    d_tp: int
    page_size: int
    bytes_per_head: int

    def bytes_per_token(self, tp: int) -> int:
        return len(owned_heads(self.heads, tp, 0)) * self.bytes_per_head

    def item_len(self, tp: int) -> int:
        return self.page_size * self.bytes_per_token(tp)

    @property
    def src_item_len(self) -> int:
        return self.item_len(self.p_tp)

    @property
    def dst_item_len(self) -> int:
        return self.item_len(self.d_tp)

    def config(self, p: int, d: int) -> mori_tp.SliceConfig:
        return mori_tp.slice_config(
            prefill_tp_size=self.p_tp,
            prefill_tp_rank=p,
            decode_tp_size=self.d_tp,
            decode_tp_rank=d,
            total_kv_heads=self.heads,
            page_size=self.page_size,
            src_item_len=self.src_item_len,
            dst_item_len=self.dst_item_len,
        )

    def pairs(self):
        for p in range(self.p_tp):
            for d in range(self.d_tp):
                yield p, d


def stack_head_slice(layout: Layout, p: int, d: int) -> Tuple[bool, int, int, int]:
    """The head arithmetic of today's serving connectors, for layouts where it is right (both TP
    sizes at most H, one dividing the other): whether p sends to d, and the source offset, the
    destination offset and the width of the slice in bytes."""
    heads, p_tp, d_tp, bph = layout.heads, layout.p_tp, layout.d_tp, layout.bytes_per_head
    assert p_tp <= heads and d_tp <= heads and (p_tp % d_tp == 0 or d_tp % p_tp == 0)
    src_heads, dst_heads = heads // p_tp, heads // d_tp
    if p_tp > d_tp:
        group = p_tp // d_tp  # prefill ranks that fill one decode rank
        return p // group == d, 0, (p % group) * src_heads * bph, src_heads * bph
    group = d_tp // p_tp  # decode ranks that one prefill rank fills
    return d // group == p, (d * dst_heads) % src_heads * bph, 0, dst_heads * bph


def per_token_segments(
    config: mori_tp.SliceConfig,
    src_pages: List[int],
    dst_pages: List[int],
    src_offset: int,
    dst_offset: int,
    width: int,
) -> Tuple[List[int], List[int], List[int]]:
    """The per-token list serving stacks build today: for each page pair and token slot,
    ``page * item_len + slot * bytes_per_token + head_slice_offset`` on each side."""
    local, remote, sizes = [], [], []
    for src_page, dst_page in zip(src_pages, dst_pages):
        for slot in range(config.page_size):
            local.append(src_page * config.src_item_len + slot * config.bytes_per_token_src
                         + src_offset)
            remote.append(dst_page * config.dst_item_len + slot * config.bytes_per_token_dst
                          + dst_offset)
            sizes.append(width)
    return local, remote, sizes


def byte_map(local: List[int], remote: List[int], sizes: List[int]) -> Dict[int, int]:
    """Destination byte -> source byte of a list of segments; a byte written twice fails."""
    mapping: Dict[int, int] = {}
    for src, dst, length in zip(local, remote, sizes):
        for k in range(length):
            assert dst + k not in mapping, f"destination byte {dst + k} written twice"
            mapping[dst + k] = src + k
    return mapping


@dataclass
class Request:
    """Paired page indices and the pages each side's buffers hold."""

    src_pages: List[int]
    dst_pages: List[int]
    src_capacity_pages: int
    dst_capacity_pages: int


def _lay_out(rng: random.Random, lengths: List[int]) -> Tuple[List[int], int]:
    order = list(range(len(lengths)))
    rng.shuffle(order)
    starts = [0] * len(lengths)
    position = rng.randint(0, 2)
    for run in order:
        starts[run] = position
        position += lengths[run] + rng.randint(0, 2)
    return starts, position + 1


def fragmented_request(seed: int, runs: int) -> Request:
    """``runs`` runs of 1..4 pages, each contiguous on both sides, laid out in shuffled order with
    gaps, independently on each side; the same seed gives the same request."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 4) for _ in range(runs)]
    src_starts, src_capacity = _lay_out(rng, lengths)
    dst_starts, dst_capacity = _lay_out(rng, lengths)
    request = Request([], [], src_capacity, dst_capacity)
    for run, length in enumerate(lengths):
        request.src_pages.extend(range(src_starts[run], src_starts[run] + length))
        request.dst_pages.extend(range(dst_starts[run], dst_starts[run] + length))
    return request


def head_bytes(bytes_per_head: int, buffer: int, page: int, token: int, head: int) -> bytes:
    """The bytes of one head of one token: four that identify it, then a ramp."""
    key = bytes((buffer, page, token, head))
    ramp = bytes(range(4, bytes_per_head))
    return (key + ramp)[:bytes_per_head]


def identified_buffer(layout: Layout, tp: int, rank: int, buffer: int, pages: int) -> bytearray:
    """A source buffer whose every head slot holds its identifying bytes."""
    owned = owned_heads(layout.heads, tp, rank)
    out = bytearray()
    for page in range(pages):
        for token in range(layout.page_size):
            for head in owned:
                out += head_bytes(layout.bytes_per_head, buffer, page, token, head)
    return out


def sentinel_buffer(rank: int, buffer: int, length: int) -> bytes:
    """Bytes that depend on rank, buffer and position and on no head; the prime period never
    lines up with head or token boundaries."""
    period = bytes((0xA5 ^ (rank * 7) ^ (buffer * 13) ^ (i * 31)) & 0xFF for i in range(251))
    return (period * (length // len(period) + 1))[:length]


def expected_decode_buffer(
    layout: Layout, rank: int, buffer: int, initial: bytes, request: Request
) -> bytes:
    """What a decode buffer must hold after every pair has sent: its initial bytes everywhere
    except its own heads of the requested pages, which hold the source's identifying bytes."""
    bph = layout.bytes_per_head
    item, bpt = layout.dst_item_len, layout.bytes_per_token(layout.d_tp)
    out = bytearray(initial)
    for src_page, dst_page in zip(request.src_pages, request.dst_pages):
        for token in range(layout.page_size):
            for k, head in enumerate(owned_heads(layout.heads, layout.d_tp, rank)):
                at = dst_page * item + token * bpt + k * bph
                out[at:at + bph] = head_bytes(bph, buffer, src_page, token, head)
    return bytes(out)
