"""Issue 44 on the stand-in engines (engine_fakes.py): a decode rank that gave up holds the
request's memory until its sender answers (F01), a stranger's messages are refused on their
header without being parsed and without the lock expect() needs (F02), what a Receiver and a
transport's wait_notification keep is bounded with the senders' names counted (F03, F11), a
second Receiver on a transport is refused (F13), and timeouts name what they saw (F10). The
real engines run F01 in engine_late_writes.py."""

from __future__ import annotations

import time
import unittest
from typing import Any, List
from unittest import mock

from layouts import tools_required
from mori_tp import InvalidArgumentError, Staging

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

if np is not None:
    from engine_fakes import FakeMooncake, FakeNixlAgent, TransferNotify
    from mori_tp.engines import (Receiver, Streamer, TransferError, TransferTimeoutError,
                                  plan_request)
    from mori_tp.engines import streaming
    from mori_tp.engines.inbox import SetAside
    from mori_tp.engines.mooncake import MooncakeTransport
    from mori_tp.engines.nixl import NixlTransport
    from mori_tp.engines.protocol import MAX_MESSAGE_BYTES, chunk_message, new_token
    from test_streaming import LAYERS, LONG, SHORT, Held, expect, nixl_pair, sides_for, until

needs_numpy = unittest.skipIf(np is None, "numpy is not installed")


@needs_numpy
class HeldUntilAnsweredTest(unittest.TestCase):
    """F01: a request the decode rank gave up on keeps its memory until its sender answers."""

    def test_a_write_in_progress_at_the_cancel_is_waited_for_before_the_memory_goes(self):
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = nixl_pair(sides)
        held = Held(sender, index=1)
        receiver = Receiver(receiver_transport, linger=0.0).start()
        done: List[float] = []
        incoming = expect(receiver, sides, "stuck", Staging.SRC, timeout=SHORT,
                          on_done=lambda _: done.append(time.monotonic()))
        with Streamer(held, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "stuck", layers=LAYERS)
            stream.submit(0)
            stream.submit(1)  # its write waits inside the engine call, past every check
            self.assertTrue(held.entered.wait(LONG))
            self.assertTrue(incoming.done.wait(LONG))
            self.assertIsInstance(incoming.error, TransferTimeoutError)
            until(lambda: stream.done, "the cancel reached the sender")
            time.sleep(SHORT)
            # linger=0 does not release it: the cancel was delivered, its sender is alive.
            self.assertEqual(done, [])
            self.assertTrue(incoming.quarantined)
            self.assertIn(incoming, receiver.quarantined)
            opened = time.monotonic()
            held.opened.set()
            until(lambda: done, "released on the sender's answer")
            self.assertGreaterEqual(done[0], opened)
            self.assertEqual(incoming.released, "")
            with self.assertRaisesRegex(TransferError, "the decode rank gave up"):
                stream.wait(LONG)
            with self.assertRaisesRegex(TransferError, "failed"):
                stream.submit(2)
        receiver.close()

    def test_release_lets_a_held_request_go_and_says_so(self):
        sides = sides_for(Staging.SRC)
        _, receiver_transport, _ = nixl_pair(sides)
        receiver = Receiver(receiver_transport)
        done: List[Any] = []
        incoming = expect(receiver, sides, "orphan", Staging.SRC, peer="prefill",
                          timeout=SHORT, on_done=done.append)
        with self.assertRaises(TransferTimeoutError):
            receiver.wait(incoming, SHORT)
        receiver.poll()
        self.assertTrue(incoming.quarantined)
        self.assertEqual(done, [])
        self.assertTrue(receiver.release(incoming, "its prefill process exited"))
        self.assertEqual(done, [incoming])
        self.assertIn("its prefill process exited", incoming.released)
        self.assertFalse(receiver.release(incoming))

    def test_a_cancel_for_a_request_no_stream_holds_is_answered_and_refused_at_open(self):
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport).start()
        with Streamer(sender, timeout=LONG) as streamer:
            # The streamer wrote to this peer before: a cancel from it is answered.
            expect(receiver, sides, "first", Staging.SRC)
            streamer.send(peer, sides.plan(Staging.SRC), "first")
            never = expect(receiver, sides, "never", Staging.SRC, peer="prefill",
                           timeout=SHORT, token=new_token())
            self.assertTrue(never.settled.wait(LONG), "the sender did not answer the cancel")
            self.assertEqual(never.released, "")
            self.assertFalse(never.complete)
            with self.assertRaisesRegex(TransferError, "gave up on it before it was opened"):
                streamer.open(peer, plan_request(
                    sides.config, sides.request.src_pages, sides.request.dst_pages,
                    local=sides.local, remote=sides.remote, staging=Staging.SRC,
                    token=never.token), "never")
        receiver.close()

    def test_success_needs_the_decode_ranks_done(self):
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport)  # never polled: no done comes back
        incoming = expect(receiver, sides, "quiet", Staging.SRC)
        with Streamer(sender, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "quiet", layers=LAYERS)
            for layer in range(LAYERS):
                stream.submit(layer)
            stream.seal()
            until(lambda: stream._seal == "sent", "written")
            with self.assertRaisesRegex(TransferTimeoutError, "did not confirm it"):
                stream.wait(SHORT)
            self.assertFalse(stream.confirmed)
        self.assertFalse(incoming.done.is_set())


@needs_numpy
class HeaderFirstTest(unittest.TestCase):
    """F02: the token is compared on the header; the body of a message without it is never
    parsed, and no parse runs under the lock expect() takes."""

    def test_a_strangers_long_messages_are_not_parsed(self):
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport)
        incoming = expect(receiver, sides, "target", Staging.SRC)
        body = ",".join(["0-1"] * 12000)
        junk = f"mori-tp/4 target {'f' * 32} chunk 0 {body} staging SRC reply 0".encode()
        self.assertGreater(len(junk), 40000)
        self.assertLessEqual(len(junk), MAX_MESSAGE_BYTES)
        parses: List[bool] = []
        real = streaming.parse_message

        def counting(raw: bytes) -> Any:
            parses.append(receiver._lock._is_owned())
            return real(raw)

        agent = receiver_transport.agent
        with mock.patch.object(streaming, "parse_message", counting):
            agent.notifs.setdefault("mallory", []).extend([junk] * 200)
            receiver.poll()
            self.assertEqual(parses, [])
            self.assertEqual(receiver.violation_count, 200)
            self.assertFalse(incoming.done.is_set())
            # The token holder's own message is parsed once, outside the lock.
            agent.notifs.setdefault("prefill", []).append(chunk_message(
                "target", incoming.token, 0, [(0, incoming.num_buffers)], sealed=1,
                staging=Staging.SRC))
            receiver.poll()
        self.assertEqual(parses, [False])
        self.assertTrue(incoming.done.is_set())


@needs_numpy
class BoundsWithNamesTest(unittest.TestCase):
    """F03 and F11: the bounds count the senders' names; names in errors are cut."""

    def test_long_names_count_in_every_bound_and_are_cut_in_words(self):
        sides = sides_for(Staging.SRC)
        _, receiver_transport, _ = nixl_pair(sides)
        receiver = Receiver(receiver_transport)
        agent = receiver_transport.agent
        name = "n" * 900_000
        for i in range(40):
            agent.notifs.setdefault(f"{name}{i}", []).extend([
                b"not ours",
                f"mori-tp/4 early-{i} {'f' * 32} sealed 1 reply 0".encode(),
                f"mori-tp/3 x {'f' * 32} sealed 1".encode()])
        receiver.poll()
        self.assertLessEqual(receiver._others_bytes, streaming.MAX_OTHERS_BYTES)
        self.assertGreaterEqual(receiver._others_bytes, 0)
        # Each kept other costs its name: 16 MiB hold at most 18 such entries.
        self.assertLessEqual(len(receiver.others), streaming.MAX_OTHERS_BYTES // 900_000)
        self.assertLessEqual(receiver._early_bytes, streaming.MAX_EARLY_BYTES)
        self.assertLessEqual(receiver._early_count, streaming.MAX_EARLY_BYTES // 900_000)
        self.assertTrue(receiver.violations)
        for violation in receiver.violations:
            self.assertLessEqual(len(violation), streaming.MAX_VIOLATION)
            self.assertNotIn("n" * 300, violation)
        self.assertTrue(any("characters)" in v for v in receiver.violations))
        # A request's error names its sender cut too.
        incoming = expect(receiver, sides, "named", Staging.SRC, timeout=SHORT)
        agent.notifs.setdefault(name, []).append(chunk_message(
            "named", incoming.token, 0, [(0, 1)], staging=Staging.SRC))
        receiver.poll()
        with self.assertRaises(TransferTimeoutError) as caught:
            receiver.wait(incoming, SHORT)
        self.assertLess(len(str(caught.exception)), 1500)
        self.assertIn("characters)", str(caught.exception))
        self.assertNotIn("n" * 300, str(caught.exception))

    def test_wait_notification_keeps_a_bounded_expiring_set_aside(self):
        clock = [0.0]
        aside = SetAside(max_count=10, max_bytes=1000, expiry=5.0, clock=lambda: clock[0])
        for i in range(30):
            aside.add("s" * 10, b"x" * 20)
        self.assertEqual(len(aside), 10)
        self.assertLessEqual(aside.bytes, 1000)
        aside.add("big", b"y" * 2000)
        self.assertEqual(len(aside), 10)
        clock[0] = 6.0
        self.assertEqual(aside.drain(), [])
        self.assertGreaterEqual(aside.dropped, 31)
        for make in ("mooncake", "nixl"):
            if make == "mooncake":
                peers: dict = {}
                engine = FakeMooncake(15009, peers)
                transport = MooncakeTransport(engine)
                flood = lambda: engine.inbox.extend(  # noqa: E731
                    TransferNotify("mallory", "z" * 65536) for _ in range(400))
            else:
                agents: dict = {}
                transport = NixlTransport(FakeNixlAgent("decode", agents))
                flood = lambda: transport.agent.notifs.setdefault(  # noqa: E731
                    "mallory", []).extend([b"z" * 65536] * 400)
            for _ in range(5):
                flood()
                with self.assertRaises(TransferTimeoutError):
                    transport.wait_notification("prefill", b"mine", timeout=0.01)
            self.assertLessEqual(transport._set_aside.bytes, 16 << 20, make)
            self.assertLessEqual(len(transport._set_aside), 1024, make)
            if make == "nixl":
                self.assertEqual(sum(len(v) for v in transport.agent.notifs.values()), 0)


@needs_numpy
class OneReceiverTest(unittest.TestCase):
    """F13: a second Receiver on one transport is refused, with what to do instead."""

    def test_a_second_receiver_is_refused_until_the_first_detaches(self):
        sides = sides_for(Staging.SRC)
        _, receiver_transport, _ = nixl_pair(sides)
        first = Receiver(receiver_transport)
        with self.assertRaisesRegex(InvalidArgumentError, "already has a Receiver"):
            Receiver(receiver_transport)
        first.detach()
        Receiver(receiver_transport)


@needs_numpy
class TimeoutWordsTest(unittest.TestCase):
    """F10: a timeout says what it saw: the chunk whose engine write has not returned, and
    when the sender's last notification came."""

    def test_the_sender_names_the_write_in_the_engine_and_the_receiver_the_silence(self):
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = nixl_pair(sides)
        held = Held(sender, index=1)
        receiver = Receiver(receiver_transport).start()
        incoming = expect(receiver, sides, "slowpeer", Staging.SRC, timeout=1.0)
        with Streamer(held, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "slowpeer", layers=LAYERS)
            stream.submit(0)
            stream.submit(1)
            self.assertTrue(held.entered.wait(LONG))
            with self.assertRaisesRegex(TransferTimeoutError,
                                        r"the write of chunk 1 has been in the engine for"):
                stream.wait(SHORT)
            self.assertTrue(incoming.done.wait(LONG))
            self.assertRegex(str(incoming.error),
                             r"the last notification from 'prefill' came \d+\.\d s ago")
            held.opened.set()
        receiver.close()


if __name__ == "__main__":
    unittest.main()
