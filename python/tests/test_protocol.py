"""The streaming layer's notification protocol (REFERENCE.md sections 13 and 18) when the
decode rank's peers are not all the request's sender: its format and bounds, requests bound
to their token and sender, and what one message can cost the decode rank, in one process over
the stand-in engines (engine_fakes.py) and a queue of raw notifications.

Forged messages are sent in both protocol versions: version 1 (no token) is what a receiver
of an earlier mori-tp took, and must now be refused as another version."""

from __future__ import annotations

import random
import time
import unittest
from typing import Any, List
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
    from mori_tp.engines import Receiver, Streamer, TransferTimeoutError, new_token, plan_request
    from mori_tp.engines.protocol import (
        MAX_MESSAGE_BYTES,
        abort_message,
        chunk_message,
        parse_message,
        seal_message,
    )
    from test_streaming import BUFFERS, Inbox, expect, mooncake_pair, nixl_pair, sides_for

needs_numpy = unittest.skipIf(np is None, "numpy is not installed")

SHORT = 0.5
LONG = 30.0


def forged(rid: str, rest: str, token: str = "f" * 32) -> List[bytes]:
    """A stranger's message for ``rid``: as version 1 had it (no token), as version 2 (no
    staging mode), as version 3 (no answers) and as version 4, with a guessed token."""
    return [f"mori-tp/1 {rid} {rest}".encode(), f"mori-tp/2 {rid} {token} {rest}".encode(),
            f"mori-tp/3 {rid} {token} {rest}".encode(),
            f"mori-tp/4 {rid} {token} {rest} reply 0".encode()]


@needs_numpy
class FormatTest(unittest.TestCase):
    def test_messages_carry_the_request_and_its_token(self):
        token = new_token()
        self.assertRegex(token, "^[0-9a-f]{32}$")
        self.assertEqual(len({new_token() for _ in range(1000)}), 1000)
        raw = chunk_message("r-1", token, 3, [(0, 2), (4, 6)], sealed=4, staging=Staging.DST)
        self.assertEqual(raw, f"mori-tp/4 r-1 {token} chunk 3 0-2,4-6 staging DST sealed 4 reply 0"
                         .encode())
        message = parse_message(raw)
        self.assertEqual((message.request_id, message.token, message.kind, message.index,
                          message.ranges, message.sealed, message.staging),
                         ("r-1", token, "chunk", 3, ((0, 2), (4, 6)), 4, Staging.DST))
        for mode in Staging:
            self.assertIs(parse_message(chunk_message("r", token, 0, [(0, 1)], staging=int(mode)))
                          .staging, mode)
        with self.assertRaisesRegex(InvalidArgumentError, "staging 7 is not a Staging"):
            chunk_message("r", token, 0, [(0, 1)], staging=7)
        # Version 2 had no staging word: a version-3 receiver takes it for another version.
        self.assertEqual(parse_message(f"mori-tp/2 r {token} chunk 0 0-1".encode()).kind,
                         "version")
        for bad in ("chunk 0 0-1", "chunk 0 0-1 staging both", "chunk 0 0-1 staging ALL",
                    "chunk 0 0-1 sealed 1 staging SRC", "chunk 0 0-1 staging"):
            self.assertEqual(parse_message(f"mori-tp/4 r {token} {bad}".encode()).kind,
                             "malformed", bad)
        self.assertEqual(seal_message("r-1", token, 4),
                         f"mori-tp/4 r-1 {token} sealed 4 reply 0".encode())
        aborted = parse_message(abort_message("r-1", token, "pack\nfailed: é", busy=True))
        self.assertEqual((aborted.kind, aborted.busy, aborted.reason),
                         ("abort", True, "pack failed: ?"))
        self.assertFalse(parse_message(abort_message("r-1", token, "x")).busy)
        self.assertIsNone(parse_message(b"someone else's"))
        self.assertEqual(parse_message(b"mori-tp/1 r-1 chunk 0 0-1").kind, "version")

    def test_request_ids_and_tokens_the_protocol_cannot_carry_are_refused_up_front(self):
        """p1 (issue 33.4): a non-ASCII id used to pass the sender's check and then be taken
        for another user's notification; now both ends refuse it before anything moves."""
        sides = sides_for(Staging.SRC)
        sender, receiver_transport, peer = mooncake_pair(sides)
        receiver = Receiver(receiver_transport).start()
        streamer = Streamer(sender, timeout=LONG)
        for bad in ("req-\u00e9t\u00e9", "a b", "", "x" * 201, "tab\there", "del\x7f"):
            with self.assertRaisesRegex(InvalidArgumentError, "printable ASCII"):
                expect(receiver, sides, bad, Staging.SRC)
            released: List[int] = []
            with self.assertRaisesRegex(InvalidArgumentError, "printable ASCII"):
                streamer.open(peer, sides.plan(Staging.SRC), bad,
                              release=lambda: released.append(1))
            self.assertEqual(released, [1], "a refused open still gives its slot back")
        self.assertEqual(receiver._incoming, {})
        for bad in ("short", "x" * 129, "has space in it!", 12345, "é" * 20):
            with self.assertRaisesRegex(InvalidArgumentError, "a request token must be"):
                expect(receiver, sides, "r", Staging.SRC, token=bad)
        with self.assertRaisesRegex(InvalidArgumentError, "needs its token"):
            streamer.open(peer, plan_request(
                sides.config, sides.request.src_pages, sides.request.dst_pages,
                local=sides.local, remote=sides.remote), "r")
        with self.assertRaisesRegex(InvalidArgumentError, "differs from the one the plan"):
            streamer.open(peer, sides.plan(Staging.SRC), "r", token=new_token())
        incoming = expect(receiver, sides, "!~" + "-" * 198, Staging.SRC)
        self.assertEqual(incoming.request_id, "!~" + "-" * 198)
        streamer.close()

    def test_parsing_never_raises_and_refuses_what_is_too_long(self):
        rng = random.Random(5)
        token = "a" * 32
        for _ in range(3000):
            words = [rng.choice(["chunk", "sealed", "abort", "-1", "0", "12", "0-3", "3-0",
                                 "1-2,2-3", "ended", "busy", "+1", "1_0", "\xff", "", " ",
                                 "99999999999", "0x1", "1--2", "staging", "BOTH", "NONE",
                                 "none"])
                     for _ in range(rng.randint(0, 8))]
            raw = f"mori-tp/4 r {token} {' '.join(words)}".encode("utf-8", "replace")
            message = parse_message(raw)
            self.assertIsNotNone(message)
            if message.kind == "chunk":
                self.assertGreaterEqual(message.index, 0)
                self.assertTrue(all(a >= 0 and b >= 0 for a, b in message.ranges))
                self.assertIsInstance(message.staging, Staging)
        self.assertEqual(parse_message(b"mori-tp/4 r t chunk -1 0-4 staging SRC sealed 1").kind,
                         "malformed")
        huge = b"mori-tp/4 r " + token.encode() + b" chunk 0 " + b"0-1," * MAX_MESSAGE_BYTES
        message = parse_message(huge)
        self.assertEqual((message.kind, message.request_id, message.token),
                         ("oversized", "r", token))
        with self.assertRaisesRegex(InvalidArgumentError, "more than the protocol's 65536"):
            chunk_message("r", token, 0, [(2 * b, 2 * b + 1) for b in range(20000)],
                          staging=Staging.BOTH)


@needs_numpy
class BindingTest(unittest.TestCase):
    """Issue 40.1: a message is taken for a request only with the request's token, and from
    its bound sender when the decode rank named one."""

    def test_a_stranger_cannot_complete_abort_or_poison_requests(self):
        """probe_1: request B reuses A's staging slot; a stranger's 'chunk 0 ... sealed 1'
        would unpack A's bytes into B's pages; an abort, messages sent before expect and a
        message after A completed would end requests they do not own."""
        sides = sides_for(Staging.DST)
        sender, receiver_transport, peer = nixl_pair(sides)
        receiver = Receiver(receiver_transport).start()
        mallory = receiver_transport.agent.notifs

        def stranger(messages: List[bytes]) -> None:
            mallory.setdefault("mallory", []).extend(messages)

        a = expect(receiver, sides, "req-A", Staging.DST, token=new_token())
        plan_a = plan_request(
            sides.config, sides.request.src_pages, sides.request.dst_pages, local=sides.local,
            remote=sides.remote, staging=Staging.DST, token=a.token)
        with Streamer(sender, timeout=LONG) as streamer:
            streamer.send(peer, plan_a, "req-A")
        receiver.wait(a, LONG)
        self.assertTrue(a.complete)
        a_bytes = [d.copy() for d in sides.dst]
        for d, i in zip(sides.dst, sides.initial):
            d[:] = i  # B's pages start as they were; the slot still holds A's staged bytes
        b = expect(receiver, sides, "req-B", Staging.DST, token=new_token())
        c = expect(receiver, sides, "req-C", Staging.DST, token=new_token())
        stranger(forged("req-B", f"chunk 0 0-{BUFFERS} staging DST sealed 1")
                 + forged("req-C", "abort ended bye") + forged("req-C", "abort bye")
                 + forged("req-D", "abort ended pre-poisoned") + forged("req-D", "abort x")
                 + forged("req-E", f"chunk 0 0-{BUFFERS} staging DST sealed 1")
                 + forged("req-A", "sealed 1"))
        receiver.poll()
        d = expect(receiver, sides, "req-D", Staging.DST, token=new_token())
        e = expect(receiver, sides, "req-E", Staging.DST, token=new_token())
        receiver.poll()
        for incoming in (b, c, d, e):
            self.assertFalse(incoming.done.is_set(), incoming.request_id)
            self.assertEqual(incoming.buffers_ready, set(), incoming.request_id)
        self.assertTrue(a.complete and a.error is None)
        self.assertTrue(all(np.array_equal(x, i) for x, i in zip(sides.dst, sides.initial)),
                        "a forged chunk unpacked the slot's old bytes into B's pages")
        seen = list(receiver.violations)
        for rid in ("req-B", "req-C", "req-D", "req-E", "req-A"):
            self.assertTrue(any(f"request {rid}: " in v and "'mallory'" in v
                                and "without the request's token" in v for v in seen), rid)
        self.assertTrue(any("another protocol version" in v for v in seen))
        self.assertEqual(b.peer, None)
        # B's real sender, with B's token, still completes it byte for byte.
        plan_b = plan_request(
            sides.config, sides.request.src_pages, sides.request.dst_pages, local=sides.local,
            remote=sides.remote, staging=Staging.DST, token=b.token)
        with Streamer(sender, timeout=LONG) as streamer:
            streamer.send(peer, plan_b, "req-B")
        receiver.wait(b, LONG)
        self.assertEqual(b.peer, "prefill")
        self.assertTrue(all(np.array_equal(x, y) for x, y in zip(sides.dst, a_bytes)))

    def test_a_request_bound_to_its_sender_takes_nothing_from_another_name(self):
        """probe_5's attacker names itself after the real sender; a request bound to another
        name ignores even a message with the right token from it (the engines let senders
        choose their names, so the token is what authenticates; the name catches a
        misrouted sender)."""
        sides = sides_for(Staging.SRC)
        inbox = Inbox()
        receiver = Receiver(inbox)
        incoming = expect(receiver, sides, "bound", Staging.SRC, peer="prefill-0")
        self.assertEqual(incoming.peer, "prefill-0")
        whole = chunk_message("bound", incoming.token, 0, [(0, BUFFERS)], sealed=1,
                              staging=Staging.SRC)
        inbox.queue.append(("prefill-1", whole))
        receiver.poll()
        self.assertFalse(incoming.done.is_set())
        self.assertIn("but the request is bound to 'prefill-0'", receiver.violations[-1])
        inbox.queue.append(("prefill-0", whole))
        receiver.poll()
        self.assertTrue(incoming.complete)

    def test_a_chunk_index_out_of_range_never_completes_a_request(self):
        """probe_1: 'chunk -1 ... sealed 1' completed a request (only indices at or past the
        count were refused). From the token holder, an index out of range fails the request
        naming it; nothing is unpacked."""
        sides = sides_for(Staging.SRC)
        inbox = Inbox()
        receiver = Receiver(inbox)
        for rid, rest, why in (
                ("neg", f"chunk -1 0-{BUFFERS} staging SRC sealed 1", "malformed"),
                ("big", f"chunk {BUFFERS} 0-{BUFFERS} staging SRC", "outside the chunks"),
                ("past", f"chunk 1 0-{BUFFERS} staging SRC sealed 1",
                 "sealed with 1 chunks, but chunks [1] arrived")):
            incoming = expect(receiver, sides, rid, Staging.SRC)
            inbox.queue.extend(("p", m) for m in forged(rid, rest, incoming.token))
            receiver.poll()
            self.assertTrue(incoming.done.is_set(), rid)
            self.assertFalse(incoming.complete, rid)
            self.assertIn(why, str(incoming.error), rid)
            self.assertEqual(incoming.buffers_ready, set(), rid)


@needs_numpy
class BoundsTest(unittest.TestCase):
    """Issues 40.2-40.4: what one message from anyone can cost the decode rank."""

    def test_a_seal_count_outside_one_to_the_buffers_fails_at_once(self):
        """probe_2: a huge count made every later timeout build set(range(count))."""
        sides = sides_for(Staging.SRC)
        inbox = Inbox()
        receiver = Receiver(inbox)
        for rid, count, why in (("huge", "100000", "sealed with 100000 chunks; a request of "
                                                   f"{BUFFERS} buffers has 1 to {BUFFERS}"),
                                ("zero", "0", "sealed with 0 chunks"),
                                ("digits", "100000000000", "malformed")):
            incoming = expect(receiver, sides, rid, Staging.SRC, timeout=LONG)
            inbox.queue.extend(("p", m) for m in forged(rid, f"sealed {count}", incoming.token))
            receiver.poll()
            self.assertTrue(incoming.done.is_set(), rid)
            self.assertIn(why, str(incoming.error), rid)
            self.assertLess(len(incoming.missing()), 300)

    def test_ranges_are_checked_as_ranges_before_any_is_expanded(self):
        """probe_4: one 60 KiB chunk of '0-N,0-N,...' was expanded into a list of every
        buffer of every range, under the Receiver's lock, and kept in the request's error."""
        sides = sides_for(Staging.SRC)
        inbox = Inbox()
        receiver = Receiver(inbox)
        many = ",".join([f"0-{BUFFERS}"] * 12000)
        cases = (("many", f"chunk 0 {many} staging SRC",
                  "chunk 0 has 12000 buffer ranges (1 to 12)"),
                 ("overlap", "chunk 0 0-6,3-9 staging SRC", "(0, 6) and (3, 9), which overlap"),
                 ("again", "chunk 0 0-6 staging SRC",
                  "carries buffers [0, 1, 2, 3, 4, 5] that already"),
                 ("wide", "chunk 0 " + ",".join(["0-1"] * 20000) + " staging SRC", "oversized"))
        for rid, rest, why in cases:
            incoming = expect(receiver, sides, rid, Staging.SRC)
            if rid == "again":
                inbox.queue.append(("p", chunk_message(rid, incoming.token, 1, [(0, 6)],
                                                       staging=Staging.SRC)))
            inbox.queue.extend(("p", m) for m in forged(rid, rest, incoming.token))
            receiver.poll()
            self.assertTrue(incoming.done.is_set(), rid)
            self.assertIn(why, str(incoming.error), rid)
            self.assertLess(len(str(incoming.error)), 1000, rid)
        self.assertTrue(all(len(v) < 1000 for v in receiver.violations))

    def test_one_message_that_raises_costs_only_itself(self):
        """probe_8: processing one message of a batch raised, and the rest of the batch, a
        bystander's chunk among them, was lost."""
        from mori_tp.engines import streaming

        sides = sides_for(Staging.SRC)
        inbox = Inbox()
        receiver = Receiver(inbox)
        bystander = expect(receiver, sides, "bystander", Staging.SRC)
        real = streaming.parse_message

        def parse(raw: bytes) -> Any:
            if b"attacker" in raw:
                raise MemoryError("one message too many")
            return real(raw)

        inbox.queue.extend([("attacker", b"mori-tp/1 attacker chunk 0 0-1"),
                            ("attacker", f"mori-tp/4 bystander {sides.token} chunk 0 0-1 "
                                         "staging SRC reply 0 attacker".encode()),
                            ("prefill", chunk_message("bystander", sides.token, 0,
                                                      [(0, BUFFERS)], sealed=1,
                                                      staging=Staging.SRC))])
        with mock.patch.object(streaming, "parse_message", parse):
            receiver.poll()
        self.assertTrue(bystander.complete)
        self.assertTrue(any("could not be processed: MemoryError" in v
                            for v in receiver.violations))

    def test_only_progress_resets_the_no_progress_timeout(self):
        """probe_3: a seal repeated faster than the timeout kept a request alive forever. A
        stranger's messages change nothing; the token holder's repeated seal fails it."""
        sides = sides_for(Staging.SRC)
        inbox = Inbox()
        receiver = Receiver(inbox)
        held = expect(receiver, sides, "held", Staging.SRC, timeout=SHORT)
        started = held.last_progress
        deadline = time.monotonic() + 8 * SHORT
        while not held.done.is_set() and time.monotonic() < deadline:
            inbox.queue.extend(("anyone", m) for m in forged("held", "sealed 5"))
            receiver.poll()
            time.sleep(SHORT / 5)
        self.assertEqual(held.last_progress, started)
        self.assertTrue(held.done.is_set(), "kept alive by messages that made no progress")
        self.assertIsInstance(held.error, TransferTimeoutError)
        twice = expect(receiver, sides, "twice", Staging.SRC, timeout=LONG)
        inbox.queue.extend(("p", seal_message("twice", twice.token, 5)) for _ in range(2))
        receiver.poll()
        self.assertIn("sealed twice, with 5 and 5 chunks", str(twice.error))


if __name__ == "__main__":
    unittest.main()
