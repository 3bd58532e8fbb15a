"""mori_tp.engines in one process, against stand-ins for the engines (engine_fakes.py): request
plans and their refusals, and each transport's calls and bytes. The real engines run between
two processes in engine_loopback.py."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
import random
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any, List
from unittest import mock

import mori_tp
import pair_oracle
from layouts import (
    Layout,
    fragmented_request,
    identified_buffer,
    sentinel_buffer,
    tools_required,
)
from mori_tp import Action, Staging
from pair_oracle import Deployment

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

if np is not None:
    from engine_fakes import FakeMemoryDesc, FakeMooncake, FakeMoriIo, FakeNixlAgent
    from engine_fakes import FakeStatus
    from mori_tp.engines import (
        KvMemory,
        TransferError,
        TransferTimeoutError,
        new_token,
        plan_request,
        unpack_request,
    )
    from mori_tp.engines.mooncake import MooncakeTransport
    from mori_tp.engines.mori_io import MoriIoTransport
    from mori_tp.engines.nixl import NixlTransport

needs_numpy = unittest.skipIf(np is None, "numpy is not installed")

#: A wait that a working fake never approaches.
LONG_WAIT = 30.0

BUFFERS = 4
LAYOUTS = {
    Staging.SRC: Layout(heads=4, p_tp=2, d_tp=8, page_size=16, bytes_per_head=8),
    Staging.DST: Layout(heads=8, p_tp=8, d_tp=2, page_size=4, bytes_per_head=8),
    Staging.BOTH: Layout(heads=12, p_tp=6, d_tp=4, page_size=16, bytes_per_head=4),
}
REQUEST = fragmented_request(seed=21, runs=4)
#: Over 2048 segments per-token (Mooncake's default per-peer queue).
LONG_REQUEST = fragmented_request(seed=22, runs=24)


def sending_pairs(layout: Layout) -> List[tuple]:
    return [(p, d) for p, d in layout.pairs() if layout.config(p, d).action is Action.SEND]


def pair_staged(staging: Staging) -> tuple:
    """A pair of LAYOUTS[staging] for which staging_for chooses ``staging``."""
    layout = LAYOUTS[staging]
    return next((p, d) for p, d in sending_pairs(layout)
                if mori_tp.staging_for(layout.config(p, d)) is staging)


class Sides:
    """One pair's prefill and decode memory in this process, each with a staging region, and
    what the decode buffers must hold after the request (one send_kvcache)."""

    def __init__(self, layout: Layout, p: int, d: int, request=REQUEST,
                 buffers: int = BUFFERS) -> None:
        self.config = layout.config(p, d)
        self.request = request
        self.allocate(
            [identified_buffer(layout, layout.p_tp, p, b, request.src_capacity_pages)
             for b in range(buffers)],
            [sentinel_buffer(d, b, request.dst_capacity_pages * layout.dst_item_len)
             for b in range(buffers)],
            mori_tp.staging_len(self.config, len(request.src_pages)),
        )

    def send(self, want: List["np.ndarray"]) -> None:
        """One send_kvcache of the request, from the sources into ``want``."""
        mori_tp.send_kvcache(self.config, self.local.buffers, [w.ctypes.data for w in want],
                             src_capacity=self.local.capacity, dst_capacity=self.remote.capacity,
                             src_pages=self.request.src_pages, dst_pages=self.request.dst_pages,
                             backend="host")

    def allocate(self, sources: List[bytes], initial: List[bytes], staging_len: int) -> None:
        """Source and destination buffers holding these bytes, and staging pools for a
        request of ``staging_len`` bytes per buffer."""
        self.buffers = len(sources)
        src_len, dst_len = len(sources[0]), len(initial[0])
        self.src = [np.frombuffer(data, dtype=np.uint8).copy() for data in sources]
        self.initial = [np.frombuffer(data, dtype=np.uint8) for data in initial]
        self.dst = [x.copy() for x in self.initial]
        self.staging_bytes = self.buffers * staging_len
        # Pools larger than one request, with the request's slot in the middle.
        self.src_pool = np.zeros(3 * self.staging_bytes + 64, dtype=np.uint8)
        self.dst_pool = np.zeros(3 * self.staging_bytes + 64, dtype=np.uint8)
        self.slot = self.staging_bytes + 16
        self.local = KvMemory(tuple(x.ctypes.data for x in self.src), src_len,
                              self.src_pool.ctypes.data + self.slot, self.staging_bytes)
        self.remote = KvMemory(tuple(x.ctypes.data for x in self.dst), dst_len,
                               self.dst_pool.ctypes.data + self.slot, self.staging_bytes)
        # What the engines register: the buffers and the whole pools.
        self.local_registered = dataclasses.replace(
            self.local, staging=self.src_pool.ctypes.data, staging_capacity=self.src_pool.nbytes)
        self.remote_registered = dataclasses.replace(
            self.remote, staging=self.dst_pool.ctypes.data, staging_capacity=self.dst_pool.nbytes)
        self.want = [x.copy() for x in self.initial]
        self.send(self.want)
        #: The request's token, as a connector exchanges it with the slot and pages: the
        #: plans carry it, and test_streaming's expect passes it to the Receiver.
        self.token = new_token()

    def plan(self, staging=None):
        return plan_request(self.config, self.request.src_pages, self.request.dst_pages,
                            local=self.local, remote=self.remote, staging=staging,
                            token=self.token)

    def receive(self, staging) -> None:
        unpack_request(self.config, self.request.dst_pages, memory=self.remote,
                       staging=staging, backend="host")

    def assert_delivered(self, test: unittest.TestCase, what: str) -> None:
        for b in range(self.buffers):
            if not np.array_equal(self.dst[b], self.want[b]):
                at = int(np.flatnonzero(self.dst[b] != self.want[b])[0])
                test.fail(f"{what}: decode buffer {b} differs from send_kvcache's first at {at}")
        test.assertFalse(all(np.array_equal(x, y) for x, y in zip(self.dst, self.initial)),
                         f"{what}: nothing was written")


class PairSides(Sides):
    """The same for a pair of two layouts (pair_oracle.Deployment): one send_kvcache_pair."""

    def __init__(self, deployment: Deployment, p: int, d: int, tokens: int, seed: int) -> None:
        pages = deployment.request(tokens, seed)
        prefill, decode = deployment.layouts(p, d, pages)
        self.config = mori_tp.pair_config(prefill, decode)
        self.request = pages.api()
        rng = random.Random(seed)
        self.allocate([rng.randbytes(pair_oracle.capacity(prefill, pages.src_capacity_pages))
                    for _ in range(BUFFERS)],
                   [rng.randbytes(pair_oracle.capacity(decode, pages.dst_capacity_pages))
                    for _ in range(BUFFERS)],
                   mori_tp.pair_staging_len(self.config, tokens))

    def send(self, want: List["np.ndarray"]) -> None:
        mori_tp.send_kvcache_pair(self.config, self.local.buffers, [w.ctypes.data for w in want],
                                  src_capacity=self.local.capacity,
                                  dst_capacity=self.remote.capacity, request=self.request,
                                  backend="host")

    def plan(self, staging=None):
        return plan_request(self.config, self.request, local=self.local, remote=self.remote,
                            staging=staging, token=self.token)

    def receive(self, staging) -> None:
        unpack_request(self.config, self.request, memory=self.remote, staging=staging,
                       backend="host")


#: Pairs of two layouts for which pair_staging_for chooses each mode, with partial last pages.
PAIR_CASES = {
    # HND TP 2 -> 8 (4 heads), decode page 64: the decode page is the one head, SRC.
    Staging.SRC: (Deployment("hnd 16 to 64", 4, 2, 8, "hnd", 16, "hnd", 64), 0, 1, 90),
    # NHD TP 8 -> 2 (8 heads), page 64 -> 16: the prefill token is the one head, DST.
    Staging.DST: (Deployment("nhd 64 to 16", 8, 8, 2, "nhd", 64, "nhd", 16), 5, 1, 150),
    # NHD TP 6 -> HND TP 4 (12 heads): one head of two to one of three, BOTH.
    Staging.BOTH: (Deployment("nhd to hnd h12", 12, 6, 4, "nhd", 16, "hnd", 16), 1, 0, 70),
    # HND TP 8 -> 8: pages of one head on both sides, NONE.
    Staging.NONE: (Deployment("hnd tp8to8", 8, 8, 8, "hnd", 16, "hnd", 16), 5, 5, 45),
}


class EveryPairStagingMixin:
    """For each transport: pair configs in every staging mode, as the slice configs are."""

    def move(self, sides: Sides, staging) -> Staging:
        """Sends ``sides``'s request with ``staging``, receives it; returns the staging used."""
        raise NotImplementedError

    def test_pair_configs_move_every_staging_byte_for_byte(self):
        for chosen, (deployment, p, d, tokens) in PAIR_CASES.items():
            for staging in (None, *Staging):
                sides = PairSides(deployment, p, d, tokens, seed=int(chosen))
                used = self.move(sides, staging)
                self.assertIs(used, chosen if staging is None else staging)
                sides.assert_delivered(self, f"{type(self).__name__} {deployment.name} "
                                             f"{used.name}")



@needs_numpy
class KvMemoryTest(unittest.TestCase):
    def test_regions_and_the_handshake_form(self):
        memory = KvMemory((0x1000, 0x9000), 0x800, 0x20000, 0x400)
        self.assertEqual(memory.regions(),
                         [(0x1000, 0x800), (0x9000, 0x800), (0x20000, 0x400)])
        self.assertEqual(KvMemory.from_dict(memory.to_dict()), memory)
        self.assertEqual(KvMemory([0x1000], 64).regions(), [(0x1000, 64)])
        self.assertEqual(KvMemory(np.array([5, 6], dtype=np.uint64), 8).buffers, (5, 6))

    def test_bad_fields_are_refused(self):
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "staging_capacity 64"):
            KvMemory((0x1000,), 64, 0, 64)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "capacity -1"):
            KvMemory((0x1000,), -1)
        with self.assertRaisesRegex(TypeError, "buffers\\[0\\]"):
            KvMemory(("0x1000",), 64)


@needs_numpy
class PlanRequestTest(unittest.TestCase):
    def setUp(self):
        self.layout = LAYOUTS[Staging.SRC]
        self.sides = Sides(self.layout, 0, 1)

    def test_the_default_staging_is_staging_for_and_addresses_cover_every_buffer(self):
        plan = self.sides.plan()
        self.assertIs(plan.staging, mori_tp.staging_for(self.sides.config))
        self.assertIs(plan.staging, Staging.SRC)
        src, dst, lengths = plan.addresses()
        per_buffer = len(plan.lengths)
        self.assertEqual(len(src), BUFFERS * per_buffer)
        self.assertEqual(plan.segments, BUFFERS * per_buffer)
        self.assertEqual(plan.bytes, BUFFERS * int(plan.lengths.sum()))
        for b in range(BUFFERS):
            part = slice(b * per_buffer, (b + 1) * per_buffer)
            # SRC: from buffer b's part of the local staging region, to decode buffer b.
            self.assertEqual(src[part].tolist(), (self.sides.local.staging + b * plan.staging_len
                                                  + plan.src_offsets).tolist())
            self.assertEqual(dst[part].tolist(),
                             (self.sides.remote.buffers[b] + plan.dst_offsets).tolist())
        local, remote, sizes = mori_tp.plan_transfer(self.sides.config, Staging.SRC,
                                                     REQUEST.src_pages, REQUEST.dst_pages)
        self.assertEqual((plan.src_offsets.tolist(), plan.dst_offsets.tolist(),
                          plan.lengths.tolist()), (local, remote, sizes))

    def test_buffer_counts_must_match(self):
        remote = dataclasses.replace(self.sides.remote, buffers=self.sides.remote.buffers[:-1])
        # The library's message: local is the prefill (source) side, remote the decode side.
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                    f"{BUFFERS} source buffers but {BUFFERS - 1} destination"):
            plan_request(self.sides.config, REQUEST.src_pages, REQUEST.dst_pages,
                         local=self.sides.local, remote=remote)

    def test_a_page_past_either_capacity_is_out_of_bounds(self):
        dst_pages = list(REQUEST.dst_pages)
        dst_pages[2] = REQUEST.dst_capacity_pages
        end = (dst_pages[2] + 1) * self.sides.config.dst_item_len
        with self.assertRaisesRegex(mori_tp.OutOfBoundsError,
                                    f"decode side: page {dst_pages[2]} at position 2 ends at byte "
                                    f"{end}, past dst_capacity {self.sides.remote.capacity}"):
            plan_request(self.sides.config, REQUEST.src_pages, dst_pages,
                         local=self.sides.local, remote=self.sides.remote)
        small = dataclasses.replace(self.sides.local, capacity=self.sides.config.src_item_len)
        with self.assertRaisesRegex(mori_tp.OutOfBoundsError, "prefill side: .* past src_capacity"):
            plan_request(self.sides.config, REQUEST.src_pages, REQUEST.dst_pages,
                         local=small, remote=self.sides.remote)

    def test_negative_pages_and_pages_beyond_int32_are_refused_by_the_library(self):
        for bad in (-1, 1 << 31):
            pages = list(REQUEST.src_pages)
            pages[1] = bad
            with self.assertRaisesRegex(mori_tp.OutOfBoundsError, str(bad)):
                plan_request(self.sides.config, pages, REQUEST.dst_pages,
                             local=self.sides.local, remote=self.sides.remote)

    def test_a_staging_region_too_small_on_either_side_names_both_sizes(self):
        needed = self.sides.staging_bytes
        remote = dataclasses.replace(self.sides.remote, staging_capacity=needed - 1)
        with self.assertRaisesRegex(mori_tp.BufferTooSmallError,
                                    f"decode side: staging_capacity {needed - 1} is below the "
                                    f"{needed} bytes the request needs"):
            plan_request(self.sides.config, REQUEST.src_pages, REQUEST.dst_pages,
                         local=self.sides.local, remote=remote, staging=Staging.BOTH)
        local = dataclasses.replace(self.sides.local, staging=0, staging_capacity=0)
        with self.assertRaisesRegex(mori_tp.BufferTooSmallError,
                                    "prefill side: staging_capacity 0 is below"):
            plan_request(self.sides.config, REQUEST.src_pages, REQUEST.dst_pages,
                         local=local, remote=self.sides.remote)
        # Without staging on a side, that side needs no region.
        plan_request(self.sides.config, REQUEST.src_pages, REQUEST.dst_pages,
                     local=local, remote=remote, staging=Staging.NONE)

    def test_unknown_staging_values_are_refused_on_both_ranks(self):
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "staging 5"):
            self.sides.plan(staging=5)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "staging 5"):
            self.sides.receive(5)

    def test_a_pair_that_is_not_send_moves_nothing(self):
        config = self.layout.config(1, 1)
        self.assertIsNot(config.action, Action.SEND)
        plan = plan_request(config, REQUEST.src_pages, REQUEST.dst_pages,
                            local=self.sides.local, remote=self.sides.remote)
        self.assertEqual((plan.staging, plan.segments, plan.bytes), (Staging.NONE, 0, 0))
        self.assertEqual([len(a) for a in plan.addresses()], [0, 0, 0])


@needs_numpy
class PairPlanRequestTest(unittest.TestCase):
    """plan_request and unpack_request with a PairConfig and a Request."""

    def setUp(self):
        deployment, p, d, tokens = PAIR_CASES[Staging.SRC]
        self.sides = PairSides(deployment, p, d, tokens, seed=31)

    def test_the_default_staging_is_pair_staging_for_and_the_segments_are_pair_segments(self):
        sides = self.sides
        plan = sides.plan()
        self.assertIs(plan.staging, mori_tp.pair_staging_for(sides.config))
        self.assertIs(plan.request, sides.request)
        self.assertEqual(plan.staging_len, sides.staging_bytes // BUFFERS)
        self.assertEqual((plan.src_pages.tolist(), plan.dst_pages.tolist()),
                         (list(sides.request.src_pages), list(sides.request.dst_pages)))
        self.assertEqual(
            (plan.src_offsets.tolist(), plan.dst_offsets.tolist(), plan.lengths.tolist()),
            mori_tp.pair_segments(sides.config, sides.request, Staging.SRC))
        src, dst, _ = plan.addresses()
        per_buffer = len(plan.lengths)
        for b in range(BUFFERS):
            part = slice(b * per_buffer, (b + 1) * per_buffer)
            self.assertEqual(src[part].tolist(), (sides.local.staging + b * plan.staging_len
                                                  + plan.src_offsets).tolist())
            self.assertEqual(dst[part].tolist(),
                             (sides.remote.buffers[b] + plan.dst_offsets).tolist())

    def test_pack_then_the_segments_then_unpack_deliver_the_request(self):
        for staging in Staging:
            sides = PairSides(*PAIR_CASES[Staging.SRC], seed=32)
            plan = sides.plan(staging)
            plan.pack(backend="host")
            for s, t, n in zip(*plan.addresses()):
                ctypes.memmove(int(t), int(s), int(n))
            sides.receive(staging)
            sides.assert_delivered(self, f"pair {staging.name}")

    def test_the_library_refuses_pages_and_regions_with_its_messages(self):
        sides, request = self.sides, self.sides.request
        short = mori_tp.Request(request.src_pages[:-1], request.dst_pages, request.num_tokens)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                    "^mori_tp_check_pair_transfer: .*prefill side: 5 pages for "
                                    "90 tokens of page_size 16"):
            plan_request(sides.config, short, local=sides.local, remote=sides.remote)
        # Room for one page: the request's other pages end past it.
        remote = dataclasses.replace(sides.remote, capacity=sides.config.dst.page_stride)
        with self.assertRaisesRegex(mori_tp.OutOfBoundsError,
                                    "^mori_tp_check_pair_transfer: .*decode side: page"):
            plan_request(sides.config, request, local=sides.local, remote=remote)
        needed = sides.staging_bytes
        local = dataclasses.replace(sides.local, staging_capacity=needed - 1)
        with self.assertRaisesRegex(mori_tp.BufferTooSmallError,
                                    f"prefill side: staging_capacity {needed - 1} is below the "
                                    f"{needed} bytes"):
            plan_request(sides.config, request, local=local, remote=sides.remote)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "staging 5"):
            sides.plan(staging=5)
        with self.assertRaisesRegex(mori_tp.InvalidArgumentError, "staging 5"):
            sides.receive(5)

    def test_each_family_takes_its_own_request_form(self):
        sides, request = self.sides, self.sides.request
        with self.assertRaisesRegex(TypeError, "with a PairConfig, pass one Request"):
            plan_request(sides.config, request.src_pages, request.dst_pages, local=sides.local,
                         remote=sides.remote)
        sliced = LAYOUTS[Staging.SRC].config(0, 1)
        with self.assertRaisesRegex(TypeError, "with a SliceConfig, pass src_pages and dst_pages"):
            plan_request(sliced, request, local=sides.local, remote=sides.remote)


@needs_numpy
class MooncakeTransportTest(EveryPairStagingMixin, unittest.TestCase):
    def move(self, sides: Sides, staging) -> Staging:
        sender, receiver = self.transports(sides)
        result = sender.send(receiver.session_id, sides.plan(staging))
        sides.receive(result.staging)
        return result.staging

    def transports(self, sides: Sides):
        peers = {}
        prefill, decode = FakeMooncake(15001, peers), FakeMooncake(15002, peers)
        peers["127.0.0.1:15002"] = decode
        peers["127.0.0.1:15001"] = prefill  # the decode rank answers (done, cancel)
        sender = MooncakeTransport(prefill)
        receiver = MooncakeTransport(decode)
        sender.register(sides.local_registered)
        receiver.register(sides.remote_registered)
        return sender, receiver

    def test_every_staging_moves_the_request_byte_for_byte(self):
        for chosen, layout in LAYOUTS.items():
            for staging in (None, *Staging):
                sides = Sides(layout, *pair_staged(chosen))
                sender, receiver = self.transports(sides)
                result = sender.send(receiver.session_id, sides.plan(staging))
                self.assertIs(result.staging, chosen if staging is None else staging)
                sides.receive(result.staging)
                sides.assert_delivered(self, f"mooncake {layout} {result.staging.name}")

    def test_long_lists_are_split_to_fit_the_per_peer_queue(self):
        sides = Sides(LAYOUTS[Staging.SRC], 0, 1, LONG_REQUEST)
        sender, receiver = self.transports(sides)
        plan = sides.plan(Staging.NONE)
        self.assertGreater(plan.segments, 2048)
        result = sender.send(receiver.session_id, plan)
        sizes = [n for _, n in sender.engine.calls]
        self.assertEqual(sum(sizes), plan.segments)
        self.assertEqual(sizes[:-1], [1024] * (len(sizes) - 1))
        self.assertEqual(result.calls, len(sizes))
        sides.receive(Staging.NONE)
        sides.assert_delivered(self, "mooncake in chunks")

    def test_a_failing_call_names_the_segments_and_what_was_written(self):
        sides = Sides(LAYOUTS[Staging.SRC], 0, 1, LONG_REQUEST)
        sender, receiver = self.transports(sides)
        # An environment that raised the engine's queue, with calls past the fake's 2048.
        sender.budget.capacity = sender.max_segments_per_call = 2100
        plan = sides.plan(Staging.NONE)
        with self.assertRaisesRegex(TransferError,
                                    f"returned -1 for segments 0..2099 of {plan.segments}"):
            sender.send(receiver.session_id, plan)

    def test_registration_and_its_failure(self):
        sides = Sides(LAYOUTS[Staging.SRC], 0, 1)
        engine = FakeMooncake(15001, {})
        MooncakeTransport(engine).register(sides.local_registered)
        self.assertEqual(engine.memory.regions, sides.local_registered.regions())
        engine.register_status = -2
        with self.assertRaisesRegex(TransferError, "register_memory\\(0x[0-9a-f]+, \\d+\\) "
                                                   "returned -2"):
            MooncakeTransport(engine).register(sides.local_registered)
        self.assertEqual(MooncakeTransport(engine, hostname="10.1.2.3").session_id,
                         "10.1.2.3:15001")


@needs_numpy
class NixlTransportTest(EveryPairStagingMixin, unittest.TestCase):
    def move(self, sides: Sides, staging) -> Staging:
        sender, receiver = self.transports(sides)
        result = sender.send("decode", sides.plan(staging), notification=b"pair")
        receiver.wait_notification("prefill", b"pair", timeout=1)
        sides.receive(result.staging)
        return result.staging

    def transports(self, sides: Sides):
        agents = {}
        sender = NixlTransport(FakeNixlAgent("prefill", agents))
        receiver = NixlTransport(FakeNixlAgent("decode", agents))
        sender.register(sides.local_registered)
        receiver.register(sides.remote_registered)
        peer = sender.add_peer(receiver.metadata())
        self.assertEqual(peer, "decode")
        return sender, receiver

    def test_every_staging_moves_the_request_and_notifies_after_the_data(self):
        for chosen, layout in LAYOUTS.items():
            for staging in (None, *Staging):
                sides = Sides(layout, *pair_staged(chosen))
                sender, receiver = self.transports(sides)
                result = sender.send("decode", sides.plan(staging), notification=b"req-7")
                self.assertEqual(sender.agent.transfers, [("decode", result.segments, b"req-7")])
                self.assertEqual(sender.agent.released, 1)
                receiver.wait_notification("prefill", b"req-7", timeout=1)
                sides.receive(result.staging)
                sides.assert_delivered(self, f"nixl {layout} {result.staging.name}")

    def test_notifications_match_exactly_and_are_consumed(self):
        sides = Sides(LAYOUTS[Staging.DST], 0, 0)
        sender, receiver = self.transports(sides)
        sender.send("decode", sides.plan(), notification=b"req-10")
        with self.assertRaisesRegex(TransferError, "no notification b'req-1' from prefill"):
            receiver.wait_notification("prefill", b"req-1", timeout=0.05)
        receiver.wait_notification("prefill", b"req-10", timeout=1)
        with self.assertRaisesRegex(TransferError, "no notification b'req-10'"):
            receiver.wait_notification("prefill", b"req-10", timeout=0.05)

    def test_a_pair_that_is_not_send_posts_no_transfer_but_still_notifies(self):
        sides = Sides(LAYOUTS[Staging.DST], 0, 0)
        sender, receiver = self.transports(sides)
        config = LAYOUTS[Staging.DST].config(4, 0)  # head 4 is not decode rank 0's
        self.assertIsNot(config.action, Action.SEND)
        plan = plan_request(config, REQUEST.src_pages, REQUEST.dst_pages, local=sides.local,
                            remote=sides.remote)
        result = sender.send("decode", plan, notification=b"req-3")
        self.assertEqual((result.calls, result.segments), (0, 0))
        self.assertEqual(sender.agent.transfers, [])
        receiver.wait_notification("prefill", b"req-3", timeout=1)

    def test_a_failed_or_stuck_transfer_is_an_error_and_its_handle_is_released(self):
        sides = Sides(LAYOUTS[Staging.DST], 0, 0)
        sender, _ = self.transports(sides)
        sender.agent.final_state = "ERR"
        with self.assertRaisesRegex(TransferError, "segments to decode ended in state ERR"):
            sender.send("decode", sides.plan())
        sender.agent.polls = None
        with self.assertRaisesRegex(TransferError, "still in progress after 0.05 s"):
            sender.send("decode", sides.plan(), timeout=0.05)
        self.assertEqual(sender.agent.released, 2)


@needs_numpy
class MoriIoTransportTest(EveryPairStagingMixin, unittest.TestCase):
    """MORI-IO cannot run here (libamdhip64 7, an RDMA NIC): its adapter is checked against the
    calls a recording stand-in receives."""

    def move(self, sides: Sides, staging) -> Staging:
        sender, _ = self.transports(sides)
        result = sender.send("decode-engine", sides.plan(staging))
        sides.receive(result.staging)
        return result.staging

    def transports(self, sides: Sides):
        sender = MoriIoTransport(FakeMoriIo("prefill-engine"), location="CPU")
        receiver = MoriIoTransport(FakeMoriIo("decode-engine"), location="CPU")
        self.local_descs = sender.register_descs(sides.local_registered)
        remote_descs = receiver.register_descs(sides.remote_registered)
        sender.add_remote_memory("decode-engine", remote_descs)
        return sender, receiver

    def test_the_recorded_calls_are_plan_transfer_offsets_per_buffer(self):
        sides = Sides(LAYOUTS[Staging.SRC], 1, 6)
        sender, receiver = self.transports(sides)
        registrations = [call for call in sender.engine.calls if call[0] == "register_memory"]
        self.assertEqual([args for _, args in registrations],
                         [(a, n, -1, "CPU") for a, n in sides.local_registered.regions()])
        plan = sides.plan()
        result = sender.send("decode-engine", plan)
        batch = [args for name, args in sender.engine.calls if name == "batch_write"]
        self.assertEqual(len(batch), 1)
        local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids = batch[0]
        local, remote, lengths = mori_tp.plan_transfer(sides.config, Staging.SRC,
                                                       REQUEST.src_pages, REQUEST.dst_pages)
        staging_desc = self.local_descs[-1]  # the pool: registered last
        slot_len = plan.staging_len
        self.assertEqual(local_descs, [staging_desc] * BUFFERS)
        self.assertEqual(local_offsets,
                         [[sides.slot + b * slot_len + x for x in local] for b in range(BUFFERS)])
        self.assertEqual([d.data for d in remote_descs], list(sides.remote.buffers))
        self.assertEqual(remote_offsets, [remote] * BUFFERS)
        self.assertEqual(sizes, [lengths] * BUFFERS)
        self.assertEqual(uids, [101, 102, 103, 104])
        self.assertEqual(result.transfer_ids, (101, 102, 103, 104))
        self.assertEqual((result.calls, result.segments), (1, BUFFERS * len(lengths)))
        sides.receive(result.staging)
        sides.assert_delivered(self, "mori-io SRC")

    def test_every_staging_moves_the_request_byte_for_byte(self):
        for chosen, layout in LAYOUTS.items():
            for staging in (None, *Staging):
                sides = Sides(layout, *pair_staged(chosen))
                sender, _ = self.transports(sides)
                result = sender.send("decode-engine", sides.plan(staging))
                sides.receive(result.staging)
                sides.assert_delivered(self, f"mori-io {layout} {result.staging.name}")

    def test_failures_unknown_peers_and_unregistered_memory_are_errors(self):
        sides = Sides(LAYOUTS[Staging.BOTH], 0, 0)
        sender, _ = self.transports(sides)
        sender.engine.fail_entry = 2
        with self.assertRaisesRegex(TransferError, "entry 2 \\(buffer 2\\) to decode-engine "
                                                   "failed: code ERR_RDMA_OP, remote QP"):
            sender.send("decode-engine", sides.plan())
        with self.assertRaisesRegex(TransferError, "no remote memory recorded for peer 'other'"):
            sender.send("other", sides.plan())
        sender.engine.fail_entry = None
        lonely = MoriIoTransport(FakeMoriIo("lonely"), location="CPU")
        lonely.add_remote_memory("decode-engine", [FakeMemoryDesc("d", 1, 1, -1, "CPU")])
        with self.assertRaisesRegex(TransferError, "local buffer 0 \\[0x[0-9a-f]+, \\+\\d+\\) "
                                                   "is not inside a registered region"):
            lonely.send("decode-engine", sides.plan(Staging.NONE))


    def test_a_timeout_is_engine_busy_and_a_failure_waits_for_the_other_entries(self):
        """p9: MORI-IO cannot cancel a transfer, so an entry still in progress at the timeout
        raises TransferTimeoutError with engine_busy, the peer and the request; an entry that
        failed is reported once every other entry has ended, not while they still move."""
        sides = Sides(LAYOUTS[Staging.BOTH], 0, 0)
        sender, _ = self.transports(sides)
        polls = {"per_entry": None}
        ended: List[bool] = []

        class Status(FakeStatus):
            """Ends after ``per_entry`` polls of its own if it succeeds, at once if it
            fails; never while ``per_entry`` is None."""

            def __init__(self, ok: bool) -> None:
                super().__init__(ok, "remote QP in error state")
                self.left = polls["per_entry"]

            def _ended(self) -> bool:
                if self.left is None:
                    return False
                if not self.ok:
                    return True
                self.left -= 1
                if self.left == 0:
                    ended.append(True)
                return self.left <= 0

            def Succeeded(self):  # noqa: N802
                return self.ok and self._ended()

            def Failed(self):  # noqa: N802
                return not self.ok and self._ended()

            def InProgress(self):  # noqa: N802
                return self.ok and self.left is not None and self.left > 0

        real = sender.engine.batch_write

        def batch_write(*args):
            return [Status(s.ok) for s in real(*args)]

        sender.engine.batch_write = batch_write
        with self.assertRaises(TransferTimeoutError) as caught:
            sender.send("decode-engine", sides.plan(), timeout=0.05, request_id="m-1")
        error = caught.exception
        self.assertTrue(error.engine_busy)
        self.assertEqual((error.peer, error.request_id), ("decode-engine", "m-1"))
        self.assertIn("still in progress after 0.05 s", str(error))
        # Entry 0 fails at once, the others end later: the failure is raised after them.
        sender.engine.fail_entry = 0
        polls["per_entry"] = 20
        with self.assertRaisesRegex(TransferError, "entry 0 \\(buffer 0\\) to decode-engine "
                                                   "\\(request m-2\\) failed") as caught:
            sender.send("decode-engine", sides.plan(), timeout=LONG_WAIT, request_id="m-2")
        self.assertFalse(caught.exception.engine_busy)
        self.assertEqual(len(ended), sides.buffers - 1,
                         "raised while other entries were still in progress")

    def test_entries_left_in_init_after_a_failure_do_not_hold_the_error(self):
        """MORI-IO's batch_write leaves the entries after a backend failure in INIT for good:
        the failure is raised at once, naming them, not after the timeout."""
        sides = Sides(LAYOUTS[Staging.BOTH], 0, 0)
        sender, _ = self.transports(sides)

        class Init(FakeStatus):
            def Succeeded(self):  # noqa: N802
                return False

            def Failed(self):  # noqa: N802
                return False

        real = sender.engine.batch_write

        def batch_write(*args):
            statuses = real(*args)
            return statuses[:2] + [FakeStatus(False, "backend failed")] + [
                Init(True) for _ in statuses[3:]]

        sender.engine.batch_write = batch_write
        started = time.monotonic()
        with self.assertRaisesRegex(TransferError, "entry 2 \\(buffer 2\\) to decode-engine "
                                                   "failed: code ERR_RDMA_OP, backend failed; "
                                                   "entries \\[3\\] never started \\(INIT\\)"):
            sender.send("decode-engine", sides.plan(), timeout=LONG_WAIT)
        self.assertLess(time.monotonic() - started, LONG_WAIT / 2)

    def test_long_entries_are_split_within_one_call(self):
        """An entry of more segments than MORI-IO's TCP backend takes in one control message
        becomes several entries of one batch_write, and the request lands whole."""
        sides = Sides(LAYOUTS[Staging.SRC], 0, 0)
        sender, _ = self.transports(sides)
        sender.max_segments_per_entry = 3
        plan = sides.plan(Staging.NONE)
        result = sender.send("decode-engine", plan)
        batch = [args for name, args in sender.engine.calls if name == "batch_write"]
        self.assertEqual(len(batch), 1)
        per_buffer = -(-len(plan.lengths) // 3)
        self.assertGreater(per_buffer, 1)
        self.assertEqual([len(n) for n in batch[0][4]],
                         ([3] * (per_buffer - 1) + [len(plan.lengths) - 3 * (per_buffer - 1)])
                         * BUFFERS)
        self.assertEqual(len(result.transfer_ids), per_buffer * BUFFERS)
        sides.receive(result.staging)
        sides.assert_delivered(self, "mori-io entries split")
        with self.assertRaisesRegex(ValueError, "max_segments_per_entry must be at least 1, "
                                                "not 0"):
            MoriIoTransport(FakeMoriIo("x"), max_segments_per_entry=0)

    def test_a_peer_of_another_mori_version_is_refused(self):
        """Packed descriptors are opaque but for their field count: a peer whose EngineDesc
        packs 7 fields (MORI's nightly) where this one packs 6 (its main) is refused, naming
        both, before anything is registered."""
        from mori_tp.engines.mori_io import ADDRESS_FORMAT, MoriVersionError, packed_fields

        self.assertEqual([packed_fields(b) for b in (b"\x96\xa1k", b"\x97", b"\xdc\x00\x11",
                                                     b"\xa3abc", b"")], [6, 7, 17, None, None])

        class Desc:
            def __init__(self, packed):
                self.packed = packed

            def pack(self):
                return self.packed

        engine = FakeMoriIo("prefill-engine")
        engine.get_engine_desc = lambda: Desc(b"\x96" + b"\xa1x" * 6)
        sender = MoriIoTransport(engine, location="CPU")
        nightly = {"format": ADDRESS_FORMAT, "engine": b"\x97" + b"\xa1x" * 7, "memory": [],
                   "side_channel": ("127.0.0.1", 1)}
        with self.assertRaisesRegex(MoriVersionError, "the peer's engine descriptor has 7 "
                                                      "fields, this process's 6"):
            sender.add_peer(nightly)
        with self.assertRaisesRegex(MoriVersionError, "not a mori-tp MORI-IO address"):
            sender.add_peer(b"\x96")
        self.assertEqual(sender._remote, {})

    def test_inbound_completion_holds_a_message_until_every_transfer_has_landed(self):
        """completion="inbound": a notification names its write's transfer ids and comes out
        only once MORI-IO's inbound status of each has succeeded; one that failed drops it and
        says why; side-channel completion delivers at once."""
        from engine_fakes import FakeStatus

        class Desc:
            def __init__(self, key):
                self.key = key

            def pack(self):
                return b"\x96"

        statuses = {}

        def engine(key):
            fake = FakeMoriIo(key)
            fake.get_engine_desc = lambda: Desc(key)
            fake.pop_inbound_transfer_status = lambda sender, uid: statuses.pop((sender, uid),
                                                                                None)
            return fake

        for completion in ("inbound", "side-channel"):
            sender = MoriIoTransport(engine("prefill-engine"), completion=completion)
            receiver = MoriIoTransport(engine("decode-engine"), completion=completion)
            try:
                sender._peer_channels["decode-engine"] = receiver.address()["side_channel"]
                sender._notify("decode-engine", b"done", (5, 6), LONG_WAIT, None)
                if completion == "side-channel":
                    receiver.wait_notification("prefill-engine", b"done", timeout=LONG_WAIT)
                    continue
                statuses[("prefill-engine", 5)] = FakeStatus(True)
                with self.assertRaisesRegex(TransferTimeoutError, "no notification"):
                    receiver.wait_notification("prefill-engine", b"done", timeout=0.2)
                statuses[("prefill-engine", 6)] = FakeStatus(True)
                receiver.wait_notification("prefill-engine", b"done", timeout=LONG_WAIT)
                sender._notify("decode-engine", b"lost", (7,), LONG_WAIT, None)
                statuses[("prefill-engine", 7)] = FakeStatus(False, "TCP: connection lost")
                with self.assertRaisesRegex(TransferTimeoutError, "transfer 7 from "
                                            "prefill-engine: code ERR_RDMA_OP, TCP: connection "
                                            "lost; its message b'lost' dropped"):
                    receiver.wait_notification("prefill-engine", b"lost", timeout=0.5)
            finally:
                sender.close()
                receiver.close()

    def test_the_side_channel_carries_messages_with_their_sender(self):
        from mori_tp.engines.mori_io import SideChannel

        a, b = SideChannel(), SideChannel()
        try:
            a.send(b.address, "prefill-engine", b"done-1", uids=(7, 2**63))
            a.send(b.address, "prefill-engine", b"")
            deadline = time.monotonic() + LONG_WAIT
            got: List[Any] = []
            while len(got) < 2 and time.monotonic() < deadline:
                got += b.take()
                time.sleep(0.001)
            self.assertEqual(got, [("prefill-engine", (7, 2**63), b"done-1"),
                                   ("prefill-engine", (), b"")])
            with self.assertRaisesRegex(TransferError, "the side channel to 127.0.0.1:1 failed"):
                a.send(("127.0.0.1", 1), "x", b"lost", timeout=1.0)
        finally:
            a.close()
            b.close()


class OptionalEnginesTest(unittest.TestCase):
    """The package and its adapters import without any engine; starting one says what to
    install."""

    def test_adapters_import_without_their_engines(self):
        blocked = {name: None for name in ("mooncake", "mooncake.engine", "nixl", "nixl._api",
                                           "nixl_cu12", "mori", "mori.io")}
        with mock.patch.dict(sys.modules, blocked):
            for name in [m for m in sys.modules if m.startswith("mori_tp.engines")]:
                sys.modules.pop(name)
            if np is None:
                with self.assertRaisesRegex(ImportError, "mori_tp.engines needs numpy"):
                    importlib.import_module("mori_tp.engines")
                return
            from mori_tp.engines import mooncake, mori_io, nixl

            with self.assertRaisesRegex(ImportError, "mooncake-transfer-engine"):
                mooncake.MooncakeTransport.start()
            with self.assertRaisesRegex(ImportError, "nixl-cu12"):
                nixl.NixlTransport.start("agent")
            self.assertTrue(mori_io.MoriIoTransport(object()))


def run_python(code: str) -> "subprocess.CompletedProcess[str]":
    """``code`` in a fresh interpreter that imports this mori_tp and these tests' helpers."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(mori_tp.__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


@needs_numpy
class ProgramExitTest(unittest.TestCase):
    """How the demo, the engine tests and the engine benchmark end (loopback.run_program), and
    nixl.exit_process, in fresh interpreters. The real NIXL exit crash is in tests/python.rs."""

    def test_exit_process_runs_exit_handlers_flushes_and_ends_with_the_status(self):
        result = run_python(
            "import atexit, sys\n"
            "from mori_tp.engines.nixl import exit_process\n"
            "atexit.register(print, 'atexit ran')\n"
            "sys.stdout.write('buffered ')\n"
            "sys.stderr.write('error text')\n"
            "exit_process(5)\n"
            "print('after exit_process')\n")
        self.assertEqual((result.returncode, result.stdout, result.stderr),
                         (5, "buffered atexit ran\n", "error text"))

    def test_exit_process_refuses_a_status_outside_0_to_255_and_does_not_exit(self):
        from mori_tp.engines.nixl import exit_process

        for status in (-1, 256, 1.0, "1"):
            with self.assertRaisesRegex(ValueError, f"exit status {status!r} is not an integer "
                                                    "in 0..255"):
                exit_process(status)

    def program(self, body: str, nixl: bool) -> "subprocess.CompletedProcess[str]":
        """A program ending through run_program whose main runs ``body``, after making a
        NixlTransport (of a stand-in agent) when ``nixl``; it leaves a line in an open file."""
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "unclosed.txt")
            result = run_python(
                "from mori_tp.engines.loopback import run_program\n"
                "from mori_tp.engines.nixl import NixlTransport\n"
                "from engine_fakes import FakeNixlAgent\n"
                f"unclosed = open({path!r}, 'w')\n"
                "def main():\n"
                "    unclosed.write('left unflushed')\n"
                f"    if {nixl}:\n"
                "        NixlTransport(FakeNixlAgent('agent', {}))\n"
                f"    {body}\n"
                "run_program(main)\n")
            with open(path) as unclosed:
                result.unclosed = unclosed.read()
        return result

    def test_run_program_ends_with_the_status_of_main_with_or_without_a_nixl_agent(self):
        cases = [
            ("return None", 0, ""),
            ("return 4", 4, ""),
            ("raise SystemExit(3)", 3, ""),
            ("raise SystemExit('bad input')", 1, "bad input\n"),
            ("raise RuntimeError('boom')", 1, "RuntimeError: boom\n"),
        ]
        for nixl in (False, True):
            for body, status, stderr_end in cases:
                with self.subTest(body=body, nixl=nixl):
                    result = self.program(body, nixl)
                    self.assertEqual(result.returncode, status, result.stderr)
                    self.assertTrue(result.stderr.endswith(stderr_end), result.stderr)
                    if body.startswith("raise RuntimeError"):
                        self.assertIn("Traceback", result.stderr)
                    # Only the interpreter's own teardown flushes a file left open: with a NIXL
                    # agent made, the process ends without it (exit_process).
                    self.assertEqual(result.unclosed, "" if nixl else "left unflushed")


if __name__ == "__main__":
    unittest.main()
