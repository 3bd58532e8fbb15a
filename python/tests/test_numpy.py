"""numpy inputs and array output. numpy is optional: these tests skip when it is not installed
(except the ones that check the package works, and says so, without it), unless
MORI_TP_REQUIRE_TOOLS is set, as CI sets it, so that nothing is silently skipped there."""

from __future__ import annotations

import array
import dataclasses
import ctypes
import unittest
from unittest import mock

import mori_tp
from layouts import Layout, fragmented_request, tools_required

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

needs_numpy = unittest.skipIf(np is None, "numpy is not installed")

LAYOUT = Layout(heads=4, p_tp=2, d_tp=8, page_size=4, bytes_per_head=8)
REQUEST = fragmented_request(seed=9, runs=5)


@needs_numpy
class NumpyInputTest(unittest.TestCase):
    def setUp(self):
        self.config = LAYOUT.config(1, 5)
        self.want = mori_tp.plan_segments(self.config, REQUEST.src_pages, REQUEST.dst_pages)
        self.assertTrue(self.want[0])

    def test_contiguous_int32_arrays_are_passed_by_address_without_a_copy(self):
        pages = np.array(REQUEST.src_pages, dtype=np.int32)
        address, length, owner = mori_tp._pages_arg(pages, "src_pages")
        self.assertEqual(address, pages.ctypes.data)
        self.assertEqual(length, len(pages))
        self.assertIs(owner, pages)
        dst = np.array(REQUEST.dst_pages, dtype=np.int32)
        self.assertEqual(mori_tp.plan_segments(self.config, pages, dst), self.want)

    def test_read_only_int32_arrays_are_used_in_place(self):
        pages = np.array(REQUEST.src_pages, dtype=np.int32)
        pages.flags.writeable = False
        self.assertEqual(mori_tp._pages_arg(pages, "src_pages")[0], pages.ctypes.data)
        dst = np.array(REQUEST.dst_pages, dtype=np.int32)
        self.assertEqual(mori_tp.plan_segments(self.config, pages, dst), self.want)

    def test_other_integer_arrays_are_converted_and_give_the_same_plan(self):
        src64 = np.array(REQUEST.src_pages, dtype=np.int64)
        dst_u32 = np.array(REQUEST.dst_pages, dtype=np.uint32)
        self.assertEqual(mori_tp.plan_segments(self.config, src64, dst_u32), self.want)
        # A strided int32 view cannot be passed by address: it is made contiguous first.
        strided = np.zeros(2 * len(REQUEST.src_pages), dtype=np.int32)
        strided[::2] = REQUEST.src_pages
        self.assertEqual(
            mori_tp.plan_segments(self.config, strided[::2], REQUEST.dst_pages), self.want)
        self.assertEqual(mori_tp.plan(self.config, src64, dst_u32),
                         mori_tp.plan(self.config, REQUEST.src_pages, REQUEST.dst_pages))

    def test_values_outside_int32_are_out_of_bounds_not_wrapped(self):
        # int64 2**32 + 1 would wrap to page 1 if converted blindly.
        cases = [
            (np.array([0, 2**32 + 1], dtype=np.int64), "src_pages[1] = 4294967297"),
            (np.array([-(2**31) - 1, 0], dtype=np.int64), "src_pages[0] = -2147483649"),
            (np.array([3, 2**31], dtype=np.uint64), "src_pages[1] = 2147483648"),
        ]
        for pages, part in cases:
            with self.subTest(dtype=str(pages.dtype)):
                with self.assertRaises(mori_tp.OutOfBoundsError) as caught:
                    mori_tp.plan(self.config, pages, [0, 1])
                self.assertIn(part, str(caught.exception))
        with self.assertRaises(mori_tp.OutOfBoundsError) as caught:
            mori_tp.plan(self.config, np.array([0, -1], dtype=np.int32), [0, 1])
        self.assertIn("page index -1 at position 1 is negative", str(caught.exception))

    def test_arrays_of_the_wrong_shape_or_kind_are_refused(self):
        with self.assertRaises(mori_tp.InvalidArgumentError) as caught:
            mori_tp.plan(self.config, np.zeros((2, 2), dtype=np.int32), [0, 1])
        self.assertIn("one-dimensional, not of shape (2, 2)", str(caught.exception))
        with self.assertRaisesRegex(TypeError, "must hold integers, not float64"):
            mori_tp.plan(self.config, np.zeros(2), [0, 1])

    def test_numpy_integers_are_accepted_as_layout_values(self):
        config = mori_tp.slice_config(
            prefill_tp_size=np.int64(2), prefill_tp_rank=np.int32(1),
            decode_tp_size=np.uint8(8), decode_tp_rank=np.int64(5),
            total_kv_heads=np.int64(4), page_size=np.int64(4),
            src_item_len=np.uint64(LAYOUT.src_item_len),
            dst_item_len=np.int64(LAYOUT.dst_item_len),
        )
        self.assertEqual(config, self.config)
        self.assertIs(type(config.page_size), int)


@needs_numpy
class ArrayOutputTest(unittest.TestCase):
    def test_array_output_equals_the_list_output(self):
        for p, d in LAYOUT.pairs():
            config = LAYOUT.config(p, d)
            lists = mori_tp.plan_segments(config, REQUEST.src_pages, REQUEST.dst_pages)
            arrays = mori_tp.plan_segments(config, REQUEST.src_pages, REQUEST.dst_pages,
                                           as_arrays=True)
            for got, want in zip(arrays, lists):
                self.assertIsInstance(got, np.ndarray)
                self.assertEqual(got.dtype, np.uint64)
                self.assertEqual(got.shape, (len(want),))
                self.assertEqual(got.tolist(), want)

    def test_rect_array_output_equals_the_list_output_row_for_row(self):
        for p, d in LAYOUT.pairs():
            config = LAYOUT.config(p, d)
            rects = mori_tp.plan(config, REQUEST.src_pages, REQUEST.dst_pages)
            array_rects = mori_tp.plan(config, REQUEST.src_pages, REQUEST.dst_pages,
                                       as_arrays=True)
            self.assertEqual(array_rects.dtype, np.uint64)
            self.assertEqual(array_rects.shape, (len(rects), 6))
            self.assertEqual([mori_tp.CopyRect(*row) for row in array_rects.tolist()], rects)
            # Only as many rows as the plan has, not the one-per-page bound reserved for it.
            self.assertTrue(array_rects.base is None or array_rects.base.shape[0] == len(rects))

    def test_whole_token_segments_reserve_no_more_than_they_return(self):
        # Equal TP: whole tokens, one segment per run although a row bound was reserved.
        layout = dataclasses.replace(LAYOUT, d_tp=LAYOUT.p_tp)
        config = layout.config(0, 0)
        local, remote, sizes = mori_tp.plan_segments(config, [0, 1, 2, 5], [3, 4, 5, 0],
                                                     as_arrays=True)
        self.assertEqual(sizes.tolist(), [3 * config.src_item_len, config.src_item_len])
        self.assertEqual(local.base.shape, (2, 3))

    def test_the_three_columns_are_views_of_one_array_the_library_filled(self):
        config = LAYOUT.config(0, 1)
        local, remote, sizes = mori_tp.plan_segments(
            config, np.array(REQUEST.src_pages, dtype=np.int32),
            np.array(REQUEST.dst_pages, dtype=np.int32), as_arrays=True)
        self.assertIsNotNone(local.base)
        self.assertIs(local.base, remote.base)
        self.assertIs(local.base, sizes.base)
        self.assertEqual(local.base.shape, (len(local), 3))
        # The offsets support arithmetic on whole requests, e.g. absolute addresses of a layer.
        base = 0x7F00_0000_0000
        self.assertEqual((base + local).tolist(), [base + x for x in local.tolist()])

    def test_an_empty_plan_is_three_empty_arrays(self):
        config = LAYOUT.config(0, 7)  # prefill rank 0 owns heads 0-1, decode rank 7 head 3
        self.assertIs(config.action, mori_tp.Action.NOT_PAIRED)
        result = mori_tp.plan_segments(config, [1, 2], [3, 4], as_arrays=True)
        self.assertEqual([a.shape for a in result], [(0,), (0,), (0,)])

    def test_send_kvcache_takes_numpy_buffers_and_pages(self):
        config = LAYOUT.config(1, 5)
        src = np.arange(4 * LAYOUT.src_item_len, dtype=np.uint8)
        dst = np.zeros(3 * LAYOUT.dst_item_len, dtype=np.uint8)
        mori_tp.send_kvcache(
            config, [src.ctypes.data], [dst.ctypes.data],
            src_capacity=src.nbytes, dst_capacity=dst.nbytes,
            src_pages=np.array([2, 3], dtype=np.int32), dst_pages=np.array([0, 2]),
            backend="host",
        )
        want = np.zeros_like(dst)
        local, remote, sizes = mori_tp.plan_segments(config, [2, 3], [0, 2])
        for s, r, n in zip(local, remote, sizes):
            want[r:r + n] = src[s:s + n]
        self.assertTrue(np.array_equal(dst, want))
        self.assertGreater(int(np.count_nonzero(dst)), 0)


class WithoutNumpyTest(unittest.TestCase):
    """The package as a machine without numpy sees it."""

    def test_lists_and_arrays_work_and_array_output_says_numpy_is_needed(self):
        config = LAYOUT.config(1, 5)
        with mock.patch.object(mori_tp._core, "_np", None):
            got = mori_tp.plan_segments(config, array.array("i", REQUEST.src_pages),
                                        REQUEST.dst_pages)
            self.assertEqual(len(got[0]), len(REQUEST.src_pages) * LAYOUT.page_size)
            with self.assertRaisesRegex(ImportError, r"as_arrays=True\) needs numpy"):
                mori_tp.plan_segments(config, [0], [0], as_arrays=True)

    def test_array_of_int32_is_passed_by_address_without_a_copy(self):
        pages = array.array("i", REQUEST.src_pages)
        address, length, owner = mori_tp._pages_arg(pages, "src_pages")
        self.assertEqual((address, length), pages.buffer_info())
        self.assertIs(owner, pages)
        # ctypes agrees that the library reads the caller's own memory.
        view = (ctypes.c_int32 * length).from_address(address)
        self.assertEqual(list(view), REQUEST.src_pages)


if __name__ == "__main__":
    unittest.main()
