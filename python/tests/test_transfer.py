"""Whole transfers through the Python API on host buffers, every rank pair, byte for byte: each
decode rank must end with exactly its heads of exactly the requested pages, and nothing else may
change."""

from __future__ import annotations

import array
import ctypes
import unittest
from unittest import mock

import mori_tp
from layouts import (
    SEND,
    Layout,
    Request,
    expected_decode_buffer,
    fragmented_request,
    identified_buffer,
    sentinel_buffer,
)

BUFFERS = 4  # K and V of two layers


def run_transfer(test: unittest.TestCase, layout: Layout, request: Request,
                 page_type=list) -> int:
    """Sends every (prefill rank, decode rank) pair of ``layout`` with send_kvcache and checks
    every byte of every decode buffer. Sources are bytearrays, destinations ctypes arrays.
    Returns the number of sending pairs."""
    src_len = request.src_capacity_pages * layout.src_item_len
    dst_len = request.dst_capacity_pages * layout.dst_item_len
    sources = [
        [identified_buffer(layout, layout.p_tp, p, b, request.src_capacity_pages)
         for b in range(BUFFERS)]
        for p in range(layout.p_tp)
    ]
    for rank in sources:
        for buf in rank:
            test.assertEqual(len(buf), src_len)
    # ctypes views of the bytearrays give their addresses; they also pin the bytearrays' size.
    source_views = [[(ctypes.c_char * src_len).from_buffer(buf) for buf in rank]
                    for rank in sources]
    initial = [[sentinel_buffer(d, b, dst_len) for b in range(BUFFERS)]
               for d in range(layout.d_tp)]
    destinations = [[(ctypes.c_ubyte * dst_len).from_buffer_copy(data) for data in rank]
                    for rank in initial]
    src_pages, dst_pages = page_type(request.src_pages), page_type(request.dst_pages)
    senders = 0
    for p, d in layout.pairs():
        config = layout.config(p, d)
        mori_tp.send_kvcache(
            config,
            [ctypes.addressof(v) for v in source_views[p]],
            [ctypes.addressof(v) for v in destinations[d]],
            src_capacity=src_len,
            dst_capacity=dst_len,
            src_pages=src_pages,
            dst_pages=dst_pages,
            backend="host",
        )
        senders += config.action is SEND
    for d in range(layout.d_tp):
        for b in range(BUFFERS):
            got = bytes(destinations[d][b])
            want = expected_decode_buffer(layout, d, b, initial[d][b], request)
            if got != want:
                at = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
                test.fail(
                    f"{layout}: decode rank {d} buffer {b}: first wrong byte at {at} "
                    f"(page {at // layout.dst_item_len}, byte {at % layout.dst_item_len})"
                )
    # Sources are read, never written.
    for p in range(layout.p_tp):
        for b in range(BUFFERS):
            test.assertEqual(
                sources[p][b], identified_buffer(layout, layout.p_tp, p, b,
                                                 request.src_capacity_pages)
            )
    return senders


class WholeTransferTest(unittest.TestCase):
    def test_decode_replicates_heads_prefill_does_not(self):
        # Qwen2.5-7B-like: 4 KV heads, prefill TP 2, decode TP 8 (the case today's connectors
        # get wrong): each decode rank owns one head, replicated on two decode ranks.
        layout = Layout(heads=4, p_tp=2, d_tp=8, page_size=4, bytes_per_head=6)
        senders = run_transfer(self, layout, fragmented_request(seed=42, runs=5))
        self.assertEqual(senders, 8, "exactly one sender per decode rank")

    def test_prefill_replicates_heads_decode_does_not(self):
        # 2 KV heads on prefill TP 8 (each head on four prefill ranks), decode TP 2.
        layout = Layout(heads=2, p_tp=8, d_tp=2, page_size=2, bytes_per_head=8)
        senders = run_transfer(self, layout, fragmented_request(seed=7, runs=6),
                               page_type=lambda pages: array.array("i", pages))
        self.assertEqual(senders, 2, "one replica sends each head, the others skip")

    def test_both_sides_replicate_with_a_non_integer_tp_ratio(self):
        layout = Layout(heads=4, p_tp=12, d_tp=8, page_size=3, bytes_per_head=5)
        run_transfer(self, layout, fragmented_request(seed=3, runs=4), page_type=tuple)

    def test_non_integer_ratio_without_replication(self):
        layout = Layout(heads=12, p_tp=6, d_tp=4, page_size=2, bytes_per_head=4)
        run_transfer(self, layout, fragmented_request(seed=11, runs=4))

    def test_mla_single_latent_head_on_one_page_tokens(self):
        layout = Layout(heads=1, p_tp=4, d_tp=2, page_size=1, bytes_per_head=12)
        senders = run_transfer(self, layout, fragmented_request(seed=5, runs=7))
        self.assertEqual(senders, 2)

    def test_an_empty_request_changes_nothing(self):
        layout = Layout(heads=8, p_tp=2, d_tp=4, page_size=4, bytes_per_head=4)
        run_transfer(self, layout, Request([], [], 2, 2))


class SendArgumentsTest(unittest.TestCase):
    """What send_kvcache hands the C function, seen by a stand-in for it: the HIP options have
    no observable effect on a machine without a GPU."""

    def capture(self, **kwargs):
        calls = []

        def fake_send(config, buffers, src, dst, num_pages, options):
            # Read everything now: the arrays behind the pointers die when the call returns.
            b = buffers._obj
            calls.append((
                config._obj,
                ([b.src[i] for i in range(b.num_buffers)], [b.dst[i] for i in range(b.num_buffers)],
                 b.src_capacity, b.dst_capacity),
                list((ctypes.c_int32 * num_pages).from_address(src)),
                list((ctypes.c_int32 * num_pages).from_address(dst)),
                options._obj,
            ))
            return 0

        fake_lib = mock.Mock(wraps=mori_tp._lib)
        fake_lib.mori_tp_kvcache_send = fake_send
        layout = Layout(heads=8, p_tp=2, d_tp=4, page_size=4, bytes_per_head=8)
        with mock.patch.object(mori_tp._core, "_lib", fake_lib):
            mori_tp.send_kvcache(
                layout.config(1, 2), [0x1000, 0x2000], [0x3000, 0x4000],
                src_capacity=4096, dst_capacity=2048, src_pages=[3, 4], dst_pages=[5, 6],
                **kwargs,
            )
        self.assertEqual(len(calls), 1)
        return calls[0]

    def test_buffers_pages_and_defaults_reach_the_c_call(self):
        config, buffers, src, dst, options = self.capture()
        self.assertEqual((config.action, config.first_head, config.num_heads), (1, 4, 2))
        self.assertEqual(buffers, ([0x1000, 0x2000], [0x3000, 0x4000], 4096, 2048))
        self.assertEqual((src, dst), ([3, 4], [5, 6]))
        self.assertEqual((options.backend, options.flags, options.stream), (0, 0, None))

    def test_hip_backend_stream_and_synchronize_reach_the_c_call(self):
        options = self.capture(backend="hip", stream=0xABC0, synchronize=True)[-1]
        self.assertEqual((options.backend, options.flags, options.stream), (2, 1, 0xABC0))
        options = self.capture(backend="host", stream=None)[-1]
        self.assertEqual((options.backend, options.flags, options.stream), (1, 0, None))


if __name__ == "__main__":
    unittest.main()
