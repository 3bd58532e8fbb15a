"""Any page layout through the Python API: mori_tp.Layout, pair_config, Request and the pair
functions, against the element-by-element oracle of pair_oracle.py, for NHD, HND, mixed, padded
and heads-outside-pages layouts, page sizes 16 -> 64 and 64 -> 16, and partial last pages:
every destination byte (untouched ones included), the segment list and the rects, the
composition law in all four staging modes, refusals with their classes and the library's
messages, and numpy outputs equal to list outputs."""

from __future__ import annotations

import array
import ctypes
import dataclasses
import unittest
from typing import List, Tuple

import mori_tp
import pair_oracle as oracle
from layouts import tools_required
from mori_tp import Action, CopyRect, Staging
from pair_oracle import Deployment

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

BUFFERS = 2

#: (deployment, tokens): every kind of side, both page-size mismatches, partial last pages.
CASES: List[Tuple[Deployment, int]] = [
    (Deployment("nhd tp2to8", 4, 2, 8, "nhd", 16, "nhd", 16), 5 * 16),
    (Deployment("hnd tp2to8", 4, 2, 8, "hnd", 16, "hnd", 16), 6 * 16),
    (Deployment("hnd tp8to2", 8, 8, 2, "hnd", 16, "hnd", 16), 4 * 16),
    (Deployment("nhd to hnd tp4to2", 8, 4, 2, "nhd", 16, "hnd", 16), 70),
    (Deployment("hnd to nhd 16 to 64", 4, 2, 4, "hnd", 16, "nhd", 64), 150),
    (Deployment("nhd 64 to 16", 4, 4, 2, "nhd", 64, "nhd", 16), 130),
    (Deployment("hnd 64 to 16", 8, 2, 8, "hnd", 64, "hnd", 16), 77),
    (Deployment("padded to heads outside pages", 8, 2, 2, "padded", 16, "outside", 16), 45),
    (Deployment("replicated h2 tp6to4", 2, 6, 4, "hnd", 16, "nhd", 64), 33),
    (Deployment("mla nhd to hnd 16 to 64", 1, 4, 2, "nhd", 16, "hnd", 64), 100),
]


def c_buffer(data: bytes) -> ctypes.Array:
    return (ctypes.c_ubyte * len(data)).from_buffer_copy(data)


def noise(seed: int, length: int) -> bytes:
    """Bytes in which every 8-byte head is different."""
    import random

    return random.Random(seed).randbytes(length)


class Pair:
    """One pair of a deployment: its layouts and config, source buffers of noise, destination
    buffers of other noise, and what the oracle leaves in them."""

    def __init__(self, deployment: Deployment, p: int, d: int, tokens: int, seed: int) -> None:
        self.request = deployment.request(tokens, seed)
        self.prefill, self.decode = deployment.layouts(p, d, self.request)
        self.config = mori_tp.pair_config(self.prefill, self.decode)
        self.moved = deployment.moved(p, d)
        self.api = self.request.api()
        self.src_len = oracle.capacity(self.prefill, self.request.src_capacity_pages)
        self.dst_len = oracle.capacity(self.decode, self.request.dst_capacity_pages)
        self.sources = [noise(seed * 100 + b, self.src_len) for b in range(BUFFERS)]
        self.initial = [noise(seed * 100 + 50 + b, self.dst_len) for b in range(BUFFERS)]
        self.src = [c_buffer(s) for s in self.sources]
        self.staging_len = mori_tp.pair_staging_len(self.config, tokens)

    def expected(self) -> List[bytes]:
        out = []
        for source, initial in zip(self.sources, self.initial):
            dst = bytearray(initial)
            oracle.send(self.prefill, self.decode, self.moved, self.request, source, dst)
            out.append(bytes(dst))
        return out

    def src_ptrs(self) -> List[int]:
        return [ctypes.addressof(s) for s in self.src]

    def fresh(self) -> List[ctypes.Array]:
        return [c_buffer(data) for data in self.initial]

    def sent(self, **options) -> List[bytes]:
        dst = self.fresh()
        mori_tp.send_kvcache_pair(self.config, self.src_ptrs(), [ctypes.addressof(x) for x in dst],
                                  src_capacity=self.src_len, dst_capacity=self.dst_len,
                                  request=self.api, backend="host", **options)
        return [bytes(x) for x in dst]

    def staged(self, staging: Staging) -> Tuple[List[bytes], int, bytes]:
        """The destinations after pack, every segment of every buffer, unpack; the segments
        per buffer; and the prefill rank's staging region."""
        dst = self.fresh()
        region_len = max(1, BUFFERS * self.staging_len)
        src_region = (ctypes.c_ubyte * region_len)()
        dst_region = (ctypes.c_ubyte * region_len)(*([0xEE] * region_len))
        if staging.packs:
            mori_tp.pack_kvcache_pair(self.config, staging, self.src_ptrs(),
                                      ctypes.addressof(src_region), staging_capacity=region_len,
                                      src_capacity=self.src_len, request=self.api,
                                      backend="host")
        local, remote, sizes = mori_tp.pair_segments(self.config, self.api, staging)
        for b in range(BUFFERS):
            src_base = (ctypes.addressof(src_region) + b * self.staging_len if staging.packs
                        else ctypes.addressof(self.src[b]))
            dst_base = (ctypes.addressof(dst_region) + b * self.staging_len if staging.unpacks
                        else ctypes.addressof(dst[b]))
            for s, t, n in zip(local, remote, sizes):
                ctypes.memmove(dst_base + t, src_base + s, n)
        if staging.unpacks:
            mori_tp.unpack_kvcache_pair(self.config, staging, ctypes.addressof(dst_region),
                                        [ctypes.addressof(x) for x in dst],
                                        staging_capacity=region_len, dst_capacity=self.dst_len,
                                        request=self.api, backend="host")
        return [bytes(x) for x in dst], len(sizes), bytes(src_region)

    def planned(self) -> List[bytes]:
        """The destinations after copying every rect of pair_plan, row by row."""
        dst = self.fresh()
        for b in range(BUFFERS):
            for r in mori_tp.pair_plan(self.config, self.api):
                for row in range(r.height):
                    ctypes.memmove(ctypes.addressof(dst[b]) + r.dst_offset + row * r.dst_pitch,
                                   ctypes.addressof(self.src[b]) + r.src_offset
                                   + row * r.src_pitch, r.width)
        return [bytes(x) for x in dst]


def first_difference(got: bytes, want: bytes) -> int:
    return next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)


class LayoutTest(unittest.TestCase):
    def test_nhd_and_hnd_are_the_documented_strides(self):
        for heads, tp, rank in ((4, 2, 1), (4, 8, 5), (1, 4, 3), (12, 6, 2)):
            n = oracle.local_heads(heads, tp)
            self.assertEqual(mori_tp.Layout.nhd(heads, tp, rank, 16, 256),
                             mori_tp.Layout(heads, tp, rank, 16, 256, page_stride=16 * n * 256,
                                            offset=0, token_stride=n * 256, head_stride=256))
            self.assertEqual(mori_tp.Layout.hnd(total_kv_heads=heads, tp_size=tp, tp_rank=rank,
                                                page_size=16, head_bytes=256),
                             mori_tp.Layout(heads, tp, rank, 16, 256, page_stride=n * 16 * 256,
                                            offset=0, token_stride=256, head_stride=16 * 256))

    def test_bad_layouts_are_refused_with_the_library_message(self):
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                    "^mori_tp_layout_nhd: .*tp_rank 2 .*tp_size 2"):
            mori_tp.Layout.nhd(4, 2, 2, 16, 256)
        with self.assertRaisesRegex(mori_tp.TopologyError,
                                    "^mori_tp_layout_hnd: .*tp_size 2 and total_kv_heads 3 "
                                    "divide neither way"):
            mori_tp.Layout.hnd(3, 2, 0, 16, 256)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                    "^mori_tp_layout_hnd: .*page_size is 0"):
            mori_tp.Layout.hnd(4, 2, 0, 0, 256)
        # What ctypes would wrap silently is refused before the call.
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                    "Layout.nhd: page_size 4294967296 does not fit in uint32_t"):
            mori_tp.Layout.nhd(4, 2, 0, 1 << 32, 256)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                    "Layout: offset -1 does not fit in uint64_t"):
            mori_tp.Layout(4, 2, 0, 16, 256, 8192, -1, 512, 256)

    def test_pair_config_refuses_layouts_that_disagree_or_overlap(self):
        prefill = mori_tp.Layout.hnd(4, 2, 0, 16, 256)
        with self.assertRaisesRegex(mori_tp.LayoutMismatchError,
                                    "^mori_tp_pair_config: .*head_bytes 128.*256"):
            mori_tp.pair_config(prefill, mori_tp.Layout.hnd(4, 8, 0, 16, 128))
        with self.assertRaisesRegex(mori_tp.TopologyError, "^mori_tp_pair_config: .*"
                                    "total_kv_heads 4 != .*total_kv_heads 8"):
            mori_tp.pair_config(prefill, mori_tp.Layout.hnd(8, 8, 0, 16, 256))
        overlapping = dataclasses.replace(prefill, token_stride=100)
        with self.assertRaisesRegex(mori_tp.LayoutMismatchError,
                                    "^mori_tp_pair_config: .*token_stride 100"):
            mori_tp.pair_config(overlapping, mori_tp.Layout.hnd(4, 8, 0, 16, 256))
        with self.assertRaisesRegex(TypeError, "pair_config: decode must be a Layout"):
            mori_tp.pair_config(prefill, {"tp_size": 8})


class PairConfigTest(unittest.TestCase):
    def test_every_pair_follows_the_ownership_rule(self):
        for deployment, tokens in CASES:
            request = deployment.request(tokens, 1)
            for p, d in deployment.pairs():
                prefill, decode = deployment.layouts(p, d, request)
                config = mori_tp.pair_config(prefill, decode)
                want = deployment.moved(p, d)
                self.assertEqual(
                    (config.action, config.first_head, config.num_heads, config.src_first_local,
                     config.dst_first_local, config.reserved, config.src, config.dst),
                    (want.action, want.heads.start if want.heads else 0, len(want.heads),
                     want.src_first_local, want.dst_first_local, 0, prefill, decode),
                    f"{deployment.name} ({p}, {d})")

    def test_a_hand_edited_config_is_refused_by_every_function(self):
        pair = Pair(CASES[1][0], 0, 1, 32, seed=3)
        for edited in (dataclasses.replace(pair.config, num_heads=2),
                       dataclasses.replace(pair.config, reserved=1),
                       dataclasses.replace(pair.config, src_first_local=1)):
            for call in (lambda c: mori_tp.pair_segments(c, pair.api),
                         lambda c: mori_tp.pair_plan(c, pair.api),
                         mori_tp.pair_staging_for,
                         lambda c: mori_tp.pair_staging_len(c, 32)):
                with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                            "^mori_tp_pair_.*inconsistent pair config"):
                    call(edited)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "action 7 is not an Action"):
            dataclasses.replace(pair.config, action=7)
        with self.assertRaisesRegex(TypeError, "pair_segments: config must be a PairConfig"):
            mori_tp.pair_segments(mori_tp.slice_config(
                prefill_tp_size=2, prefill_tp_rank=0, decode_tp_size=8, decode_tp_rank=1,
                total_kv_heads=4, page_size=16, src_item_len=16 * 16, dst_item_len=16 * 8),
                pair.api)


class TransferTest(unittest.TestCase):
    """Every pair of every case, against the oracle."""

    def each_pair(self):
        for seed, (deployment, tokens) in enumerate(CASES):
            for p, d in deployment.pairs():
                yield f"{deployment.name} ({p}, {d}) N={tokens}", Pair(deployment, p, d, tokens,
                                                                       seed)

    def assertBuffers(self, got: List[bytes], want: List[bytes], what: str) -> None:
        for b, (x, y) in enumerate(zip(got, want)):
            if x != y:
                self.fail(f"{what}: buffer {b} differs from the oracle first at byte "
                          f"{first_difference(x, y)}")

    def test_send_rects_and_every_staging_mode_leave_the_oracle_bytes(self):
        for what, pair in self.each_pair():
            want = pair.expected()
            self.assertBuffers(pair.sent(), want, f"{what} send_kvcache_pair")
            self.assertBuffers(pair.sent(copy_kernel=True, synchronize=True), want,
                               f"{what} send_kvcache_pair with host flags")
            self.assertBuffers(pair.planned(), want, f"{what} pair_plan")
            for staging in Staging:
                got, count, region = pair.staged(staging)
                self.assertBuffers(got, want, f"{what} {staging.name}")
                if pair.moved.action is Action.SEND and staging is Staging.BOTH:
                    self.assertEqual(count, 1, what)
                    for b in range(BUFFERS):
                        part = region[b * pair.staging_len:(b + 1) * pair.staging_len]
                        self.assertEqual(part, oracle.packed(pair.prefill, pair.moved,
                                                             pair.request, pair.sources[b]), what)
                if pair.moved.action is not Action.SEND:
                    self.assertEqual(count, 0, what)
            if pair.moved.action is Action.SEND:
                self.assertNotEqual(want, pair.initial, f"{what}: the oracle moved nothing")
            else:
                self.assertEqual(want, pair.initial, what)

    def test_segments_and_rects_are_the_fewest_of_the_documented_orders(self):
        for what, pair in self.each_pair():
            local, remote, sizes = mori_tp.pair_segments(pair.config, pair.api)
            want = (oracle.segments(pair.prefill, pair.decode, pair.moved, pair.request)
                    if pair.moved.action is Action.SEND else ([], [], []))
            self.assertEqual((local, remote, sizes), want, what)
            if pair.moved.action is Action.SEND:
                self.assertEqual(mori_tp.pair_plan(pair.config, pair.api),
                                 oracle.rects(pair.prefill, pair.decode, pair.moved,
                                              pair.request), what)
            else:
                self.assertEqual(mori_tp.pair_plan(pair.config, pair.api), [], what)
            self.assertEqual(pair.staging_len, pair.request.num_tokens * len(pair.moved.heads)
                             * pair.prefill.head_bytes, what)
            self.assertIs(mori_tp.pair_staging_for(pair.config),
                          oracle.staging_for(pair.prefill, pair.decode, pair.moved), what)

    def test_whole_hnd_pages_of_exactly_the_moved_heads_are_one_segment_per_run(self):
        # TP 8 -> 8 with 8 heads: each rank holds one head, so an HND page is that head's tokens.
        deployment = Deployment("hnd tp8to8", 8, 8, 8, "hnd", 16, "hnd", 16)
        pair = Pair(deployment, 3, 3, 6 * 16, seed=5)
        runs = sum(1 for i, (s, t) in enumerate(zip(pair.request.src_pages,
                                                    pair.request.dst_pages))
                   if i == 0 or (s, t) != (pair.request.src_pages[i - 1] + 1,
                                           pair.request.dst_pages[i - 1] + 1))
        local, _, sizes = mori_tp.pair_segments(pair.config, pair.api)
        self.assertEqual(len(local), runs)
        self.assertEqual(sum(sizes), 6 * 16 * 8)
        self.assertIs(mori_tp.pair_staging_for(pair.config), Staging.NONE)

    def test_pair_staging_for_follows_the_documented_rule_for_full_sides_in_two_orders(self):
        # python/README.md and REFERENCE.md section 11: both sides hold exactly the moved heads
        # (8 heads, TP 4 -> 4: two per rank), but in different orders or with different page
        # sizes head-major: the prefill side is full, so DST; in one order and page size: NONE.
        nhd, hnd = mori_tp.Layout.nhd, mori_tp.Layout.hnd
        cases = [
            ("NHD into HND", nhd(8, 4, 1, 16, 256), hnd(8, 4, 1, 16, 256), Staging.DST),
            ("HND 16 into HND 64", hnd(8, 4, 1, 16, 256), hnd(8, 4, 1, 64, 256), Staging.DST),
            ("HND into NHD", hnd(8, 4, 1, 16, 256), nhd(8, 4, 1, 16, 256), Staging.DST),
            ("NHD into NHD", nhd(8, 4, 1, 16, 256), nhd(8, 4, 1, 64, 256), Staging.NONE),
            ("HND into HND", hnd(8, 4, 1, 16, 256), hnd(8, 4, 1, 16, 256), Staging.NONE),
            # Prefill TP 2 holds four heads, two of them moved: only the decode side is full.
            ("NHD TP 2 into HND TP 4", nhd(8, 2, 0, 16, 256), hnd(8, 4, 1, 16, 256), Staging.SRC),
        ]
        for what, prefill, decode, want in cases:
            config = mori_tp.pair_config(prefill, decode)
            self.assertIs(config.action, Action.SEND, what)
            self.assertEqual(config.num_heads, 2, what)
            self.assertIs(mori_tp.pair_staging_for(config), want, what)

    def test_hnd_into_nhd_at_one_tp_takes_a_rect_per_page_and_head(self):
        # 8 KV heads at TP 4 on both sides (2 heads per rank), pages of 16 that never touch,
        # 4096 tokens: every order gives a segment per (token, head). Token-major order groups
        # them into a 2-row rect per token; head-major in chunks of 16 into a 16-row rect per
        # (page, head), the fewer, which pair_plan takes.
        for src_kind, dst_kind in (("hnd", "nhd"), ("nhd", "hnd")):
            request = oracle.Request(4096, [2 * i for i in range(256)],
                                     [3 * i + 1 for i in range(256)], 512, 768)
            prefill = oracle.make_layout(src_kind, 8, 4, 1, 16, 256, 512)
            decode = oracle.make_layout(dst_kind, 8, 4, 1, 16, 256, 768)
            config = mori_tp.pair_config(prefill, decode)
            local, remote, sizes = mori_tp.pair_segments(config, request.api())
            self.assertEqual(len(sizes), 8192)
            self.assertEqual(len(oracle.greedy_rects(local, remote, sizes)), 4096)
            rects = mori_tp.pair_plan(config, request.api())
            self.assertEqual(len(rects), 512)
            self.assertEqual(rects, oracle.rects(prefill, decode, oracle.moved(8, 4, 1, 4, 1),
                                                 request))

    def test_a_token_stride_that_pages_of_one_slot_ignore_never_becomes_a_pitch(self):
        # Pages of one slot may carry any token stride; the decode pages go down. A rect
        # joining the two tokens would need a pitch of -4, which is no pitch.
        prefill = mori_tp.Layout(1, 1, 0, 1, 4, page_stride=4, offset=0, token_stride=4,
                                 head_stride=4)
        decode = mori_tp.Layout(1, 1, 0, 1, 4, page_stride=4, offset=0,
                                token_stride=2**64 - 4, head_stride=4)
        config = mori_tp.pair_config(prefill, decode)
        request = mori_tp.Request([0, 1], [1, 0], 2)
        self.assertEqual(mori_tp.pair_plan(config, request),
                         [CopyRect(0, 4, 4, 4, 4, 1), CopyRect(4, 0, 4, 4, 4, 1)])

    def test_only_the_requested_tokens_of_a_partial_last_page_are_written(self):
        deployment = Deployment("hnd 16 to 64", 4, 2, 2, "hnd", 16, "hnd", 64)
        pair = Pair(deployment, 0, 0, 20, seed=6)
        got = pair.sent()[0]
        last = pair.request.dst_pages[-1]
        for slot in range(64):
            for local in range(2):
                at = oracle.element(pair.decode, last, slot, local)
                changed = got[at:at + 8] != pair.initial[0][at:at + 8]
                self.assertEqual(changed, slot < 20, f"slot {slot} head {local}")


class SectionFourAgreementTest(unittest.TestCase):
    def test_nhd_layouts_of_whole_pages_give_the_section_four_lists(self):
        deployment = Deployment("nhd tp2to8", 4, 2, 8, "nhd", 16, "nhd", 16)
        for p, d in deployment.pairs():
            pair = Pair(deployment, p, d, 4 * 16, seed=7)
            sliced = mori_tp.slice_config(
                prefill_tp_size=2, prefill_tp_rank=p, decode_tp_size=8, decode_tp_rank=d,
                total_kv_heads=4, page_size=16, src_item_len=pair.prefill.page_stride,
                dst_item_len=pair.decode.page_stride)
            for staging in Staging:
                self.assertEqual(
                    mori_tp.pair_segments(pair.config, pair.api, staging),
                    mori_tp.plan_transfer(sliced, staging, pair.request.src_pages,
                                          pair.request.dst_pages), f"({p}, {d}) {staging.name}")
            self.assertIs(mori_tp.pair_staging_for(pair.config), mori_tp.staging_for(sliced))
            self.assertEqual(pair.staging_len, mori_tp.staging_len(sliced, 4))


class RequestTest(unittest.TestCase):
    def setUp(self):
        self.pair = Pair(CASES[4][0], 1, 2, 150, seed=8)
        self.request = self.pair.request

    def test_lists_arrays_and_numpy_pages_give_the_same_segments(self):
        want = mori_tp.pair_segments(self.pair.config, self.pair.api)
        forms = [(tuple(self.request.src_pages), tuple(self.request.dst_pages)),
                 (array.array("i", self.request.src_pages),
                  array.array("i", self.request.dst_pages))]
        if np is not None:
            forms += [(np.array(self.request.src_pages, dtype=np.int64),
                       np.array(self.request.dst_pages, dtype=np.uint16)),
                      (np.array(self.request.src_pages, dtype=np.int32),
                       np.array(self.request.dst_pages[::-1], dtype=np.int32)[::-1])]
        for src, dst in forms:
            request = mori_tp.Request(src, dst, 150)
            self.assertEqual(mori_tp.pair_segments(self.pair.config, request), want,
                             type(src).__name__)
        given = array.array("i", self.request.src_pages)
        self.assertIs(mori_tp.Request(given, [0], 1).src_pages, given)

    def test_page_counts_that_do_not_match_the_tokens_are_refused_by_the_library(self):
        short = mori_tp.Request(self.request.src_pages[:-1], self.request.dst_pages, 150)
        with self.assertRaisesRegex(
                mori_tp.InvalidArgumentError,
                r"^mori_tp_pair_segments: .*prefill side: 9 pages for 150 tokens of page_size "
                r"16 \(a request of N tokens lists ceil\(N / page_size\) = 10 pages\)"):
            mori_tp.pair_segments(self.pair.config, short)
        extra = mori_tp.Request(self.request.src_pages, self.request.dst_pages + [40], 150)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                    "^mori_tp_pair_plan: .*decode side: 4 pages for 150 tokens"):
            mori_tp.pair_plan(self.pair.config, extra)

    def test_an_empty_request_moves_nothing(self):
        empty = mori_tp.Request([], [], 0)
        self.assertEqual(mori_tp.pair_segments(self.pair.config, empty), ([], [], []))
        self.assertEqual(mori_tp.pair_plan(self.pair.config, empty), [])
        self.assertEqual(mori_tp.pair_staging_len(self.pair.config, 0), 0)

    def test_pages_outside_int32_and_bad_types_are_refused_before_the_call(self):
        with self.assertRaisesRegex(mori_tp.OutOfBoundsError,
                                    r"Request: src_pages\[1\] = 2147483648 does not fit in int32"):
            mori_tp.Request([0, 1 << 31], [0], 20)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "num_tokens -1"):
            mori_tp.Request([0], [0], -1)
        with self.assertRaisesRegex(TypeError, "pair_plan: request must be a Request"):
            mori_tp.pair_plan(self.pair.config, (self.request.src_pages,
                                                 self.request.dst_pages, 150))


class RefusalsTest(unittest.TestCase):
    """Refused calls raise their class with the library's message and write nothing."""

    def setUp(self):
        # HND TP 2 -> 8, decode page 64: staging_for stages both sides or one; every mode works.
        self.pair = Pair(Deployment("hnd 16 to 64", 4, 2, 8, "hnd", 16, "hnd", 64), 0, 1, 90,
                         seed=9)
        self.needed = BUFFERS * self.pair.staging_len

    def assertRefused(self, cls, pattern, function, *args, **kwargs):
        with self.assertRaisesRegex(cls, pattern):
            function(*args, **kwargs)

    def test_a_page_past_capacity_or_negative_is_out_of_bounds_and_nothing_moves(self):
        pair = self.pair
        dst = pair.fresh()
        src_pages = list(pair.request.src_pages)
        src_pages[2] = pair.request.src_capacity_pages + 4
        self.assertRefused(
            mori_tp.OutOfBoundsError,
            f"^mori_tp_pair_send: .*prefill side: page {src_pages[2]} at position 2 .*"
            f"past src_capacity {pair.src_len}",
            mori_tp.send_kvcache_pair, pair.config, pair.src_ptrs(),
            [ctypes.addressof(x) for x in dst], src_capacity=pair.src_len,
            dst_capacity=pair.dst_len, backend="host",
            request=mori_tp.Request(src_pages, pair.request.dst_pages, 90))
        dst_pages = list(pair.request.dst_pages)
        dst_pages[0] = -1
        self.assertRefused(
            mori_tp.OutOfBoundsError,
            "^mori_tp_pair_segments: .*decode side: page index -1 at position 0",
            mori_tp.pair_segments, pair.config,
            mori_tp.Request(pair.request.src_pages, dst_pages, 90))
        self.assertEqual([bytes(x) for x in dst], pair.initial)

    def test_a_staging_region_one_byte_short_is_refused_naming_both_sizes(self):
        pair, short = self.pair, self.needed - 1
        region = (ctypes.c_ubyte * self.needed)(*([0x5A] * self.needed))
        self.assertRefused(
            mori_tp.BufferTooSmallError,
            f"^mori_tp_pair_pack: .*staging_capacity {short}.*{self.needed} bytes",
            mori_tp.pack_kvcache_pair, pair.config, Staging.SRC, pair.src_ptrs(),
            ctypes.addressof(region), staging_capacity=short, src_capacity=pair.src_len,
            request=pair.api, backend="host")
        self.assertEqual(bytes(region), bytes([0x5A]) * self.needed)
        dst = pair.fresh()
        self.assertRefused(
            mori_tp.BufferTooSmallError,
            f"^mori_tp_pair_unpack: .*staging_capacity {short}.*{self.needed} bytes",
            mori_tp.unpack_kvcache_pair, pair.config, Staging.BOTH, ctypes.addressof(region),
            [ctypes.addressof(x) for x in dst], staging_capacity=short,
            dst_capacity=pair.dst_len, request=pair.api, backend="host")
        self.assertEqual([bytes(x) for x in dst], pair.initial)

    def test_pack_and_unpack_take_only_their_own_staging_modes(self):
        pair = self.pair
        region = (ctypes.c_ubyte * self.needed)()
        for mode in (Staging.NONE, Staging.DST, 7):
            self.assertRefused(
                mori_tp.InvalidArgumentError, "^mori_tp_pair_pack: .*staging.mode",
                mori_tp.pack_kvcache_pair, pair.config, mode, pair.src_ptrs(),
                ctypes.addressof(region), staging_capacity=self.needed,
                src_capacity=pair.src_len, request=pair.api, backend="host")
        dst = pair.fresh()
        for mode in (Staging.NONE, Staging.SRC):
            self.assertRefused(
                mori_tp.InvalidArgumentError, "^mori_tp_pair_unpack: .*staging.mode",
                mori_tp.unpack_kvcache_pair, pair.config, mode, ctypes.addressof(region),
                [ctypes.addressof(x) for x in dst], staging_capacity=self.needed,
                dst_capacity=pair.dst_len, request=pair.api, backend="host")
        self.assertRefused(mori_tp.InvalidArgumentError, "^mori_tp_pair_segments: .*staging 4",
                           mori_tp.pair_segments, pair.config, pair.api, 4)
        self.assertEqual([bytes(x) for x in dst], pair.initial)

    def test_check_pair_transfer_names_the_side_whose_memory_is_short(self):
        pair = self.pair
        prefill = mori_tp.RankMemory(BUFFERS, pair.src_len, self.needed)
        decode = mori_tp.RankMemory(BUFFERS, pair.dst_len, self.needed)
        for staging in Staging:
            mori_tp.check_pair_transfer(pair.config, pair.api, staging, prefill=prefill,
                                        decode=decode)
        self.assertRefused(
            mori_tp.BufferTooSmallError,
            f"^mori_tp_check_pair_transfer: .*decode side: staging_capacity {self.needed - 1} "
            f"is below the {self.needed} bytes",
            mori_tp.check_pair_transfer, pair.config, pair.api, Staging.DST, prefill=prefill,
            decode=decode._replace(staging_capacity=self.needed - 1))
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            f"^mori_tp_check_pair_transfer: .*{BUFFERS} source buffers but {BUFFERS + 1}",
            mori_tp.check_pair_transfer, pair.config, pair.api, Staging.NONE, prefill=prefill,
            decode=decode._replace(num_buffers=BUFFERS + 1))
        # One byte short of the last page's end.
        short = (max(pair.request.src_pages) * pair.prefill.page_stride
                 + oracle.extent(pair.prefill) - 1)
        self.assertRefused(
            mori_tp.OutOfBoundsError,
            f"^mori_tp_check_pair_transfer: .*prefill side: .*past src_capacity {short}",
            mori_tp.check_pair_transfer, pair.config, pair.api, Staging.SRC,
            prefill=prefill._replace(capacity=short), decode=decode)

    def test_buffer_lists_of_different_lengths_and_null_buffers(self):
        pair = self.pair
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            f"send_kvcache_pair: {BUFFERS} source buffers but 1 destination buffers",
            mori_tp.send_kvcache_pair, pair.config, pair.src_ptrs(), [64], src_capacity=1,
            dst_capacity=1, request=pair.api, backend="host")
        self.assertRefused(
            mori_tp.NullPointerError, "^mori_tp_pair_send: .*NULL",
            mori_tp.send_kvcache_pair, pair.config, pair.src_ptrs(), [0, 0],
            src_capacity=pair.src_len, dst_capacity=pair.dst_len, request=pair.api,
            backend="host")
        self.assertRefused(
            mori_tp.InvalidArgumentError, "send_kvcache_pair: backend 'metal'",
            mori_tp.send_kvcache_pair, pair.config, pair.src_ptrs(), pair.src_ptrs(),
            src_capacity=pair.src_len, dst_capacity=pair.dst_len, request=pair.api,
            backend="metal")

    def test_a_staging_length_that_overflows_is_refused(self):
        self.assertRefused(mori_tp.InvalidArgumentError, "^mori_tp_pair_staging_len: .*overflow",
                           mori_tp.pair_staging_len, self.pair.config, 1 << 62)

    def test_pairs_that_are_not_send_validate_and_move_nothing(self):
        deployment = Deployment("hnd tp2to8", 4, 2, 8, "hnd", 16, "hnd", 64)
        pair = Pair(deployment, 1, 0, 90, seed=10)  # decode rank 0 holds head 0, of rank 0
        self.assertIs(pair.config.action, Action.NOT_PAIRED)
        self.assertEqual(mori_tp.pair_staging_len(pair.config, 90), 0)
        self.assertIs(mori_tp.pair_staging_for(pair.config), Staging.NONE)
        region = (ctypes.c_ubyte * 64)(*([7] * 64))
        mori_tp.pack_kvcache_pair(pair.config, Staging.BOTH, pair.src_ptrs(),
                                  ctypes.addressof(region), staging_capacity=64,
                                  src_capacity=pair.src_len, request=pair.api, backend="host")
        self.assertEqual(bytes(region), bytes([7]) * 64)
        self.assertEqual(pair.sent(), pair.initial)
        bad = mori_tp.Request([pair.request.src_capacity_pages] + pair.request.src_pages[1:],
                              pair.request.dst_pages, 90)
        self.assertRefused(mori_tp.OutOfBoundsError, "^mori_tp_pair_pack: .*page",
                           mori_tp.pack_kvcache_pair, pair.config, Staging.BOTH,
                           pair.src_ptrs(), ctypes.addressof(region), staging_capacity=64,
                           src_capacity=pair.src_len, request=bad, backend="host")


@unittest.skipIf(np is None, "numpy is not installed")
class NumpyTest(unittest.TestCase):
    def test_array_outputs_equal_list_outputs(self):
        for seed, (deployment, tokens) in enumerate(CASES):
            pair = Pair(deployment, 0, deployment.d_tp - 1, tokens, seed)
            for staging in Staging:
                lists = mori_tp.pair_segments(pair.config, pair.api, staging)
                arrays = mori_tp.pair_segments(pair.config, pair.api, staging, as_arrays=True)
                self.assertEqual([a.tolist() for a in arrays], list(lists), deployment.name)
                self.assertTrue(all(a.dtype == np.uint64 for a in arrays))
            rects = mori_tp.pair_plan(pair.config, pair.api, as_arrays=True)
            self.assertEqual(rects.shape, (len(mori_tp.pair_plan(pair.config, pair.api)), 6))
            self.assertEqual([mori_tp.CopyRect(*row) for row in rects.tolist()],
                             mori_tp.pair_plan(pair.config, pair.api))

    def test_numpy_regions_round_trip_a_request(self):
        pair = Pair(CASES[7][0], 0, 0, 45, seed=11)
        staging = mori_tp.pair_staging_for(pair.config)
        self.assertIs(staging, Staging.BOTH)
        region = np.zeros(BUFFERS * pair.staging_len, dtype=np.uint8)
        mori_tp.pack_kvcache_pair(pair.config, staging, pair.src_ptrs(), region,
                                  src_capacity=pair.src_len, request=pair.api, backend="host")
        dst = pair.fresh()
        mori_tp.unpack_kvcache_pair(pair.config, staging, region,
                                    [ctypes.addressof(x) for x in dst],
                                    dst_capacity=pair.dst_len, request=pair.api, backend="host")
        self.assertEqual([bytes(x) for x in dst], pair.expected())


if __name__ == "__main__":
    unittest.main()
