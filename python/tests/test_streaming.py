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
        new_token,
    )
    from mori_tp.engines import TransferTimeoutError
    from mori_tp.engines.mooncake import MooncakeTransport
    from mori_tp.engines.nixl import NixlTransport
    from mori_tp.engines.streaming import parse_message
    from test_engines import LAYOUTS, Sides, pair_staged


def fresh(sides: Any) -> str:
    """A new token for the next request of ``sides`` (its plans carry it from now on): a
    receiver refuses a token an earlier request used (issue 44 F04)."""
    from mori_tp.engines import new_token as _new

    sides.token = _new()
    return sides.token


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
    peers["127.0.0.1:15001"] = prefill  # the decode rank answers (done, cancel)
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


def post(streamer: "Streamer", peer: Any, plan: Any, rid: str, **kwargs: Any) -> Any:
    """Writes a whole request (one chunk) and seals it without waiting for the decode rank's
    answer: for a test whose receiver takes the messages later (``stream.wait()`` then)."""
    stream = streamer.open(peer, plan, rid, **kwargs)
    stream.submit(buffers=[(0, plan.num_buffers)])
    stream.seal()
    until(lambda: stream._seal == "sent" or stream._error is not None, f"{rid} written")
    return stream


def expect(receiver: "Receiver", sides: "Sides", rid: str, staging: Staging,
           **kwargs: Any) -> Any:
    """The decode rank expects the request, with the token its plans carry (a connector sends
    the token the Receiver drew; here both sides take the Sides' own)."""
    if "token" not in kwargs:
        # A receiver refuses a token an earlier request used (issue 44 F04): each request
        # gets one of its own, which the sides' plans carry from now on.
        sides.token = new_token()
        kwargs["token"] = sides.token
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
                        receiver = Receiver(receiver_transport).start()
                        rid = f"r-{staging.name}-{chunks}"
                        incoming = expect(receiver, sides, rid, staging)
                        with Streamer(sender, timeout=LONG) as streamer:
                            result = streamer.send(peer, sides.plan(staging), rid, chunks=chunks,
                                                    token=incoming.token)
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
        receiver = Receiver(receiver_transport).start()
        incoming = expect(receiver, sides, "doomed", Staging.SRC)
        with Streamer(sender, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "doomed", layers=LAYERS,
                                   token=incoming.token)
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
                    stream = streamer.open(peer, sides.plan(staging), "layers", layers=LAYERS,
                                           token=incoming.token)
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
                stream = streamer.open(peer, sides.plan(Staging.SRC), rid, layers=LAYERS,
                                       token=incoming.token)
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
        """A layer whose ready never returns holds the stream's memory and its ready thread:
        released() and close() end after their timeouts (default the streamer's) with a
        TransferTimeoutError naming what is held, and succeed once it returns."""
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
                               release=lambda: released.append(1), timeout=0.2,
                               token=incoming.token)
        stream.submit(0, ready=lambda: gate.wait(LONG))
        for layer in range(1, LAYERS):
            stream.submit(layer)
        stream.seal()
        started = time.monotonic()
        with self.assertRaisesRegex(TransferTimeoutError,
                                    "request held .*: local memory not released after 0.2 s: "
                                    r"still in use: 6 chunks submitted, \d written, sealed "
                                    "with 6"):
            stream.released()
        with self.assertRaisesRegex(TransferTimeoutError,
                                    r"Streamer.close: mori-tp-ready \(held\) still running "
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
        receiver = Receiver(receiver_transport).start()
        incoming = expect(receiver, sides, "strict", Staging.SRC)
        with Streamer(sender, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "strict", layers=LAYERS,
                                   token=incoming.token)
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
            receiver = Receiver(receiver_transport).start()
            incoming = expect(receiver, sides, "late-seal", Staging.BOTH)
            with Streamer(sender, timeout=LONG) as streamer:
                stream = streamer.open(peer, sides.plan(Staging.BOTH), "late-seal",
                                       layers=LAYERS, token=incoming.token)
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
        receiver = Receiver(receiver_transport).start()
        first = expect(receiver, a, "A", Staging.SRC)
        second = expect(receiver, b, "B", Staging.DST)
        with Streamer(sender, timeout=LONG) as streamer:
            slow = streamer.open(peer, a.plan(Staging.SRC), "A", layers=LAYERS, token=first.token)
            slow.submit(0)
            fast = streamer.open(peer, b.plan(Staging.DST), "B", layers=LAYERS, token=second.token)
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
        carrier = int(plan.addresses([(0, 1)])[1][0])
        from mori_tp.engines.streaming import chunk_message, seal_message

        def run(rid: str, messages: List[Any], timeout: float = LONG) -> str:
            receiver = Receiver(receiver_transport).start()
            incoming = expect(receiver, sides, rid, Staging.NONE, timeout=timeout)
            for message in messages:
                sender.notify(peer, message(incoming.token), carrier=carrier)
            with self.assertRaises(TransferError) as caught:
                receiver.wait(incoming, LONG)
            receiver.detach()  # one Receiver per transport: the next run makes its own
            return str(caught.exception)

        def chunk(rid, index, ranges, sealed=None):
            return lambda token: chunk_message(rid, token, index, ranges, sealed,
                                               staging=Staging.NONE)

        def seal(rid, count):
            return lambda token: seal_message(rid, token, count)

        self.assertIn("chunk 0 arrived twice",
                      run("dup", [chunk("dup", 0, [(0, 1)])] * 2))
        self.assertIn("carries buffers [0] that already arrived",
                      run("dup-buffer", [chunk("dup-buffer", 0, [(0, 1)]),
                                         chunk("dup-buffer", 1, [(0, 2)])]))
        self.assertIn("sealed with 1 chunks, but chunks [1] arrived",
                      run("over", [chunk("over", 0, [(0, 1)]),
                                   chunk("over", 1, [(1, 2)], sealed=1)]))
        message = run("gap", [chunk("gap", 0, [(0, 6)]), seal("gap", 2)], timeout=SHORT)
        self.assertIn(f"no progress for {SHORT} s: sealed with 2 chunks; chunks [1] and "
                      "buffers [6, 7, 8, 9, 10, 11] missing", message)
        self.assertIn("buffers [6, 7, 8, 9, 10, 11] missing",
                      run("short", [chunk("short", 0, [(0, 6)], sealed=1)]))
        self.assertIn("outside the 12 buffers",
                      run("wide", [chunk("wide", 0, [(0, 13)])]))

    def test_notifications_before_expect_are_kept_and_others_set_aside(self):
        sides = sides_for(Staging.DST)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport).start()
        sender.notify(peer, b"someone else's message")
        # The connector's token (sides.token, in the plan) reached the prefill rank first.
        with Streamer(sender, timeout=LONG) as streamer:
            stream = post(streamer, peer, sides.plan(Staging.DST), "early")
            self.assertEqual(receiver.poll(), [])
            incoming = expect(receiver, sides, "early", Staging.DST, token=sides.token)
            receiver.wait(incoming, LONG)
            # Success only once the decode rank confirmed it.
            self.assertTrue(stream.wait(LONG) and stream.confirmed)
        sides.assert_delivered(self, "expected after it landed")
        self.assertEqual(list(receiver.others), [("prefill", b"someone else's message")])
        self.assertEqual(incoming.peer, "prefill")


class Held:
    """A transport wrapper: the write of chunk ``index`` (of request ``rid``, any when None)
    waits for ``opened``, as a slow RDMA write would, or raises ``error``; every write and
    notification is logged as it returns, ``("write", index)`` or ``("notify", kind)``."""

    def __init__(self, inner: Any, index: int = 1, rid: Any = None, error: Any = None) -> None:
        self.inner, self.index, self.rid, self.error = inner, index, rid, error
        self.peer_epochs = inner.peer_epochs
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.log: List[Tuple[str, Any]] = []

    def write(self, peer, src, dst, lengths, *, notification=b"", **kwargs):
        message = parse_message(notification) if notification else None
        index = message.index if message is not None else None
        if index == self.index and (self.rid is None or message.request_id == self.rid):
            self.entered.set()
            if self.error is not None:
                raise self.error
            self.opened.wait(LONG)
        result = self.inner.write(peer, src, dst, lengths, notification=notification, **kwargs)
        self.log.append(("write", index))
        return result

    def notify(self, peer, message, **kwargs):
        result = self.inner.notify(peer, message, **kwargs)
        self.log.append(("notify", parse_message(message).kind))
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Inbox:
    """A transport that delivers what the test queues: ``(sender, message)`` pairs."""

    def __init__(self) -> None:
        self.queue: List[Tuple[Any, bytes]] = []

    def poll_notifications(self) -> List[Tuple[Any, bytes]]:
        taken, self.queue = self.queue, []
        return taken


def until(condition, what: str, timeout: float = LONG) -> None:
    """Waits (bounded) for ``condition``; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.001)


@needs_numpy
class AbortOrderTest(unittest.TestCase):
    """Issue 33.1 and 33.17: a failed stream tells the decode rank only once every write of it
    has returned, and gives its slot back only after that; a decode slot is not reused while a
    write to it may still land."""

    def test_the_abort_reaches_the_decode_rank_only_after_every_write_returned(self):
        for engine, make in PAIRS.items():
            sides = sides_for(Staging.DST)
            sender, receiver_transport, peer = make(sides)
            held = Held(sender, index=0)  # chunk 0's write is slow; chunk 1 queues behind
            receiver = Receiver(receiver_transport).start()
            incoming = expect(receiver, sides, "old", Staging.DST)
            with Streamer(held, timeout=LONG) as streamer:
                stream = streamer.open(peer, sides.plan(Staging.DST), "old", layers=LAYERS)
                stream.submit([0, 1, 2])
                stream.submit([3, 4, 5])
                stream.seal()
                self.assertTrue(held.entered.wait(LONG))
                with self.assertRaises(TransferTimeoutError):
                    stream.wait(SHORT)
                time.sleep(SHORT)  # room for an abort that does not wait
                receiver.poll()
                self.assertNotIn(("notify", "abort"), held.log, engine)
                self.assertFalse(incoming.done.is_set(),
                                 f"{engine}: the decode rank heard of the failure while chunk "
                                 "0's write was still in flight")
                held.opened.set()
                self.assertTrue(stream.released(LONG))
            # Chunk 0's write returned, then the abort went; chunk 1 was never written.
            self.assertEqual(held.log, [("write", 0), ("notify", "abort")], engine)
            with self.assertRaisesRegex(TransferError, "the sender aborted"):
                receiver.wait(incoming, LONG)
            # Every write returned before the abort: the request settles at once.
            self.assertTrue(incoming.settled.is_set(), engine)

    def test_a_request_the_decode_rank_gave_up_on_keeps_its_slot_until_linger(self):
        """p19: the decode rank stops waiting while a chunk's write is still in flight; its
        slot is not handed out again (on_done, which frees it, runs ``linger`` later), so the
        late write lands in memory nobody else uses."""
        sides = sides_for(Staging.DST)
        sender, receiver_transport, peer = nixl_pair(sides)
        need = sides.staging_bytes
        pool = mori_tp.StagingPool(4 * -(-need // 4096) * 4096, min_slot=4096)
        receiver_transport.register(KvMemory((), 0, pool.address, pool.capacity))
        slot = pool.alloc(need)
        sides.remote = KvMemory(sides.remote.buffers, sides.remote.capacity, slot.address,
                                slot.size)
        receiver = Receiver(receiver_transport, linger=LONG)
        freed: List[int] = []
        incoming = expect(receiver, sides, "old", Staging.DST,
                          on_done=lambda _: (pool.free(slot), freed.append(1)))
        held = Held(sender, index=1)
        with Streamer(held, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.DST), "old", layers=LAYERS)
            stream.submit([0, 1, 2])
            stream.submit([3, 4, 5])
            stream.seal()
            self.assertTrue(held.entered.wait(LONG))
            with self.assertRaises(TransferTimeoutError):
                receiver.wait(incoming, SHORT)
            self.assertEqual(freed, [], "the slot was freed while a write to it was in flight")
            following = pool.alloc(need)
            self.assertNotEqual(following.address, slot.address)
            view = pool.view(following)
            view[:] = 0xAB
            held.opened.set()  # the old write lands now
            self.assertTrue(stream.released(LONG))
            self.assertEqual(int(np.count_nonzero(view != 0xAB)), 0)
        del view
        pool.free(following)

    def test_release_runs_after_the_abort_that_reads_the_slot(self):
        """p8: the abort is sent before release, whatever the threads' timing (here widened:
        setting the stream's done event yields for 0.2 s)."""
        sides = sides_for(Staging.SRC)
        sender, _, peer = mooncake_pair(sides)
        log: List[str] = []
        gate = threading.Event()

        class Logged(Held):
            def write(self, *args, **kwargs):
                gate.wait(LONG)
                return super().write(*args, **kwargs)

            def notify(self, peer_, message, **kwargs):
                log.append(parse_message(message).kind)
                return super().notify(peer_, message, **kwargs)

        class SlowSet(threading.Event):
            def set(self):
                super().set()
                time.sleep(0.2)

        with Streamer(Logged(sender, index=-5), timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "r", layers=LAYERS,
                                   release=lambda: log.append("release"))
            stream.submit(0)
            stream.submit(1)
            time.sleep(0.1)
            stream._done = SlowSet()
            threading.Timer(0.1, gate.set).start()
            with self.assertRaises(TransferTimeoutError):
                stream.wait(0.05)
            self.assertTrue(stream.released(LONG))
        self.assertEqual(log, ["abort", "release"])


@needs_numpy
class StreamEndTest(unittest.TestCase):
    """How a stream ends: only once every chunk is written (issue 33.3), an engine_busy error
    keeps its slot whenever it comes (33.2), and every stream ends and releases, also one
    refused, abandoned, aborted or opened on a closed streamer (33.9, 33.11, 33.12)."""

    def test_wait_does_not_succeed_before_a_queued_chunk_is_written(self):
        """p3b: chunk 0 waits for its ready, chunk 1 is packed here and written first."""
        for engine, make in PAIRS.items():
            sides = sides_for(Staging.SRC)
            sender, _, peer = make(sides)
            gate = threading.Event()
            with Streamer(sender, timeout=LONG) as streamer:
                stream = streamer.open(peer, sides.plan(Staging.SRC), "early", layers=LAYERS)
                stream.submit([0, 1, 2], ready=lambda: gate.wait(LONG))
                stream.submit([3, 4, 5], pack_here=True)
                self.assertEqual(stream.seal(), 2)
                with self.assertRaises(TransferTimeoutError, msg=engine) as caught:
                    stream.wait(SHORT)
                self.assertIn("2 chunks submitted, 1 written", str(caught.exception))
                gate.set()
                self.assertTrue(stream.released(LONG))

    def test_a_ready_that_fails_after_a_later_chunk_was_written_fails_the_stream(self):
        """p3: chunk 0's ready raises after chunk 1 went: the error is the stream's, chunk 0 is
        not written, and the decode rank gets an abort instead of a complete request."""
        for engine, make in PAIRS.items():
            sides = sides_for(Staging.SRC)
            sender, receiver_transport, peer = make(sides)
            receiver = Receiver(receiver_transport).start()
            incoming = expect(receiver, sides, "A", Staging.SRC)
            gate = threading.Event()

            def ready0() -> None:
                gate.wait(LONG)
                raise RuntimeError("layers 0-2: compute failed")

            with Streamer(sender, timeout=LONG) as streamer:
                stream = streamer.open(peer, sides.plan(Staging.SRC), "A", layers=LAYERS)
                stream.submit([0, 1, 2], ready=ready0)
                stream.submit([3, 4, 5], pack_here=True)
                stream.seal()
                until(lambda: stream._written == 1, "chunk 1 written")
                gate.set()
                with self.assertRaisesRegex(RuntimeError, "layers 0-2: compute failed"):
                    stream.wait(LONG)
                self.assertTrue(stream.released(LONG))
            self.assertEqual(stream.segments, sides.plan(Staging.SRC).segments // 2, engine)
            with self.assertRaisesRegex(TransferError, "the sender aborted: .*compute failed"):
                receiver.wait(incoming, LONG)
            self.assertEqual(incoming.buffers_ready, {3, 4, 5, 9, 10, 11}, engine)

    def test_an_engine_busy_error_after_the_stream_failed_still_keeps_its_slot(self):
        """p17: wait() times out first; the write in flight then cannot be cancelled."""
        sides = sides_for(Staging.SRC)
        sender, _, peer = nixl_pair(sides)
        sender.agent.polls = None  # the transfer never finishes
        sender.agent.release_xfer_handle = mock.Mock(side_effect=RuntimeError("cannot cancel"))
        released: List[int] = []
        streamer = Streamer(sender, timeout=SHORT)  # each write: SHORT, then cancelled
        stream = streamer.open(peer, sides.plan(Staging.SRC), "late-busy",
                               release=lambda: released.append(1))
        stream.submit(buffers=[(0, BUFFERS)])
        stream.seal()
        with self.assertRaises(TransferTimeoutError) as caught:
            stream.wait(SHORT / 5)
        self.assertFalse(caught.exception.engine_busy)  # the wait's own error
        with self.assertRaisesRegex(TransferTimeoutError, "its staging slot is not released"):
            stream.released(4 * SHORT)
        self.assertIn("could not be cancelled", stream.kept)
        self.assertEqual(released, [])
        streamer.close(timeout=LONG)

    def test_an_empty_chunk_is_refused_and_changes_nothing(self):
        """p4: submit([]) and submit(buffers=[])."""
        for engine, make in PAIRS.items():
            sides = sides_for(Staging.SRC)
            sender, receiver_transport, peer = make(sides)
            receiver = Receiver(receiver_transport).start()
            incoming = expect(receiver, sides, "e", Staging.SRC)
            with Streamer(sender, timeout=LONG) as streamer:
                stream = streamer.open(peer, sides.plan(Staging.SRC), "e", layers=LAYERS)
                for empty in ({"layers": []}, {"buffers": []}):
                    with self.assertRaisesRegex(InvalidArgumentError, "an empty chunk"):
                        stream.submit(**empty)
                self.assertEqual(stream.submit(list(range(LAYERS))), 0)
                stream.seal()
                stream.wait(LONG)
            receiver.wait(incoming, LONG)
            sides.assert_delivered(self, f"{engine} after refused empty chunks")

    def test_a_pair_that_moves_nothing_completes_on_both_engines(self):
        """p18: a pair that is not SEND has no segment; its chunk notifications still go
        (Mooncake: on a one-byte read), and both sides complete."""
        layout = LAYOUTS[Staging.SRC]
        p, d = next((p, d) for p, d in layout.pairs()
                    if layout.config(p, d).action is not mori_tp.Action.SEND)
        for engine, make in PAIRS.items():
            sides = Sides(layout, p, d, buffers=BUFFERS)
            sender, receiver_transport, peer = make(sides)
            receiver = Receiver(receiver_transport).start()
            incoming = expect(receiver, sides, "ns", mori_tp.staging_for(sides.config))
            with Streamer(sender, timeout=LONG) as streamer:
                result = streamer.send(peer, sides.plan(), "ns")
            self.assertEqual((result.segments, result.bytes), (0, 0), engine)
            self.assertTrue(receiver.wait(incoming, LONG).complete, engine)
            self.assertTrue(all(np.array_equal(x, y) for x, y in zip(sides.dst, sides.initial)))

    def test_release_runs_for_refused_closed_and_aborted_streams(self):
        """p10, p14 and 33.11: send() refusing its chunks, calls on a closed streamer, a
        stream the streamer closes before it was sealed, and one the caller aborts: each
        raises at once (or ends), and its release runs exactly once."""
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = mooncake_pair(sides)
        calls: List[str] = []
        streamer = Streamer(sender, timeout=LONG)
        for chunks in (0, BUFFERS + 1):
            with self.assertRaisesRegex(InvalidArgumentError, f"{chunks} chunks of 12"):
                streamer.send(peer, sides.plan(Staging.SRC), f"r{chunks}", chunks=chunks,
                              release=lambda chunks=chunks: calls.append(f"chunks={chunks}"))
        self.assertEqual(calls, ["chunks=0", f"chunks={BUFFERS + 1}"])
        # Aborted by the caller: the decode rank hears of it, the slot goes back.
        receiver = Receiver(receiver_transport).start()
        incoming = expect(receiver, sides, "cancelled", Staging.SRC)
        stream = streamer.open(peer, sides.plan(Staging.SRC), "cancelled", layers=LAYERS,
                               release=lambda: calls.append("aborted"))
        stream.submit(0)
        self.assertTrue(stream.abort("the client went away"))
        self.assertFalse(stream.abort("again"))
        with self.assertRaisesRegex(TransferError, "the client went away"):
            stream.wait(LONG)
        with self.assertRaisesRegex(TransferError, "request cancelled failed"):
            stream.submit(1)
        self.assertTrue(stream.released(LONG))
        with self.assertRaisesRegex(TransferError, "the sender aborted: .*client went away"):
            receiver.wait(incoming, LONG)
        # Opened and never sealed, then the streamer closes: it fails and releases.
        open_one = streamer.open(peer, sides.plan(Staging.SRC), "abandoned", layers=LAYERS,
                                 release=lambda: calls.append("abandoned"))
        open_one.submit(0)
        streamer.close(timeout=LONG)
        with self.assertRaisesRegex(TransferError, "closed before the stream was sealed"):
            open_one.wait(LONG)
        self.assertTrue(open_one.released(LONG))
        with self.assertRaisesRegex(TransferError, "request abandoned failed"):
            open_one.submit(1)
        # A closed streamer refuses at once, and the slot still goes back.
        for how in ("open", "send"):
            with self.assertRaisesRegex(InvalidArgumentError, "the streamer is closed"):
                getattr(streamer, how)(peer, sides.plan(Staging.SRC), f"late-{how}",
                                       release=lambda how=how: calls.append(f"late {how}"))
        self.assertEqual(calls, ["chunks=0", f"chunks={BUFFERS + 1}", "aborted", "abandoned",
                                 "late open", "late send"])

    def test_close_waits_for_an_abort_still_being_sent(self):
        """No streamer thread is inside the engine once close() returns: an abort to a peer
        that does not answer holds close, which names it after its timeout."""
        sides = sides_for(Staging.SRC)
        sender, _, peer = mooncake_pair(sides)
        gate = threading.Event()

        class SlowAbort(Held):
            def notify(self, peer_, message, **kwargs):
                if parse_message(message).kind == "abort":
                    gate.wait(LONG)
                return super().notify(peer_, message, **kwargs)

        streamer = Streamer(SlowAbort(sender, index=-5), timeout=LONG)
        stream = streamer.open(peer, sides.plan(Staging.SRC), "slow-abort", layers=LAYERS)
        stream.submit(0)
        stream.abort("given up")
        with self.assertRaisesRegex(TransferTimeoutError,
                                    r"mori-tp-abort \(slow-abort\) still running"):
            streamer.close(timeout=SHORT)
        gate.set()
        streamer.close(timeout=LONG)
        self.assertTrue(stream.released(LONG))

    def test_an_interrupt_in_a_pack_here_is_raised_and_other_errors_keep_their_type(self):
        """p11: a KeyboardInterrupt raised while packing on the caller's thread reaches the
        caller (the stream fails and releases); a pack error in send() is raised as itself,
        and a later submit names it as its cause."""
        sides = sides_for(Staging.SRC)
        sender, _, peer = mooncake_pair(sides)
        released: List[int] = []
        with Streamer(sender, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "k", layers=LAYERS,
                                   release=lambda: released.append(1))

            def interrupted() -> None:
                raise KeyboardInterrupt

            with self.assertRaises(KeyboardInterrupt):
                stream.submit(0, ready=interrupted, pack_here=True)
            with self.assertRaises(TransferError) as caught:
                stream.submit(1)
            self.assertIsInstance(caught.exception.__cause__, KeyboardInterrupt)
            self.assertTrue(stream.released(LONG))
            self.assertEqual(released, [1])
            plan = sides.plan(Staging.SRC)
            calls = [0]
            real_pack = type(plan).pack

            def pack(self_, *args, **kwargs):
                calls[0] += 1
                if calls[0] == 2:
                    raise ValueError("the pack of chunk 1 failed")
                return real_pack(self_, *args, **kwargs)

            with mock.patch.object(type(plan), "pack", pack):
                with self.assertRaisesRegex(ValueError, "the pack of chunk 1 failed"):
                    streamer.send(peer, plan, "p", chunks=3)


@needs_numpy
class ReceiverLifeTest(unittest.TestCase):
    """The Receiver keeps what it must and no more (issue 33.6), a timed-out wait ends the
    request (33.7), a broken transport still lets requests time out (33.8), close and start
    again (33.15), PairConfig requests (33.16), and where the callbacks run (33.19)."""

    def test_finished_requests_leave_and_everything_kept_is_bounded(self):
        """p2: 300 completed requests leave nothing live; others, violations and early
        messages keep at most their bounds."""
        from mori_tp.engines import streaming
        from mori_tp.engines.streaming import chunk_message

        sides = sides_for(Staging.SRC)
        inbox = Inbox()
        with mock.patch.multiple(streaming, MAX_RECENT=50, MAX_OTHERS=10, MAX_VIOLATIONS=20,
                                 MAX_EARLY=5):
            receiver = Receiver(inbox)
            for n in range(300):
                incoming = expect(receiver, sides, f"r{n}", Staging.SRC)
                inbox.queue.append(("p", chunk_message(f"r{n}", sides.token, 0,
                                                       [(0, BUFFERS)], sealed=1,
                                                       staging=Staging.SRC)))
                self.assertTrue(receiver.wait(incoming, LONG).complete)
            self.assertEqual(len(receiver._incoming), 0)
            self.assertLessEqual(len(receiver._recent), 50)
            inbox.queue.extend(("p", b"another user's %d" % i) for i in range(100))
            receiver.poll()
            self.assertEqual(len(receiver.others), 10)
            self.assertEqual(receiver.others_dropped, 90)
            self.assertEqual(list(receiver.others)[-1], ("p", b"another user's 99"))
            inbox.queue.extend(("p", chunk_message(f"nobody-{i}", sides.token, 0, [(0, 1)],
                                                   staging=Staging.SRC))
                               for i in range(40))
            receiver.poll()
            self.assertEqual(receiver._early_count, 5)
            self.assertEqual(len(receiver.violations), 20)
            self.assertEqual(receiver.violation_count, 35)
            self.assertIn("not expected, dropped", receiver.violations[-1])

    def test_a_wait_that_times_out_ends_the_request(self):
        """p5: Receiver.wait's timeout fails the request, as RequestStream.wait's fails its
        stream: nothing is unpacked later, later messages are recorded as late, and on_done
        runs once it settles (linger)."""
        sides = sides_for(Staging.DST)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport, linger=0.0)
        done: List[Any] = []
        incoming = expect(receiver, sides, "slow", Staging.DST, on_done=done.append)
        with Streamer(sender, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.DST), "slow", layers=LAYERS)
            stream.submit(0)
            until(lambda: stream._written == 1, "layer 0 written")
            with self.assertRaises(TransferTimeoutError):
                receiver.wait(incoming, SHORT)
            self.assertTrue(incoming.done.is_set())
            self.assertIsInstance(incoming.error, TransferTimeoutError)
            # Issue 44 F01: the memory is held until the sender answers the cancel (its
            # abort, once every write of it returned); then on_done runs.
            self.assertTrue(incoming.quarantined)
            self.assertEqual(done, [])
            until(lambda: receiver.poll() is not None and done == [incoming],
                  "the sender's answer released the memory")
            self.assertEqual(incoming.released, "")
            # The sender learnt of the give-up: nothing more of the request is written, and
            # its wait does not report success.
            with self.assertRaisesRegex(TransferError, "the decode rank gave up"):
                stream.submit(1)
            with self.assertRaisesRegex(TransferError, "the decode rank gave up"):
                stream.wait(LONG)
        self.assertFalse(incoming.complete)
        self.assertEqual(incoming.buffers_ready, {0, LAYERS})
        for b in range(BUFFERS):
            if b not in (0, LAYERS):
                self.assertTrue(np.array_equal(sides.dst[b], sides.initial[b]), b)
        self.assertEqual(done, [incoming])

    def test_a_transport_whose_poll_raises_still_times_requests_out(self):
        """p6: the timeouts still fire (on_done runs), the error is recorded once, and a
        direct poll raises it."""

        class Broken:
            def poll_notifications(self):
                raise RuntimeError("engine: agent in error state")

        sides = sides_for(Staging.SRC)
        receiver = Receiver(Broken(), linger=0.0).start()
        done: List[Any] = []
        incoming = expect(receiver, sides, "x", Staging.SRC, timeout=SHORT,
                          on_done=done.append)
        self.assertTrue(incoming.settled.wait(LONG), "the request never timed out")
        self.assertIsInstance(incoming.error, TransferTimeoutError)
        until(lambda: receiver.poll_errors > 3, "more polls")
        receiver.close()
        self.assertEqual(done, [incoming])
        self.assertEqual(list(receiver.violations),
                         ["poll raised RuntimeError('engine: agent in error state')"])
        with self.assertRaisesRegex(TransferError, "poll_notifications raised") as caught:
            receiver.poll()
        self.assertIsInstance(caught.exception.__cause__, RuntimeError)

    def test_after_close_wait_polls_itself_and_start_polls_again(self):
        """p13."""
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport).start()
        receiver.close()
        incoming = expect(receiver, sides, "z", Staging.SRC)
        with Streamer(sender, timeout=LONG) as streamer:
            stream = post(streamer, peer, sides.plan(Staging.SRC), "z")
            self.assertTrue(receiver.wait(incoming, LONG).complete)
            stream.wait(LONG)
        receiver.start()
        self.assertTrue(receiver._thread.is_alive())
        incoming = expect(receiver, sides, "z2", Staging.SRC)
        with Streamer(sender, timeout=LONG) as streamer:
            streamer.send(peer, sides.plan(Staging.SRC), "z2")
        self.assertTrue(incoming.done.wait(LONG) and incoming.complete)
        receiver.close()

    def test_a_pair_config_request_is_expected_with_its_pair_staging(self):
        """p16: expect(PairConfig) without staging= takes pair_staging_for."""
        from test_engines import PAIR_CASES, PairSides

        deployment, p, d, tokens = PAIR_CASES[Staging.DST]
        sides = PairSides(deployment, p, d, tokens, seed=2)
        sender, receiver_transport, peer = mooncake_pair(sides)
        receiver = Receiver(receiver_transport).start()
        incoming = receiver.expect("pr", sides.config, sides.request, memory=sides.remote,
                                   backend="host", token=fresh(sides))
        self.assertIs(incoming.staging, mori_tp.pair_staging_for(sides.config))
        with Streamer(sender, timeout=LONG) as streamer:
            streamer.send(peer, sides.plan(), "pr", chunks=2)
        receiver.wait(incoming, LONG)
        sides.assert_delivered(self, "a pair request expected without staging=")

    def test_early_messages_are_applied_by_the_poller_and_name_their_sender(self):
        """33.19: on_done never runs inside expect() on the caller's thread, and a request
        whose every message came before expect() knows its sender."""
        sides = sides_for(Staging.DST)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport)
        streamer = Streamer(sender, timeout=LONG)
        stream = post(streamer, peer, sides.plan(Staging.DST), "early")
        receiver.poll()
        done: List[str] = []
        expecting = [True]
        incoming = expect(receiver, sides, "early", Staging.DST, token=sides.token,
                          on_done=lambda _: done.append("inside expect" if expecting[0]
                                                        else "later"))
        expecting[0] = False
        self.assertEqual(done, [])
        self.assertFalse(incoming.done.is_set())
        receiver.poll()
        self.assertEqual(done, ["later"])
        self.assertTrue(incoming.complete)
        self.assertEqual(incoming.peer, "prefill")
        sides.assert_delivered(self, "applied after expect")
        self.assertTrue(stream.wait(LONG) and stream.confirmed)
        streamer.close()

    def test_a_ready_that_never_returns_holds_back_only_its_own_request(self):
        """33.19: request A waits for a layer that never becomes ready; B, sent after it
        through the same streamer, lands."""
        a, b = sides_for(Staging.SRC), sides_for(Staging.SRC)
        sender, receiver_transport, peer = mooncake_pair(a, b)
        receiver = Receiver(receiver_transport).start()
        incoming = expect(receiver, b, "B", Staging.SRC)
        gate = threading.Event()
        with Streamer(sender, timeout=LONG) as streamer:
            held = streamer.open(peer, a.plan(Staging.SRC), "A", layers=LAYERS)
            held.submit(0, ready=lambda: gate.wait(LONG))
            result = streamer.send(peer, b.plan(Staging.SRC), "B", timeout=4 * SHORT)
            self.assertEqual(result.bytes, b.plan(Staging.SRC).bytes)
            self.assertFalse(held.done)
            gate.set()
            held.abort("done with the test")
            self.assertTrue(held.released(LONG))
        receiver.wait(incoming, LONG)
        b.assert_delivered(self, "B behind a held A")


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
                    streamer.send(peer, sides.plan(Staging.DST), f"q{index}", chunks=3,
                                  token=incoming.token)
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
