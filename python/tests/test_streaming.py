"""Pipelined and layer-wise streamed requests in one process, over the stand-in engines
(engine_fakes.py): every staging mode byte for byte in chunks, layers submitted out of order,
requests completing out of order, backpressure from a full staging pool, and every protocol
violation (a layer twice or never, a chunk twice, a wrong seal, an aborted sender) refused or
reported. The real engines run the same between two processes in engine_streaming.py."""

from __future__ import annotations

import ctypes
import inspect
import random
import threading
import time
import unittest
from typing import Any, List, Tuple
from unittest import mock

import mori_tp
from layouts import tools_required
from mori_tp import InvalidArgumentError, Staging

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

if np is not None:
    from engine_fakes import FakeMooncake, FakeNixlAgent
    from mori_tp.engines import (
        KvMemory,
        Receiver,
        Streamer,
        TransferError,
        chunk_ranges,
        layer_buffers,
    )
    from mori_tp.engines.mooncake import MooncakeTransport
    from mori_tp.engines.nixl import NixlTransport
    from test_engines import LAYOUTS, Sides, pair_staged

needs_numpy = unittest.skipIf(np is None, "numpy is not installed")

LAYERS = 6
BUFFERS = 2 * LAYERS  # K of each layer, then V of each layer
#: Short: the tests that need a timeout to fire wait this long, the others never approach it.
SHORT = 0.5
LONG = 30.0


def mooncake_pair(*sides: "Sides") -> Tuple[Any, Any, Any]:
    peers: dict = {}
    prefill, decode = FakeMooncake(15001, peers), FakeMooncake(15002, peers)
    peers["127.0.0.1:15002"] = decode
    sender, receiver = MooncakeTransport(prefill), MooncakeTransport(decode)
    for s in sides:
        sender.register(s.local_registered)
        receiver.register(s.remote_registered)
    return sender, receiver, receiver.session_id


def nixl_pair(*sides: "Sides") -> Tuple[Any, Any, Any]:
    agents: dict = {}
    sender = NixlTransport(FakeNixlAgent("prefill", agents))
    receiver = NixlTransport(FakeNixlAgent("decode", agents))
    sender.agent.polls = 1
    for s in sides:
        sender.register(s.local_registered)
        receiver.register(s.remote_registered)
    return sender, receiver, sender.add_peer(receiver.metadata())


PAIRS = {"mooncake": mooncake_pair, "nixl": nixl_pair}


def sides_for(staging: Staging, seed: int = 0) -> "Sides":
    layout = LAYOUTS[staging]
    return Sides(layout, *pair_staged(staging), buffers=BUFFERS)


def expect(receiver: "Receiver", sides: "Sides", rid: str, staging: Staging,
           **kwargs: Any) -> Any:
    return receiver.expect(rid, sides.config, sides.request.dst_pages, memory=sides.remote,
                           staging=staging, backend="host", **kwargs)


@needs_numpy
class ChunkRuleTest(unittest.TestCase):
    def test_auto_chunks_are_whole_buffers_of_4_mib_or_more_at_most_half_the_cores(self):
        with mock.patch("os.cpu_count", return_value=2):
            self.assertEqual(chunk_ranges(16, 1 << 20), [(0, 8), (8, 16)])
            self.assertEqual(chunk_ranges(16, 100_000), [(0, 16)])
            self.assertEqual(chunk_ranges(3, 1 << 24), [(0, 1), (1, 3)])
        with mock.patch("os.cpu_count", return_value=64):
            self.assertEqual(chunk_ranges(16, 1 << 20), [(4 * i, 4 * i + 4) for i in range(4)])
            self.assertEqual(chunk_ranges(16, 4 << 20), [(2 * i, 2 * i + 2) for i in range(8)])
            self.assertEqual(chunk_ranges(3, 1 << 24), [(0, 1), (1, 2), (2, 3)])
            self.assertEqual(chunk_ranges(16, 3 << 18), [(0, 5), (5, 10), (10, 16)])
        self.assertEqual(chunk_ranges(10, 0, chunks=4), [(0, 2), (2, 5), (5, 7), (7, 10)])
        with self.assertRaises(InvalidArgumentError):
            chunk_ranges(4, 10, chunks=5)

    def test_layers_map_to_their_k_and_v_buffers(self):
        self.assertEqual(layer_buffers(12, 6)(2), [(2, 3), (8, 9)])
        self.assertEqual(layer_buffers(6, 6)(5), [(5, 6)])
        with self.assertRaisesRegex(InvalidArgumentError, "neither one nor two per layer"):
            layer_buffers(10, 6)


@needs_numpy
class PipelinedTest(unittest.TestCase):
    def test_every_staging_and_chunking_lands_byte_for_byte_on_both_engines(self):
        for engine, make in PAIRS.items():
            for chosen in LAYOUTS:
                for staging in Staging:
                    for chunks in (1, 3, None, BUFFERS):
                        sides = sides_for(chosen)
                        sender, receiver_transport, peer = make(sides)
                        receiver = Receiver(receiver_transport)
                        rid = f"r-{staging.name}-{chunks}"
                        incoming = expect(receiver, sides, rid, staging)
                        with Streamer(sender, timeout=LONG) as streamer:
                            result = streamer.send(peer, sides.plan(staging), rid, chunks=chunks)
                        receiver.wait(incoming, LONG)
                        what = f"{engine} {chosen.name} pair, {staging.name}, {chunks} chunks"
                        sides.assert_delivered(self, what)
                        plan = sides.plan(staging)
                        self.assertEqual((result.segments, result.bytes),
                                         (plan.segments, plan.bytes), what)
                        self.assertEqual(result.chunks, chunks or len(
                            chunk_ranges(BUFFERS, plan.bytes_per_buffer)), what)
                        self.assertEqual(incoming.buffers_ready, set(range(BUFFERS)))

    def test_a_request_aborted_by_its_sender_fails_on_the_receiver(self):
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport)
        incoming = expect(receiver, sides, "doomed", Staging.SRC)
        with Streamer(sender, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "doomed", layers=LAYERS)
            stream.submit(0)

            def broken() -> None:
                raise RuntimeError("layer 1's compute failed")

            stream.submit(1, ready=broken)
            with self.assertRaisesRegex(RuntimeError, "layer 1's compute failed"):
                stream.wait(LONG)
            with self.assertRaisesRegex(TransferError, "failed"):
                stream.submit(2)
        with self.assertRaisesRegex(TransferError, "the sender aborted: layer 1's compute"):
            receiver.wait(incoming, LONG)


@needs_numpy
class StreamingTest(unittest.TestCase):
    def test_layers_in_any_order_and_groups_land_and_are_reported_per_layer(self):
        for engine, make in PAIRS.items():
            for staging in (Staging.SRC, Staging.DST, Staging.BOTH):
                sides = sides_for(staging)
                sender, receiver_transport, peer = make(sides)
                receiver = Receiver(receiver_transport).start()
                seen: List[Tuple[Tuple[int, int], ...]] = []
                incoming = expect(receiver, sides, "layers", staging,
                                  on_chunk=lambda _, ranges: seen.append(ranges))
                order = list(range(LAYERS))
                random.Random(staging).shuffle(order)
                with Streamer(sender, timeout=LONG) as streamer:
                    stream = streamer.open(peer, sides.plan(staging), "layers", layers=LAYERS)
                    stream.submit(order[:2])  # a group of two layers: one chunk
                    for layer in order[2:]:
                        stream.submit(layer, ready=threading.Event().set)
                    self.assertEqual(stream.seal(), LAYERS - 1)
                    result = stream.wait(LONG)
                receiver.wait(incoming, LONG)
                receiver.close()
                sides.assert_delivered(self, f"{engine} {staging.name} by layer")
                self.assertEqual(result.chunks, LAYERS - 1)
                self.assertEqual(incoming.sealed, LAYERS - 1)
                first = sorted(order[:2])
                self.assertEqual(seen[0], tuple(sorted(
                    [(first[0], first[0] + 1), (first[1], first[1] + 1),
                     (LAYERS + first[0], LAYERS + first[0] + 1),
                     (LAYERS + first[1], LAYERS + first[1] + 1)])) if first[1] != first[0] + 1
                    else ((first[0], first[0] + 2), (LAYERS + first[0], LAYERS + first[0] + 2)))
                self.assertEqual(len(seen), LAYERS - 1)
                self.assertEqual(incoming.layers_ready(LAYERS), list(range(LAYERS)))

    def test_ready_takes_an_object_with_synchronize_and_a_raw_hip_event_handle(self):
        """An object's synchronize() and an int hipEvent_t both hold the layer back until they
        return; the int goes to hipEventSynchronize of the HIP runtime loaded with ctypes (here
        a C-callable stand-in injected as the runtime: this machine has no HIP)."""
        from mori_tp.engines import streaming

        class TorchLikeEvent:
            def __init__(self) -> None:
                self.calls = 0

            def synchronize(self) -> None:
                self.calls += 1

        entered, release = threading.Event(), threading.Event()
        handles: List[int] = []
        status = [0]

        @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
        def hip_event_synchronize(event: int) -> int:
            handles.append(event)
            entered.set()
            release.wait(LONG)
            return status[0]

        class Runtime:  # what ctypes.CDLL("libamdhip64.so") offers: the function by name
            hipEventSynchronize = hip_event_synchronize

        def run(handle: int, rid: str):
            sides = sides_for(Staging.SRC)
            sender, receiver_transport, peer = mooncake_pair(sides)
            receiver = Receiver(receiver_transport).start()
            incoming = expect(receiver, sides, rid, Staging.SRC)
            torch_like = TorchLikeEvent()
            with Streamer(sender, timeout=LONG) as streamer:
                stream = streamer.open(peer, sides.plan(Staging.SRC), rid, layers=LAYERS)
                stream.submit(0, ready=torch_like)
                stream.submit(1, ready=handle)
                self.assertTrue(entered.wait(LONG), "hipEventSynchronize never called")
                # Layer 1 is held in hipEventSynchronize: it has not been written.
                self.assertNotIn(1, incoming.buffers_ready)
                release.set()
                for layer in range(2, LAYERS):
                    stream.submit(layer)
                stream.seal()
                try:
                    stream.wait(LONG)
                finally:
                    entered.clear()
                    release.clear()
            self.assertEqual(torch_like.calls, 1)
            return sides, receiver, incoming

        saved = streaming._hip_sync
        streaming._hip_sync = None
        try:
            with mock.patch.object(streaming, "_load_hip_runtime", return_value=Runtime()):
                sides, receiver, incoming = run(0x7F00DEAD0, "hip-event")
                receiver.wait(incoming, LONG)
                receiver.close()
                sides.assert_delivered(self, "a layer behind a hipEvent_t")
                self.assertEqual(handles, [0x7F00DEAD0])
                status[0] = 400  # hipErrorInvalidHandle: the stream fails and says so
                with self.assertRaisesRegex(mori_tp.GpuError,
                                            "hipEventSynchronize\\(0x7f00beef\\) failed: "
                                            "hipError_t 400"):
                    run(0x7F00BEEF, "hip-event-fails")
                self.assertEqual(handles[-1], 0x7F00BEEF)
            # No HIP runtime: a clear error naming what was tried, raised by the stream.
            streaming._hip_sync = None
            with mock.patch.object(streaming, "HIP_RUNTIME_NAMES", ("libno-such-hip.so",)), \
                    mock.patch.dict("os.environ", {"ROCM_PATH": "/nonexistent-rocm"}), \
                    mock.patch.object(streaming.os.path, "join",
                                      lambda *parts: "/nonexistent/" + parts[-1]):
                with self.assertRaises(mori_tp.BackendUnavailableError) as caught:
                    streaming.hip_event_synchronize(0x10)
            self.assertIn("needs HIP's runtime (libamdhip64)", str(caught.exception))
            self.assertIn("libno-such-hip.so", str(caught.exception))
            with self.assertRaisesRegex(InvalidArgumentError, "null event"):
                streaming.hip_event_synchronize(0)
            with self.assertRaisesRegex(TypeError, "hipEvent_t \\(int\\)"):
                streaming._wait_ready(1.5)
        finally:
            streaming._hip_sync = saved

    def test_released_and_close_are_bounded_by_default_and_raise_on_timeout(self):
        """A layer whose ready never returns holds the stream's memory and the streamer's
        packing thread: released() and close() end after their timeouts (default the
        streamer's) with a TransferTimeoutError naming what is held, and succeed once it
        returns."""
        from mori_tp.engines import TransferTimeoutError
        from mori_tp.engines.streaming import RequestStream

        # None means the stream's or the streamer's own timeout, never unbounded.
        for name in ("released", "close"):
            default = getattr(RequestStream if name == "released" else Streamer, name)
            self.assertIsNone(inspect.signature(default).parameters["timeout"].default, name)
        gate = threading.Event()
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = mooncake_pair(sides)
        receiver = Receiver(receiver_transport).start()
        incoming = expect(receiver, sides, "held", Staging.SRC)
        released: List[int] = []
        streamer = Streamer(sender, timeout=0.2)  # the default of both waits below
        stream = streamer.open(peer, sides.plan(Staging.SRC), "held", layers=LAYERS,
                               release=lambda: released.append(1), timeout=0.2)
        stream.submit(0, ready=lambda: gate.wait(LONG))
        for layer in range(1, LAYERS):
            stream.submit(layer)
        stream.seal()
        started = time.monotonic()
        with self.assertRaisesRegex(TransferTimeoutError,
                                    "request held .*: local memory not released after 0.2 s: "
                                    "still in use: 6 chunks submitted, sealed with 6"):
            stream.released()
        with self.assertRaisesRegex(TransferTimeoutError,
                                    "Streamer.close: mori-tp-pack, mori-tp-write still running "
                                    "after 0.05 s"):
            streamer.close(timeout=0.05)
        with self.assertRaisesRegex(TransferTimeoutError, "still running after 0.2 s"):
            streamer.close()
        self.assertLess(time.monotonic() - started, LONG, "the waits were bounded")
        self.assertEqual(released, [])
        gate.set()  # the layer is ready: the stream (which those waits did not fail) ends ...
        self.assertEqual(stream.wait(LONG).chunks, LAYERS)
        self.assertTrue(stream.released(LONG))  # ... and lets its memory go
        self.assertEqual(released, [1])
        streamer.close(timeout=LONG)  # and the threads end
        self.assertFalse(any(t.is_alive() for t in streamer._threads))
        receiver.wait(incoming, LONG)  # the request landed whole
        receiver.close()
        sides.assert_delivered(self, "a layer released late")

    def test_a_layer_submitted_twice_or_never_is_refused_and_changes_nothing(self):
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = mooncake_pair(sides)
        receiver = Receiver(receiver_transport)
        incoming = expect(receiver, sides, "strict", Staging.SRC)
        with Streamer(sender, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "strict", layers=LAYERS)
            for layer in range(LAYERS - 1):
                stream.submit(layer)
            with self.assertRaisesRegex(InvalidArgumentError,
                                        r"layers \[2\] \(buffers \[2, 8\]\) already submitted"):
                stream.submit([5, 2])
            with self.assertRaisesRegex(InvalidArgumentError,
                                        r"layers \[5\] \(buffers \[5, 11\]\) never submitted"):
                stream.seal()
            # Nothing changed: layer 5 alone is still welcome, then the seal holds.
            stream.submit(5)
            self.assertEqual(stream.seal(), LAYERS)
            with self.assertRaisesRegex(InvalidArgumentError, "is already sealed"):
                stream.seal()
            with self.assertRaisesRegex(InvalidArgumentError, "is sealed with 6 chunks"):
                stream.submit(buffers=[(0, 1)])
            stream.wait(LONG)
        receiver.wait(incoming, LONG)
        sides.assert_delivered(self, "after the refusals")

    def test_a_seal_after_the_last_chunk_was_written_goes_separately(self):
        for engine, make in PAIRS.items():
            sides = sides_for(Staging.BOTH)
            sender, receiver_transport, peer = make(sides)
            receiver = Receiver(receiver_transport)
            incoming = expect(receiver, sides, "late-seal", Staging.BOTH)
            with Streamer(sender, timeout=LONG) as streamer:
                stream = streamer.open(peer, sides.plan(Staging.BOTH), "late-seal",
                                       layers=LAYERS)
                stream.submit(list(range(LAYERS)))
                # Wait until the chunk is written, so the seal cannot ride on it.
                while stream.segments == 0:
                    threading.Event().wait(0.001)
                stream.seal()
                stream.wait(LONG)
            receiver.wait(incoming, LONG)
            sides.assert_delivered(self, f"{engine} sealed separately")


@needs_numpy
class ReceiverTest(unittest.TestCase):
    def test_requests_complete_out_of_order_each_byte_exact(self):
        a, b = sides_for(Staging.SRC), sides_for(Staging.DST)
        sender, receiver_transport, peer = nixl_pair(a, b)
        receiver = Receiver(receiver_transport)
        first = expect(receiver, a, "A", Staging.SRC)
        second = expect(receiver, b, "B", Staging.DST)
        with Streamer(sender, timeout=LONG) as streamer:
            slow = streamer.open(peer, a.plan(Staging.SRC), "A", layers=LAYERS)
            slow.submit(0)
            fast = streamer.open(peer, b.plan(Staging.DST), "B", layers=LAYERS)
            fast.submit(list(range(LAYERS)))
            fast.seal()
            fast.wait(LONG)
            receiver.wait(second, LONG)
            self.assertFalse(first.done.is_set(), "A finished before its last layers")
            for layer in range(1, LAYERS):
                slow.submit(layer)
            slow.seal()
            slow.wait(LONG)
        receiver.wait(first, LONG)
        self.assertLess(second.finished_at, first.finished_at)
        a.assert_delivered(self, "A")
        b.assert_delivered(self, "B")

    def test_a_chunk_twice_a_wrong_seal_and_a_missing_chunk_are_reported(self):
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = mooncake_pair(sides)
        plan = sides.plan(Staging.NONE)
        src, dst, lengths = plan.addresses([(0, 1)])
        carrier = (int(src[0]), int(dst[0]))
        from mori_tp.engines.streaming import chunk_message, seal_message

        def run(rid: str, messages: List[bytes], timeout: float = LONG) -> str:
            receiver = Receiver(receiver_transport)
            incoming = expect(receiver, sides, rid, Staging.NONE, timeout=timeout)
            for message in messages:
                sender.notify(peer, message, carrier=carrier)
            with self.assertRaises(TransferError) as caught:
                receiver.wait(incoming, LONG)
            return str(caught.exception)

        self.assertIn("chunk 0 arrived twice",
                      run("dup", [chunk_message("dup", 0, [(0, 1)])] * 2))
        self.assertIn("carries buffers [0] that already arrived",
                      run("dup-buffer", [chunk_message("dup-buffer", 0, [(0, 1)]),
                                         chunk_message("dup-buffer", 1, [(0, 2)])]))
        self.assertIn("sealed with 1 chunks, but chunks [1] arrived",
                      run("over", [chunk_message("over", 0, [(0, 1)]),
                                   chunk_message("over", 1, [(1, 2)], sealed=1)]))
        message = run("gap", [chunk_message("gap", 0, [(0, 6)]), seal_message("gap", 2)],
                      timeout=SHORT)
        self.assertIn(f"no progress for {SHORT} s: sealed with 2 chunks; chunks [1] and "
                      "buffers [6, 7, 8, 9, 10, 11] missing", message)
        self.assertIn("buffers [6, 7, 8, 9, 10, 11] missing",
                      run("short", [chunk_message("short", 0, [(0, 6)], sealed=1)]))
        self.assertIn("outside the 12 buffers",
                      run("wide", [chunk_message("wide", 0, [(0, 13)])]))

    def test_notifications_before_expect_are_kept_and_others_set_aside(self):
        sides = sides_for(Staging.DST)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport)
        sender.notify(peer, b"someone else's message")
        with Streamer(sender, timeout=LONG) as streamer:
            streamer.send(peer, sides.plan(Staging.DST), "early")
        self.assertEqual(receiver.poll(), [])
        incoming = expect(receiver, sides, "early", Staging.DST)
        receiver.wait(incoming, LONG)
        sides.assert_delivered(self, "expected after it landed")
        self.assertEqual(receiver.others, [("prefill", b"someone else's message")])


@needs_numpy
class PoolBackpressureTest(unittest.TestCase):
    def test_more_requests_than_slots_wait_for_space_and_all_land(self):
        # The decode pool holds two requests; six are sent by three threads at once.
        requests = [sides_for(Staging.DST) for _ in range(6)]
        sender, receiver_transport, peer = mooncake_pair(*requests)
        need = requests[0].staging_bytes
        pool = mori_tp.StagingPool(2 * -(-need // 4096) * 4096, min_slot=4096)
        receiver_transport.register(KvMemory((), 0, pool.address, pool.capacity))
        receiver = Receiver(receiver_transport).start()
        peak = []
        failures = []
        # The test holds the pool full first: every thread's first request must wait for the
        # test's frees before it gets a slot.
        held = [pool.alloc(need), pool.alloc(need)]
        self.assertIsNone(pool.try_alloc(need))
        freeing = threading.Event()
        granted_while_full = []
        with Streamer(sender, timeout=LONG) as streamer:

            def one(index: int) -> None:
                sides = requests[index]
                try:
                    slot = pool.alloc(need, timeout=LONG)
                    if not freeing.is_set():
                        granted_while_full.append(index)
                    peak.append(pool.info().live_slots)
                    # The decode rank tells the prefill rank its slot; both use it.
                    sides.remote = KvMemory(sides.remote.buffers, sides.remote.capacity,
                                            slot.address, slot.size)
                    incoming = expect(receiver, sides, f"q{index}", Staging.DST)
                    streamer.send(peer, sides.plan(Staging.DST), f"q{index}", chunks=3)
                    receiver.wait(incoming, LONG)
                    pool.free(slot)
                except BaseException as error:  # noqa: B036 - reported below
                    failures.append(error)

            threads = [threading.Thread(target=lambda i=i: [one(j) for j in (i, i + 3)])
                       for i in range(3)]
            for thread in threads:
                thread.start()
            # All three report waiting on the full pool (bounded: a bug cannot hang the test).
            deadline = time.monotonic() + LONG
            while pool.info().waiters < 3:
                self.assertLess(time.monotonic(), deadline, f"waiting: {pool.info()}")
                time.sleep(0.001)
            self.assertEqual(peak, [], "no request got a slot while the pool was full")
            freeing.set()
            for slot in held:
                pool.free(slot)
            for thread in threads:
                thread.join(LONG * 4)
        receiver.close()
        self.assertEqual(failures, [])
        self.assertEqual(granted_while_full, [])
        self.assertEqual(len(peak), 6)
        self.assertLessEqual(max(peak), 2)
        self.assertEqual(pool.info().waiters, 0)
        for index, sides in enumerate(requests):
            sides.assert_delivered(self, f"request {index}")
        pool.close()


if __name__ == "__main__":
    unittest.main()
