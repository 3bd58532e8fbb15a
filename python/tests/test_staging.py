"""Staged transfers through the Python API: pack, copy every segment of plan_transfer for every
buffer, unpack must leave every destination byte as one send_kvcache does, in all four modes;
segment counts; refusals that name their numbers and write nothing."""

from __future__ import annotations

import ctypes
import dataclasses
import unittest
from typing import List, Tuple

import mori_tp
from layouts import (
    Layout,
    Request,
    fragmented_request,
    identified_buffer,
    sentinel_buffer,
    tools_required,
)
from mori_tp import Action, Staging

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

BUFFERS = 3

LAYOUTS = [
    # Decode replicates heads, prefill does not (4 KV heads, TP 2 -> 8): SRC.
    Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=8),
    # Prefill replicates, decode does not (TP 8 -> 2): DST.
    Layout(heads=2, p_tp=8, d_tp=2, page_size=1, bytes_per_head=12),
    # Both replicate, non-integer ratio.
    Layout(heads=4, p_tp=12, d_tp=8, page_size=16, bytes_per_head=4),
    # Non-integer ratio without replication: some pairs stage both sides.
    Layout(heads=12, p_tp=6, d_tp=4, page_size=1, bytes_per_head=4),
    # MLA: one latent head everywhere, whole tokens.
    Layout(heads=1, p_tp=4, d_tp=2, page_size=16, bytes_per_head=20),
    # Whole tokens on both sides (the same TP): nothing to stage.
    Layout(heads=8, p_tp=2, d_tp=2, page_size=16, bytes_per_head=4),
]

CONTIGUOUS = Request(list(range(2, 7)), list(range(1, 6)), 8, 7)


def c_buffer(data: bytes) -> ctypes.Array:
    return (ctypes.c_ubyte * len(data)).from_buffer_copy(data)


class Pair:
    """One pair's buffers: identified sources, sentinel destinations, ctypes-backed."""

    def __init__(self, layout: Layout, p: int, d: int, request: Request) -> None:
        self.config = layout.config(p, d)
        self.request = request
        self.src_len = request.src_capacity_pages * layout.src_item_len
        self.dst_len = request.dst_capacity_pages * layout.dst_item_len
        self.sources = [c_buffer(identified_buffer(layout, layout.p_tp, p, b,
                                                   request.src_capacity_pages))
                        for b in range(BUFFERS)]
        self.initial = [sentinel_buffer(d, b, self.dst_len) for b in range(BUFFERS)]
        self.staging_len = mori_tp.staging_len(self.config, len(request.src_pages))

    def fresh_destinations(self) -> List[ctypes.Array]:
        return [c_buffer(data) for data in self.initial]

    def src_ptrs(self) -> List[int]:
        return [ctypes.addressof(s) for s in self.sources]

    def sent(self) -> List[bytes]:
        """The destinations after one send_kvcache."""
        dst = self.fresh_destinations()
        mori_tp.send_kvcache(self.config, self.src_ptrs(), [ctypes.addressof(x) for x in dst],
                             src_capacity=self.src_len, dst_capacity=self.dst_len,
                             src_pages=self.request.src_pages, dst_pages=self.request.dst_pages,
                             backend="host")
        return [bytes(x) for x in dst]

    def staged(self, staging: Staging) -> Tuple[List[bytes], int]:
        """The destinations after pack, a copy of every segment for every buffer, unpack;
        and the number of segments per buffer."""
        dst = self.fresh_destinations()
        region_len = max(1, BUFFERS * self.staging_len)
        src_region = (ctypes.c_ubyte * region_len)()
        dst_region = (ctypes.c_ubyte * region_len)(*([0xEE] * region_len))
        if staging.packs:
            mori_tp.pack_kvcache(self.config, self.src_ptrs(), ctypes.addressof(src_region),
                                 staging_capacity=region_len, src_capacity=self.src_len,
                                 src_pages=self.request.src_pages, backend="host")
        local, remote, sizes = mori_tp.plan_transfer(self.config, staging,
                                                     self.request.src_pages,
                                                     self.request.dst_pages)
        for b in range(BUFFERS):
            # The transport: every segment, from this buffer's base on each side.
            src_base = (ctypes.addressof(src_region) + b * self.staging_len if staging.packs
                        else ctypes.addressof(self.sources[b]))
            dst_base = (ctypes.addressof(dst_region) + b * self.staging_len if staging.unpacks
                        else ctypes.addressof(dst[b]))
            for s, r, n in zip(local, remote, sizes):
                ctypes.memmove(dst_base + r, src_base + s, n)
        if staging.unpacks:
            mori_tp.unpack_kvcache(self.config, ctypes.addressof(dst_region),
                                   [ctypes.addressof(x) for x in dst],
                                   staging_capacity=region_len, dst_capacity=self.dst_len,
                                   dst_pages=self.request.dst_pages, backend="host")
        return [bytes(x) for x in dst], len(sizes)


class CompositionLawTest(unittest.TestCase):
    def check_layout(self, layout: Layout, request: Request) -> None:
        for p, d in layout.pairs():
            pair = Pair(layout, p, d, request)
            want = pair.sent()
            counts = {}
            for staging in Staging:
                got, counts[staging] = pair.staged(staging)
                for b in range(BUFFERS):
                    if got[b] != want[b]:
                        at = next(i for i, (x, y) in enumerate(zip(got[b], want[b])) if x != y)
                        self.fail(f"{layout} pair ({p}, {d}) {staging.name}: buffer {b} "
                                  f"differs from send_kvcache's first at byte {at}")
            if pair.config.action is Action.SEND:
                # staging_for stages exactly the sides whose token is wider than the slice:
                # the fewest segments of the modes that stage no other side (staging a side
                # whose token is the slice would copy it once more to merge nothing).
                chosen = mori_tp.staging_for(pair.config)
                without_extra = [counts[s] for s in Staging if not s & ~chosen]
                self.assertEqual(counts[chosen], min(without_extra),
                                 f"{layout} ({p}, {d}): staging_for {chosen.name} {counts}")
                self.assertEqual(counts[Staging.BOTH], 1)
            else:
                self.assertEqual(set(counts.values()), {0})

    def test_pack_copy_unpack_equals_send_in_every_mode_on_fragmented_pages(self):
        for seed, layout in enumerate(LAYOUTS):
            with self.subTest(layout=layout):
                self.check_layout(layout, fragmented_request(seed=seed + 30, runs=4))

    def test_pack_copy_unpack_equals_send_on_one_contiguous_run(self):
        for layout in LAYOUTS[:2]:
            with self.subTest(layout=layout):
                self.check_layout(layout, CONTIGUOUS)


class SegmentsTest(unittest.TestCase):
    def setUp(self):
        self.layout = Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=8)
        self.request = fragmented_request(seed=9, runs=5)
        self.config = self.layout.config(0, 1)

    def plan(self, staging, **kwargs):
        return mori_tp.plan_transfer(self.config, staging, self.request.src_pages,
                                     self.request.dst_pages, **kwargs)

    def test_none_is_plan_segments(self):
        self.assertEqual(self.plan(Staging.NONE),
                         mori_tp.plan_segments(self.config, self.request.src_pages,
                                               self.request.dst_pages))

    def test_both_is_one_segment_of_staging_len(self):
        length = mori_tp.staging_len(self.config, len(self.request.src_pages))
        self.assertEqual(length, len(self.request.src_pages) * 16 * 8)
        self.assertEqual(self.plan(Staging.BOTH), ([0], [0], [length]))

    def test_staging_for_follows_the_token_widths(self):
        for layout in LAYOUTS:
            for p, d in layout.pairs():
                config = layout.config(p, d)
                w = config.heads_bytes_per_token_to_send
                want = (Staging.NONE if config.action is not Action.SEND else
                        Staging((config.bytes_per_token_src > w)
                                | (config.bytes_per_token_dst > w) << 1))
                self.assertIs(mori_tp.staging_for(config), want)

    @unittest.skipIf(np is None, "numpy is not installed")
    def test_arrays_hold_the_same_segments_as_lists(self):
        for staging in Staging:
            lists = self.plan(staging)
            arrays = self.plan(staging, as_arrays=True)
            self.assertEqual([a.tolist() for a in arrays], list(lists))
            self.assertTrue(all(a.dtype == np.uint64 for a in arrays))

    def test_the_enum_and_its_values_are_the_abi(self):
        self.assertEqual([(s.name, int(s)) for s in Staging],
                         [("NONE", 0), ("SRC", 1), ("DST", 2), ("BOTH", 3)])
        self.assertEqual([s for s in Staging if s.packs], [Staging.SRC, Staging.BOTH])
        self.assertEqual([s for s in Staging if s.unpacks], [Staging.DST, Staging.BOTH])
        self.assertEqual(self.plan(1), self.plan(Staging.SRC))


class RefusalsTest(unittest.TestCase):
    def setUp(self):
        self.layout = Layout(heads=4, p_tp=2, d_tp=8, page_size=4, bytes_per_head=8)
        self.request = fragmented_request(seed=4, runs=3)
        self.pair = Pair(self.layout, 1, 5, self.request)
        self.needed = BUFFERS * self.pair.staging_len

    def assertRefused(self, cls, parts, function, *args, **kwargs):
        with self.assertRaises(cls) as caught:
            function(*args, **kwargs)
        for part in parts:
            self.assertIn(part, str(caught.exception))

    def test_a_staging_region_one_byte_short_is_refused_and_nothing_is_written(self):
        short = self.needed - 1
        region = (ctypes.c_ubyte * self.needed)(*([0x5A] * self.needed))
        self.assertRefused(
            mori_tp.BufferTooSmallError, [f"staging_capacity {short}", f"{self.needed} bytes"],
            mori_tp.pack_kvcache, self.pair.config, self.pair.src_ptrs(),
            ctypes.addressof(region), staging_capacity=short, src_capacity=self.pair.src_len,
            src_pages=self.request.src_pages, backend="host",
        )
        self.assertEqual(bytes(region), bytes([0x5A]) * self.needed)
        dst = self.pair.fresh_destinations()
        self.assertRefused(
            mori_tp.BufferTooSmallError, [f"staging_capacity {short}", f"{self.needed} bytes"],
            mori_tp.unpack_kvcache, self.pair.config, ctypes.addressof(region),
            [ctypes.addressof(x) for x in dst], staging_capacity=short,
            dst_capacity=self.pair.dst_len, dst_pages=self.request.dst_pages, backend="host",
        )
        self.assertEqual([bytes(x) for x in dst], self.pair.initial)

    def test_check_transfer_names_the_side_whose_memory_is_short(self):
        pair, request = self.pair, self.request
        prefill = mori_tp.RankMemory(BUFFERS, pair.src_len, self.needed)
        decode = mori_tp.RankMemory(BUFFERS, pair.dst_len, self.needed)
        for staging in Staging:
            mori_tp.check_transfer(pair.config, staging, request.src_pages, request.dst_pages,
                                   prefill=prefill, decode=decode)
        self.assertRefused(
            mori_tp.BufferTooSmallError,
            ["decode side", f"staging_capacity {self.needed - 1}", f"{self.needed} bytes"],
            mori_tp.check_transfer, pair.config, Staging.DST, request.src_pages,
            request.dst_pages, prefill=prefill, decode=decode._replace(
                staging_capacity=self.needed - 1),
        )
        self.assertRefused(
            mori_tp.InvalidArgumentError, [f"{BUFFERS} source buffers but {BUFFERS + 1}"],
            mori_tp.check_transfer, pair.config, Staging.NONE, request.src_pages,
            request.dst_pages, prefill=prefill, decode=decode._replace(num_buffers=BUFFERS + 1),
        )
        last_end = (max(request.src_pages) + 1) * self.layout.src_item_len
        self.assertRefused(
            mori_tp.OutOfBoundsError, ["prefill side", f"past src_capacity {last_end - 1}"],
            mori_tp.check_transfer, pair.config, Staging.SRC, request.src_pages,
            request.dst_pages, prefill=prefill._replace(capacity=last_end - 1), decode=decode,
        )

    def test_the_copy_kernel_flag_reaches_the_library(self):
        # The flag is accepted (an unknown bit would be refused) and the host backend, which
        # ignores it, moves the same bytes.
        pair = self.pair
        dst = pair.fresh_destinations()
        mori_tp.send_kvcache(pair.config, pair.src_ptrs(), [ctypes.addressof(x) for x in dst],
                             src_capacity=pair.src_len, dst_capacity=pair.dst_len,
                             src_pages=self.request.src_pages, dst_pages=self.request.dst_pages,
                             backend="host", copy_kernel=True)
        self.assertEqual([bytes(x) for x in dst], pair.sent())

    def test_an_sm_budget_reaches_the_library_and_is_refused_with_the_per_rect_copies(self):
        # The host backend ignores a budget (same bytes); with copy_kernel=False the library
        # refuses it, naming the flags and the budget.
        pair = self.pair
        dst = pair.fresh_destinations()
        mori_tp.send_kvcache(pair.config, pair.src_ptrs(), [ctypes.addressof(x) for x in dst],
                             src_capacity=pair.src_len, dst_capacity=pair.dst_len,
                             src_pages=self.request.src_pages, dst_pages=self.request.dst_pages,
                             backend="host", copy_kernel=True, max_blocks=4)
        self.assertEqual([bytes(x) for x in dst], pair.sent())
        self.assertRefused(mori_tp.InvalidArgumentError,
                           ["block budget of 4", "MORI_SEND_MEMCPY2D"], mori_tp.send_kvcache, pair.config, pair.src_ptrs(),
                           [ctypes.addressof(x) for x in dst], src_capacity=pair.src_len,
                           dst_capacity=pair.dst_len, src_pages=self.request.src_pages,
                           dst_pages=self.request.dst_pages, backend="host", copy_kernel=False,
                           max_blocks=4)

    def test_an_unknown_staging_value_is_an_invalid_argument(self):
        self.assertRefused(mori_tp.InvalidArgumentError, ["staging 4"], mori_tp.plan_transfer,
                           self.pair.config, 4, self.request.src_pages, self.request.dst_pages)
        self.assertRefused(mori_tp.InvalidArgumentError, ["staging", str(1 << 32)],
                           mori_tp.plan_transfer, self.pair.config, 1 << 32,
                           self.request.src_pages, self.request.dst_pages)

    def test_a_null_region_with_a_capacity_and_a_page_past_capacity_write_nothing(self):
        self.assertRefused(mori_tp.NullPointerError, ["staging is NULL", "staging_capacity is 64"],
                           mori_tp.pack_kvcache, self.pair.config, self.pair.src_ptrs(), 0,
                           staging_capacity=64, src_capacity=self.pair.src_len,
                           src_pages=self.request.src_pages, backend="host")
        region = (ctypes.c_ubyte * self.needed)()
        pages = list(self.request.src_pages)
        pages[-1] = self.request.src_capacity_pages
        self.assertRefused(mori_tp.OutOfBoundsError, [f"page {pages[-1]}", "src_capacity"],
                           mori_tp.pack_kvcache, self.pair.config, self.pair.src_ptrs(),
                           ctypes.addressof(region), staging_capacity=self.needed,
                           src_capacity=self.pair.src_len, src_pages=pages, backend="host")
        self.assertEqual(bytes(region), bytes(self.needed))

    def test_a_staging_length_that_overflows_is_refused(self):
        self.assertRefused(mori_tp.InvalidArgumentError, ["overflows"], mori_tp.staging_len,
                           self.pair.config, 1 << 62)

    def test_configs_that_are_not_send_validate_and_move_nothing(self):
        for p, d in self.layout.pairs():
            config = self.layout.config(p, d)
            if config.action is Action.SEND:
                continue
            pair = Pair(self.layout, p, d, self.request)
            self.assertEqual(mori_tp.staging_len(config, 5), 0)
            self.assertIs(mori_tp.staging_for(config), Staging.NONE)
            region = (ctypes.c_ubyte * 64)(*([7] * 64))
            mori_tp.pack_kvcache(config, pair.src_ptrs(), ctypes.addressof(region),
                                 staging_capacity=64, src_capacity=pair.src_len,
                                 src_pages=self.request.src_pages, backend="host")
            self.assertEqual(bytes(region), bytes([7]) * 64)
            dst = pair.fresh_destinations()
            mori_tp.unpack_kvcache(config, ctypes.addressof(region),
                                   [ctypes.addressof(x) for x in dst], staging_capacity=64,
                                   dst_capacity=pair.dst_len, dst_pages=self.request.dst_pages,
                                   backend="host")
            self.assertEqual([bytes(x) for x in dst], pair.initial)
            for staging in Staging:
                self.assertEqual(mori_tp.plan_transfer(config, staging, self.request.src_pages,
                                                       self.request.dst_pages), ([], [], []))
            # The pages are still checked.
            self.assertRefused(mori_tp.OutOfBoundsError, ["page 99"], mori_tp.pack_kvcache,
                               config, pair.src_ptrs(), ctypes.addressof(region),
                               staging_capacity=64, src_capacity=pair.src_len,
                               src_pages=[99], backend="host")
            return
        self.fail("the layout has no pair that is not SEND")

    def test_a_hand_edited_config_is_revalidated(self):
        edited = dataclasses.replace(self.pair.config, heads_bytes_per_token_to_send=1 << 20)
        with self.assertRaises(mori_tp.MoriError):
            mori_tp.plan_transfer(edited, Staging.BOTH, [0], [0])


@unittest.skipIf(np is None, "numpy is not installed")
class NumpyRegionsTest(unittest.TestCase):
    def setUp(self):
        layout = Layout(heads=8, p_tp=2, d_tp=4, page_size=4, bytes_per_head=4)
        self.config = layout.config(1, 3)
        self.src = np.arange(6 * layout.src_item_len, dtype=np.uint8)
        self.dst = np.zeros(5 * layout.dst_item_len, dtype=np.uint8)
        self.pages = np.array([4, 1, 2], dtype=np.int64)
        self.length = mori_tp.staging_len(self.config, 3)

    def test_numpy_regions_round_trip_a_request(self):
        region = np.zeros(self.length, dtype=np.uint8)
        mori_tp.pack_kvcache(self.config, [self.src.ctypes.data], region,
                             src_capacity=self.src.nbytes, src_pages=self.pages, backend="host")
        mori_tp.unpack_kvcache(self.config, region, [self.dst.ctypes.data],
                               dst_capacity=self.dst.nbytes, dst_pages=[0, 3, 4], backend="host")
        want = np.zeros_like(self.dst)
        mori_tp.send_kvcache(self.config, [self.src.ctypes.data], [want.ctypes.data],
                             src_capacity=self.src.nbytes, dst_capacity=want.nbytes,
                             src_pages=self.pages, dst_pages=[0, 3, 4], backend="host")
        self.assertTrue(np.array_equal(self.dst, want))
        self.assertGreater(int(np.count_nonzero(want)), 0)

    def test_unusable_numpy_regions_are_refused_before_the_call(self):
        region = np.zeros(self.length, dtype=np.uint8)
        region.flags.writeable = False
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "read-only"):
            mori_tp.pack_kvcache(self.config, [self.src.ctypes.data], region,
                                 src_capacity=self.src.nbytes, src_pages=self.pages)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "exceeds"):
            mori_tp.unpack_kvcache(self.config, region, [self.dst.ctypes.data],
                                   staging_capacity=self.length + 1,
                                   dst_capacity=self.dst.nbytes, dst_pages=[0, 3, 4])
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "C-contiguous"):
            mori_tp.unpack_kvcache(self.config, np.zeros(2 * self.length, np.uint8)[::2],
                                   [self.dst.ctypes.data], dst_capacity=self.dst.nbytes,
                                   dst_pages=[0, 3, 4])
        with self.assertRaisesRegex(TypeError, "staging_capacity is required"):
            mori_tp.pack_kvcache(self.config, [self.src.ctypes.data], region.ctypes.data,
                                 src_capacity=self.src.nbytes, src_pages=self.pages)
        self.assertEqual(int(np.count_nonzero(self.dst)), 0)


if __name__ == "__main__":
    unittest.main()
