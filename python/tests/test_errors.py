"""Every error class, raised with a message that names the offending values; a call that raises
changes nothing."""

from __future__ import annotations

import ctypes
import dataclasses
import unittest

import mori_tp
from layouts import Layout
from mori_tp import _errors, _ffi

# Llama-3.1-8B-like: 8 KV heads, head_dim 128, bf16, page size 16, prefill TP 2, decode TP 4.
GOOD = dict(
    prefill_tp_size=2,
    prefill_tp_rank=1,
    decode_tp_size=4,
    decode_tp_rank=3,
    total_kv_heads=8,
    page_size=16,
    src_item_len=16 * 4 * 256,
    dst_item_len=16 * 2 * 256,
)


class ErrorTestCase(unittest.TestCase):
    def assertRaisesNaming(self, cls, parts, function, *args, **kwargs):
        """Asserts ``function`` raises exactly ``cls`` (a MoriError) with every part in its
        message, and returns the exception."""
        with self.assertRaises(cls) as caught:
            function(*args, **kwargs)
        error = caught.exception
        self.assertIs(type(error), cls)
        self.assertIsInstance(error, mori_tp.MoriError)
        self.assertEqual(error.code, cls.code)
        self.assertEqual(str(error), error.message)
        for part in parts:
            self.assertIn(part, error.message)
        return error


class SliceConfigRefusalsTest(ErrorTestCase):
    def test_the_good_layout_is_accepted(self):
        config = mori_tp.slice_config(**GOOD)
        self.assertEqual((config.action, config.first_head, config.num_heads),
                         (mori_tp.Action.SEND, 6, 2))

    def test_heads_and_tp_size_that_divide_neither_way_are_a_topology_error(self):
        self.assertRaisesNaming(
            mori_tp.TopologyError,
            ["mori_tp_slice_config", "decode side", "tp_size 3", "total_kv_heads 8",
             "nearest valid tp sizes: 2 and 4"],
            mori_tp.slice_config, **{**GOOD, "decode_tp_size": 3, "decode_tp_rank": 0},
        )
        self.assertRaisesNaming(mori_tp.TopologyError, ["total_kv_heads is 0"],
                                mori_tp.slice_config, **{**GOOD, "total_kv_heads": 0})

    def test_a_dtype_or_head_dim_mismatch_is_a_layout_mismatch(self):
        # The decode side has fp8 (128 bytes per head) where the prefill side has bf16 (256).
        self.assertRaisesNaming(
            mori_tp.LayoutMismatchError,
            ["decode side: bytes_per_head 128 != prefill side bytes_per_head 256"],
            mori_tp.slice_config, **{**GOOD, "dst_item_len": 16 * 2 * 128},
        )
        self.assertRaisesNaming(
            mori_tp.LayoutMismatchError,
            ["prefill side", "src_item_len 1000", "page_size 16"],
            mori_tp.slice_config, **{**GOOD, "src_item_len": 1000},
        )

    def test_ranks_out_of_range_and_zero_fields_are_invalid_arguments(self):
        self.assertRaisesNaming(
            mori_tp.InvalidArgumentError, ["decode side", "tp_rank 4", "tp_size 4"],
            mori_tp.slice_config, **{**GOOD, "decode_tp_rank": 4},
        )
        self.assertRaisesNaming(mori_tp.InvalidArgumentError, ["page_size is 0"],
                                mori_tp.slice_config, **{**GOOD, "page_size": 0})

    def test_values_that_do_not_fit_their_c_type_are_refused_not_wrapped(self):
        # ctypes would silently turn 2**32 + 2 into 2, a valid TP size.
        self.assertRaisesNaming(
            mori_tp.InvalidArgumentError, ["prefill_tp_size 4294967298", "uint32_t"],
            mori_tp.slice_config, **{**GOOD, "prefill_tp_size": 2**32 + 2},
        )
        self.assertRaisesNaming(
            mori_tp.InvalidArgumentError, ["decode_tp_rank -1"],
            mori_tp.slice_config, **{**GOOD, "decode_tp_rank": -1},
        )
        self.assertRaisesNaming(
            mori_tp.InvalidArgumentError, ["src_item_len 18446744073709551616", "uint64_t"],
            mori_tp.slice_config, **{**GOOD, "src_item_len": 2**64},
        )
        with self.assertRaisesRegex(TypeError, "page_size must be an int, not float"):
            mori_tp.slice_config(**{**GOOD, "page_size": 16.0})


class HandEditedConfigTest(ErrorTestCase):
    def setUp(self):
        self.config = mori_tp.slice_config(**GOOD)  # 2 of the 4 heads of the source token

    def test_a_slice_moved_past_its_token_slot_is_a_slice_overflow(self):
        edited = dataclasses.replace(self.config, src_head_slice_offset=768)
        self.assertRaisesNaming(
            mori_tp.SliceOverflowError,
            ["mori_tp_plan", "prefill side", "offset 768", "width 512", "1024-byte token slot"],
            mori_tp.plan, edited, [0], [0],
        )

    def test_fields_that_disagree_are_invalid_arguments(self):
        edited = dataclasses.replace(self.config, bytes_per_token_src=512)
        self.assertRaisesNaming(
            mori_tp.InvalidArgumentError,
            ["inconsistent config", "bytes_per_token_src 512", "src_item_len / page_size = 1024"],
            mori_tp.plan_segments, edited, [0], [0],
        )
        self.assertRaisesNaming(
            mori_tp.InvalidArgumentError, ["action 7 is not an Action"],
            dataclasses.replace, self.config, action=7,
        )
        with self.assertRaises(TypeError):
            mori_tp.plan(dataclasses.asdict(self.config), [0], [0])

    def test_configs_are_immutable(self):
        with self.assertRaises(dataclasses.FrozenInstanceError):
            self.config.src_head_slice_offset = 0


class PageRefusalsTest(ErrorTestCase):
    def setUp(self):
        self.config = mori_tp.slice_config(**GOOD)

    def test_a_negative_page_is_out_of_bounds(self):
        self.assertRaisesNaming(
            mori_tp.OutOfBoundsError, ["decode side", "page index -3 at position 1 is negative"],
            mori_tp.plan_segments, self.config, [0, 1], [2, -3],
        )

    def test_a_page_that_does_not_fit_in_int32_is_out_of_bounds(self):
        self.assertRaisesNaming(
            mori_tp.OutOfBoundsError, ["plan: src_pages[2] = 2147483648", "int32"],
            mori_tp.plan, self.config, [0, 1, 2**31], [0, 1, 2],
        )

    def test_page_lists_of_different_lengths_are_refused(self):
        self.assertRaisesNaming(
            mori_tp.InvalidArgumentError, ["2 source pages but 1 destination pages"],
            mori_tp.plan, self.config, [0, 1], [0],
        )

    def test_non_integer_pages_are_a_type_error(self):
        with self.assertRaisesRegex(TypeError, "plan: src_pages must be a sequence of ints"):
            mori_tp.plan(self.config, [0.5], [0])
        # Bytes would otherwise be read as raw int32 values: b"\x01\0\0\0" as page 1.
        with self.assertRaisesRegex(TypeError, "dst_pages must be a sequence of ints, not bytes"):
            mori_tp.plan(self.config, [1], b"\x01\0\0\0")

    def test_a_too_small_output_array_is_buffer_too_small(self):
        # The Python functions always size their output first, so this class is only reachable
        # through the raw C function: called here with room for 1 of the 4 segments.
        c_config = self.config._as_c()
        pages = (ctypes.c_int32 * 2)(0, 1)
        out = (_ffi.MoriSegment * 1)()
        needed = ctypes.c_size_t()
        status = mori_tp._lib.mori_tp_plan_segments(
            ctypes.byref(c_config), ctypes.addressof(pages), ctypes.addressof(pages), 2,
            ctypes.addressof(out), 1, ctypes.byref(needed))
        self.assertEqual(status, mori_tp.BufferTooSmallError.code)
        self.assertEqual(needed.value, 2 * 16)
        self.assertRaisesNaming(
            mori_tp.BufferTooSmallError, ["needs 32 entries", "holds 1"],
            mori_tp._raise_last, status,
        )


class SendRefusalsTest(ErrorTestCase):
    """Each refused send leaves every destination byte as it was."""

    def setUp(self):
        layout = Layout(heads=8, p_tp=2, d_tp=4, page_size=4, bytes_per_head=8)
        self.config = layout.config(1, 3)
        self.pages = 6
        self.src_len = self.pages * layout.src_item_len
        self.dst_len = self.pages * layout.dst_item_len
        self.src = [bytearray(range(256)) * (self.src_len // 256 + 1) for _ in range(2)]
        self.src_views = [(ctypes.c_char * self.src_len).from_buffer(b) for b in self.src]
        self.dst = [ctypes.create_string_buffer(b"\x5a" * self.dst_len, self.dst_len)
                    for _ in range(2)]
        self.before = [bytes(b) for b in self.dst]

    def send(self, **overrides):
        args = dict(
            config=self.config,
            src_ptrs=[ctypes.addressof(v) for v in self.src_views],
            dst_ptrs=[ctypes.addressof(b) for b in self.dst],
            src_capacity=self.src_len,
            dst_capacity=self.dst_len,
            src_pages=[0, 1, 4],
            dst_pages=[5, 2, 3],
            backend="host",
        )
        args.update(overrides)
        mori_tp.send_kvcache(**args)

    def assertRefusedUnchanged(self, cls, parts, **overrides):
        error = self.assertRaisesNaming(cls, parts, self.send, **overrides)
        self.assertEqual([bytes(b) for b in self.dst], self.before, "a refused send wrote")
        return error

    def test_the_unchanged_request_does_write(self):
        self.send()
        self.assertNotEqual([bytes(b) for b in self.dst], self.before)

    def test_a_page_past_the_destination_capacity_is_out_of_bounds(self):
        # Pages 0 and 1 would fit: nothing may be written before the last page is checked.
        self.assertRefusedUnchanged(
            mori_tp.OutOfBoundsError,
            ["mori_tp_kvcache_send", "decode side", "page 6 at position 2", "dst_capacity"],
            dst_pages=[0, 1, 6],
        )

    def test_a_null_buffer_address_is_a_null_pointer(self):
        dst_ptrs = [ctypes.addressof(self.dst[0]), 0]
        self.assertRefusedUnchanged(mori_tp.NullPointerError, ["buffers.dst[1] is NULL"],
                                    dst_ptrs=dst_ptrs)

    def test_a_slice_overflow_moves_nothing(self):
        edited = dataclasses.replace(self.config, dst_head_slice_offset=32)
        self.assertRefusedUnchanged(mori_tp.SliceOverflowError, ["decode side", "offset 32"],
                                    config=edited)

    def test_bad_arguments_are_invalid_and_move_nothing(self):
        cases = [
            (dict(dst_ptrs=[ctypes.addressof(self.dst[0])]),
             ["2 source buffers but 1 destination buffers"]),
            (dict(dst_pages=[5, 2]), ["3 source pages but 2 destination pages"]),
            (dict(backend="metal"), ["backend 'metal'", "'auto', 'host', 'hip', 'cuda'"]),
            (dict(stream=0x1234), ["options.stream", "host backend", "takes no stream"]),
            (dict(src_ptrs=[-1, 1]), ["src_ptrs[0] -1"]),
            (dict(dst_capacity=2**64), ["dst_capacity 18446744073709551616"]),
        ]
        for overrides, parts in cases:
            with self.subTest(overrides=overrides):
                self.assertRefusedUnchanged(mori_tp.InvalidArgumentError, parts, **overrides)
        with self.assertRaisesRegex(TypeError, "stream must be an int handle"):
            self.send(stream=object())
        self.assertEqual([bytes(b) for b in self.dst], self.before)

    def test_hip_without_a_hip_device_is_backend_unavailable(self):
        try:  # A probe that moves nothing: is HIP built in, with a device?
            self.send(src_pages=[], dst_pages=[], backend="hip")
        except mori_tp.BackendUnavailableError:
            pass
        else:
            self.skipTest("this libmori_tp has a usable HIP backend")
        self.assertRefusedUnchanged(mori_tp.BackendUnavailableError, ["HIP"], backend="hip")


class GpuCountersTest(ErrorTestCase):
    def test_gpu_counters_are_zero_before_use_and_refuse_other_backends(self):
        # Read without loading a driver: this process sends on no GPU backend.
        names = [name for name, _ in _ffi.MoriTpGpuCounters._fields_]
        self.assertEqual(ctypes.sizeof(_ffi.MoriTpGpuCounters), 8 * len(names))
        for backend in ("cuda", "hip"):
            try:
                counters = mori_tp.gpu_counters(backend)
            except mori_tp.BackendUnavailableError as error:
                self.assertIn("not built in", error.message)
                continue
            self.assertEqual(counters, dict.fromkeys(names, 0))
        self.assertRaisesNaming(
            mori_tp.InvalidArgumentError, ["'host'", "'cuda' or 'hip'"], mori_tp.gpu_counters, "host"
        )
        out = _ffi.MoriTpGpuCounters()
        status = mori_tp._lib.mori_tp_gpu_counters_get(_ffi.MORI_BACKEND_HOST, ctypes.byref(out))
        self.assertEqual(status, mori_tp.InvalidArgumentError.code)
        self.assertIn("GPU backends", mori_tp._lib.mori_last_error_message().decode())


class StatusTableTest(unittest.TestCase):
    def test_every_status_code_maps_to_the_class_the_library_names(self):
        for code in range(1, 12):
            cls = _errors.ERROR_CLASSES[code]
            name = mori_tp._lib.mori_tp_status_name(code).decode()
            self.assertEqual(cls.status, name)
            error = _errors.error_for(code, f"message {code}")
            self.assertIs(type(error), cls)
            self.assertEqual((error.code, str(error)), (code, f"message {code}"))
        self.assertEqual(len(set(_errors.ERROR_CLASSES.values())), 11)
        self.assertEqual(mori_tp.PoolFullError.status, "MORI_ERR_POOL_FULL")
        self.assertEqual(mori_tp.GpuError.status, "MORI_ERR_GPU")
        self.assertEqual(mori_tp.InternalError.status, "MORI_ERR_PANIC")

    def test_an_unknown_code_is_a_plain_mori_error_with_that_code(self):
        self.assertEqual(mori_tp._lib.mori_tp_status_name(12), b"MORI_ERR_UNKNOWN")
        self.assertEqual(mori_tp._lib.mori_tp_status_name(99), b"MORI_ERR_UNKNOWN")
        error = _errors.error_for(99, "from a newer library")
        self.assertIs(type(error), mori_tp.MoriError)
        self.assertEqual((error.code, error.message), (99, "from a newer library"))


if __name__ == "__main__":
    unittest.main()
