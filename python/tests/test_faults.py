"""What mori_tp.engines does when a transfer goes wrong, in one process against the stand-in
engines (engine_fakes.py): registration epochs refused before any byte moves, Mooncake's
per-peer queue as a budget shared by all threads and a setting above it refused with the
numbers, NIXL's exceptions named, a stream's slot returned exactly once and only when nothing
uses it, bounded waits with errors that name the peer and the request. The real engines run
the same faults between two processes in engine_faults.py."""

from __future__ import annotations

import os
import threading
import time
import unittest
from dataclasses import replace
from typing import Any, List
from unittest import mock

from layouts import tools_required
from mori_tp import Staging

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

if np is not None:
    from engine_fakes import FakeMooncake, FakeNixlAgent
    from mori_tp.engines import (
        new_token,
        PeerLostError,
        Receiver,
        StaleRegistrationError,
        Streamer,
        TransferError,
        TransferTimeoutError,
        new_epoch,
    )
    from mori_tp.engines.faults import PeerEpochs, SegmentBudget, planned_epoch
    from mori_tp.engines.mooncake import MooncakeTransport
    from mori_tp.engines.nixl import NixlTransport
    from mori_tp.engines.streaming import chunk_message
    from test_engines import LAYOUTS, LONG_REQUEST, Sides, pair_staged


def fresh(sides: Any) -> str:
    """A new token for the next request of ``sides`` (its plans carry it from now on): a
    receiver refuses a token an earlier request used (issue 44 F04)."""
    from mori_tp.engines import new_token as _new

    sides.token = _new()
    return sides.token


needs_numpy = unittest.skipIf(np is None, "numpy is not installed")

SHORT = 0.3
LONG = 30.0


def mooncake_pair(sides: "Sides", **kwargs: Any):
    peers: dict = {}
    prefill, decode = FakeMooncake(15001, peers), FakeMooncake(15002, peers)
    peers["127.0.0.1:15002"] = decode
    peers["127.0.0.1:15001"] = prefill  # the decode rank answers (done, cancel)
    sender, receiver = MooncakeTransport(prefill, **kwargs), MooncakeTransport(decode)
    sender.register(sides.local_registered)
    remote = receiver.register(sides.remote_registered)
    return sender, receiver, receiver.session_id, remote.epoch


def nixl_pair(sides: "Sides"):
    agents: dict = {}
    sender = NixlTransport(FakeNixlAgent("prefill", agents))
    receiver = NixlTransport(FakeNixlAgent("decode", agents))
    sender.agent.polls = 1
    sender.register(sides.local_registered)
    remote = receiver.register(sides.remote_registered)
    return sender, receiver, sender.add_peer(receiver.metadata()), remote.epoch


PAIRS = {"mooncake": mooncake_pair, "nixl": nixl_pair}


def engine_calls(transport: Any) -> int:
    engine = getattr(transport, "engine", None)
    return len(engine.calls) if engine is not None else len(transport.agent.transfers)


def decode(receiver_transport: Any, sides: "Sides", *rids: str) -> "Receiver":
    """A decode rank that expects ``rids`` (SRC, the sides' token) and answers them: a
    sender's wait reports success only after the decode rank's ``done``."""
    receiver = Receiver(receiver_transport).start()
    for rid in rids:
        receiver.expect(rid, sides.config, sides.request.dst_pages, memory=sides.remote,
                        staging=Staging.SRC, backend="host", token=fresh(sides))
    return receiver


def src_sides() -> "Sides":
    return Sides(LAYOUTS[Staging.SRC], *pair_staged(Staging.SRC))


@needs_numpy
class EpochTest(unittest.TestCase):
    def test_register_stamps_the_transports_epoch_and_unregister_draws_a_new_one(self):
        for engine, make in PAIRS.items():
            sides = src_sides()
            sender, receiver, _, epoch = make(sides)
            self.assertEqual(epoch, receiver.epoch, engine)
            self.assertNotEqual(epoch, 0, engine)
            self.assertEqual(receiver.register(sides.remote).to_dict()["epoch"], epoch)
            if engine == "mooncake":
                receiver.unregister(sides.remote_registered)
            else:
                receiver.unregister()
            self.assertNotEqual(receiver.epoch, epoch, f"{engine}: unregister kept the epoch")
        self.assertEqual(len({new_epoch() for _ in range(1000)}), 1000)
        self.assertTrue(all(new_epoch() & 1 for _ in range(100)), "an epoch of 0")

    def test_a_plan_against_another_epoch_is_refused_before_anything_moves(self):
        for engine, make in PAIRS.items():
            for how in ("send", "write", "stream", "notify"):
                sides = src_sides()
                sender, _, peer, epoch = make(sides)
                old = replace(sides.remote, epoch=epoch)
                sides.remote = old
                plan = sides.plan(Staging.SRC)
                sender.set_peer_epoch(peer, epoch ^ 0xF0)  # the peer came back with new memory
                staging_before = sides.src_pool.copy()
                with self.assertRaises(StaleRegistrationError) as caught:
                    if how == "send":
                        sender.send(peer, plan, request_id="r-9")
                    elif how == "write":
                        sender.write(peer, *plan.addresses(), epoch=plan.remote.epoch,
                                     request_id="r-9")
                    elif how == "notify":
                        sender.notify(peer, b"x", carrier=int(plan.addresses()[1][0]),
                                      epoch=plan.remote.epoch, request_id="r-9")
                    else:
                        with Streamer(sender, timeout=LONG) as streamer:
                            streamer.send(peer, plan, "r-9")
                error = caught.exception
                what = f"{engine} {how}"
                self.assertIsInstance(error, TransferError, what)
                self.assertEqual((error.planned, error.current), (epoch, epoch ^ 0xF0), what)
                self.assertEqual((error.peer, error.request_id), (peer, "r-9"), what)
                self.assertIn("nothing was written", str(error), what)
                self.assertIn(f"{epoch:#x}", str(error), what)
                self.assertEqual(engine_calls(sender), 0, f"{what}: the engine was called")
                self.assertTrue(all(np.array_equal(d, i) for d, i in zip(sides.dst,
                                                                          sides.initial)), what)
                self.assertTrue(np.array_equal(sides.src_pool, staging_before),
                                f"{what}: the stale plan was packed")
                # The peer's own epoch goes through.
                sides.remote = replace(old, epoch=epoch ^ 0xF0)
                sender.send(peer, sides.plan(Staging.SRC))

    def test_a_request_of_groups_is_checked_by_its_remote_epoch(self):
        for engine, make in PAIRS.items():
            sides = src_sides()
            sender, _, peer, epoch = make(sides)
            sender.set_peer_epoch(peer, epoch)
            plan = mock.Mock(spec=["pack", "addresses", "staging", "segments", "bytes",
                                   "remote_epoch"], remote_epoch=epoch ^ 2)
            with self.assertRaises(StaleRegistrationError):
                sender.send(peer, plan, request_id="groups-1")
            plan.pack.assert_not_called()
            # A GroupsPlan made without an epoch is not checked (remote_epoch None).
            self.assertIsNone(planned_epoch(mock.Mock(spec=["remote_epoch"],
                                                      remote_epoch=None)))

    def test_no_recorded_epoch_means_no_check_and_epochs_must_be_nonzero(self):
        epochs = PeerEpochs()
        epochs.check("x", "peer", 5)  # nothing recorded: nothing to refuse
        epochs.check("x", "peer", None)
        epochs.set("peer", 7)
        epochs.check("x", "peer", 7)
        with self.assertRaises(StaleRegistrationError):
            epochs.check("x", "peer", 0)  # memory the peer never announced
        for bad in (0, -1, 1 << 64, "7"):
            with self.assertRaises(ValueError):
                epochs.set("peer", bad)
        epochs.forget("peer")
        epochs.check("x", "peer", 1)


@needs_numpy
class MooncakeQueueTest(unittest.TestCase):
    def test_calls_larger_than_the_per_peer_queue_are_refused_with_the_numbers(self):
        engine = FakeMooncake(15001, {})
        with mock.patch.dict(os.environ, {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": ""}):
            self.assertEqual(MooncakeTransport(engine).max_segments_per_call, 1024)
            self.assertEqual(MooncakeTransport(engine).segment_budget, 1024)
            with self.assertRaisesRegex(ValueError, "must be 1 to 1024 .*"
                                        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER.*not 4096"):
                MooncakeTransport(engine, max_segments_per_call=4096)
            with self.assertRaisesRegex(ValueError, "not 0"):
                MooncakeTransport(engine, max_segments_per_call=0)
        with mock.patch.dict(os.environ, {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "3000"}):
            transport = MooncakeTransport(engine, max_segments_per_call=3000)
            self.assertEqual((transport.segment_budget, transport.max_segments_per_call),
                             (3000, 3000))
            self.assertEqual(MooncakeTransport(engine).max_segments_per_call, 1024)

    def test_threads_together_never_hold_more_than_the_queue_for_one_peer(self):
        sides = Sides(LAYOUTS[Staging.SRC], 0, 1, LONG_REQUEST)
        sender, _, peer, _ = mooncake_pair(sides, max_segments_per_call=300,
                                           segment_budget=700)
        held: List[int] = [0]
        most: List[int] = [0]
        lock = threading.Lock()
        real = sender.engine.batch_transfer_sync_write

        def slow(session, src, dst, lengths):
            with lock:
                held[0] += len(lengths)
                most[0] = max(most[0], held[0])
            time.sleep(0.01)
            try:
                return real(session, src, dst, lengths)
            finally:
                with lock:
                    held[0] -= len(lengths)

        sender.engine.batch_transfer_sync_write = slow
        plan = sides.plan(Staging.NONE)
        errors: List[BaseException] = []

        def send() -> None:
            try:
                sender.send(peer, plan)
            except BaseException as error:  # noqa: B036 - reported below
                errors.append(error)

        threads = [threading.Thread(target=send) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(LONG)
        self.assertEqual(errors, [])
        self.assertLessEqual(most[0], 700)
        self.assertGreater(most[0], 300, "the calls never overlapped")
        self.assertEqual(sender.budget.held(peer), 0)

    def test_no_room_within_the_timeout_is_a_timeout_naming_the_numbers(self):
        sides = src_sides()
        sender, _, peer, _ = mooncake_pair(sides)
        self.assertTrue(sender.budget.acquire(peer, 1000, None))  # another thread's call
        src, dst, lengths = sides.plan(Staging.NONE).addresses()
        start = time.monotonic()
        with self.assertRaisesRegex(TransferTimeoutError,
                                    f"no room for {len(lengths)} segments in the queue to "
                                    f"{peer} \\(request r-3\\) within {SHORT} s \\(1000 of 1024"):
            sender.write(peer, src, dst, lengths, timeout=SHORT, request_id="r-3")
        self.assertLess(time.monotonic() - start, SHORT + 2)
        self.assertEqual(engine_calls(sender), 0)
        sender.budget.release(peer, 1000)

    def test_a_budget_refuses_what_can_never_fit(self):
        budget = SegmentBudget(10)
        with self.assertRaisesRegex(ValueError, "11 segments can never fit a queue of 10"):
            budget.acquire("p", 11, 1.0)

    def test_a_failing_call_names_the_peer_and_the_request(self):
        sides = src_sides()
        sender, _, peer, _ = mooncake_pair(sides)
        sender.engine.batch_transfer_sync_write = lambda *args: -1
        with self.assertRaises(TransferError) as caught:
            sender.write(peer, *sides.plan(Staging.NONE).addresses(), request_id="r-5")
        self.assertEqual((caught.exception.peer, caught.exception.request_id), (peer, "r-5"))
        self.assertIn(f"to {peer} (request r-5) returned -1", str(caught.exception))


class NixlError(Exception):
    """Stands for NIXL's exception classes (their names start with "nixl")."""


class nixlRemoteDisconnectError(NixlError):  # noqa: N801 - NIXL's class name
    pass


class nixlBackendError(NixlError):  # noqa: N801
    pass


@needs_numpy
class NixlErrorsTest(unittest.TestCase):
    def test_nixl_exceptions_become_transfer_errors_naming_peer_and_request(self):
        for raised, kind in ((nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"),
                              PeerLostError),
                             (nixlBackendError("NIXL_ERR_BACKEND"), TransferError)):
            sides = src_sides()
            sender, _, peer, _ = nixl_pair(sides)

            def fail(*args, raised=raised):
                raise raised

            sender.agent.transfer = fail
            with self.assertRaises(kind) as caught:
                sender.write(peer, *sides.plan(Staging.NONE).addresses(), request_id="r-1")
            error = caught.exception
            self.assertEqual((error.peer, error.request_id), (peer, "r-1"))
            self.assertIn(f"to {peer} (request r-1) failed: {type(raised).__name__}",
                          str(error))
            self.assertFalse(error.engine_busy)
            self.assertEqual(sender.agent.released, 1, "the handle was not released")

    def test_other_exceptions_pass_through(self):
        sides = src_sides()
        sender, _, peer, _ = nixl_pair(sides)
        sender.agent.transfer = mock.Mock(side_effect=KeyError("not NIXL's"))
        with self.assertRaises(KeyError):
            sender.write(peer, *sides.plan(Staging.NONE).addresses())

    def test_a_transfer_that_cannot_be_cancelled_marks_the_error_engine_busy(self):
        sides = src_sides()
        sender, _, peer, _ = nixl_pair(sides)
        sender.agent.polls = None
        real_transfer = sender.agent.transfer

        def never_done(handle):
            real_transfer(handle)
            handle["left"] = None
            return "PROC"

        sender.agent.transfer = never_done
        sender.agent.release_xfer_handle = mock.Mock(
            side_effect=nixlBackendError("cannot cancel"))
        with self.assertRaises(TransferTimeoutError) as caught:
            sender.write(peer, *sides.plan(Staging.NONE).addresses(), timeout=SHORT,
                         request_id="r-2")
        self.assertTrue(caught.exception.engine_busy)
        self.assertIn("could not be cancelled", str(caught.exception))
        self.assertIn(f"still in progress after {SHORT} s", str(caught.exception))


class Gate:
    """A transport wrapper whose writes of chunk ``index`` wait for ``opened``, or raise
    ``error``."""

    def __init__(self, inner: Any, index: int = 1, error: Any = None) -> None:
        self.inner, self.index, self.error = inner, index, error
        self.peer_epochs = inner.peer_epochs
        self.opened = threading.Event()
        self.entered = threading.Event()

    def write(self, peer, src, dst, lengths, *, notification=b"", **kwargs):
        if f" chunk {self.index} ".encode() in notification:
            self.entered.set()
            if self.error is not None:
                raise self.error
            self.opened.wait(LONG)
        return self.inner.write(peer, src, dst, lengths, notification=notification, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@needs_numpy
class ReleaseTest(unittest.TestCase):
    def test_the_slot_is_released_once_after_success(self):
        for engine, make in PAIRS.items():
            sides = src_sides()
            sender, receiver_transport, peer, _ = make(sides)
            receiver = decode(receiver_transport, sides, "ok-1")
            calls: List[int] = []
            with Streamer(sender, timeout=LONG) as streamer:
                stream = streamer.open(peer, sides.plan(Staging.SRC), "ok-1",
                                       release=lambda: calls.append(1))
                stream.submit(buffers=[(0, 2)])
                stream.submit(buffers=[(2, 4)])
                stream.seal()
                stream.wait()
                self.assertTrue(stream.confirmed, engine)
                self.assertTrue(stream.released(LONG), engine)
            receiver.close()
            self.assertEqual(calls, [1], engine)

    def test_a_failed_stream_releases_its_slot_only_after_the_write_in_progress_returns(self):
        sides = src_sides()
        sender, _, peer, _ = nixl_pair(sides)
        gate = Gate(sender)
        calls: List[float] = []
        with Streamer(gate, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "slow-1",
                                   release=lambda: calls.append(time.monotonic()))
            stream.submit(buffers=[(0, 1)])
            stream.submit(buffers=[(1, 4)])
            stream.seal()
            self.assertTrue(gate.entered.wait(LONG))
            with self.assertRaises(TransferTimeoutError) as caught:
                stream.wait(timeout=SHORT)
            self.assertEqual((caught.exception.request_id, caught.exception.peer),
                             ("slow-1", peer))
            self.assertIn(f"request slow-1 to {peer}: not written after {SHORT} s",
                          str(caught.exception))
            time.sleep(SHORT)
            self.assertEqual(calls, [], "released while the engine was still writing chunk 1")
            opened = time.monotonic()
            gate.opened.set()
            self.assertTrue(stream.released(LONG))
        self.assertEqual(len(calls), 1)
        self.assertGreaterEqual(calls[0], opened)

    def test_a_write_error_releases_the_slot_and_names_the_request(self):
        for engine, make in PAIRS.items():
            sides = src_sides()
            sender, receiver_transport, peer, _ = make(sides)
            receiver = decode(receiver_transport, sides, "gone-1", "next-1")
            gate = Gate(sender, error=TransferError("the peer went away", peer=peer))
            calls: List[int] = []
            with Streamer(gate, timeout=LONG) as streamer:
                with self.assertRaisesRegex(TransferError, "the peer went away") as caught:
                    streamer.send(peer, sides.plan(Staging.SRC), "gone-1", chunks=2,
                                  release=lambda: calls.append(1))
                self.assertEqual((caught.exception.request_id, caught.exception.peer),
                                 ("gone-1", peer), engine)
                # The streamer goes on serving other requests.
                gate.index = -1
                streamer.send(peer, sides.plan(Staging.SRC), "next-1", chunks=2)
            receiver.close()
            self.assertEqual(calls, [1], engine)

    def test_an_engine_that_may_still_read_keeps_the_slot(self):
        sides = src_sides()
        sender, _, peer, _ = nixl_pair(sides)
        busy = TransferTimeoutError("stuck", peer=peer, request_id="busy-1", engine_busy=True)
        gate = Gate(sender, error=busy)
        calls: List[int] = []
        with Streamer(gate, timeout=LONG) as streamer:
            stream = streamer.open(peer, sides.plan(Staging.SRC), "busy-1",
                                   release=lambda: calls.append(1))
            stream.submit(buffers=[(0, 1)])
            stream.submit(buffers=[(1, 4)])
            stream.seal()
            with self.assertRaises(TransferTimeoutError):
                stream.wait()
            with self.assertRaisesRegex(TransferTimeoutError,
                                        f"request busy-1 .*: local memory not released after "
                                        f"{SHORT} s: .*its staging slot is not released"):
                stream.released(SHORT)
        self.assertEqual(calls, [])
        self.assertIn("its staging slot is not released", stream.kept)


@needs_numpy
class NotificationsTest(unittest.TestCase):
    """How the transports hand over notifications: one message the binding cannot convert
    costs only itself (issue 33.5), and two threads taking notifications never lose or double
    one (33.19)."""

    def test_a_foreign_mooncake_notification_costs_neither_itself_nor_the_batch(self):
        """p7: another user's message with a character outside latin-1 (the euro sign), and
        one whose fields the binding cannot convert, beside a mori-tp message."""
        sides = src_sides()
        _, receiver, _, _ = mooncake_pair(sides)

        class Unconvertible:
            name = "someone"

            @property
            def msg(self):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

        from engine_fakes import TransferNotify

        receiver.engine.inbox.extend([
            TransferNotify("prefill:1", chunk_message("R", "0" * 32, 0, [(0, 1)],
                                                      staging=Staging.NONE).decode()),
            TransferNotify("other", "caf\u00e9 5\u20ac"),
            Unconvertible(),
            TransferNotify("prefill:1", "after"),
        ])
        got = receiver.poll_notifications()
        self.assertEqual(got, [
            ("prefill:1", chunk_message("R", "0" * 32, 0, [(0, 1)], staging=Staging.NONE)),
            ("other", "caf\u00e9 5\u20ac".encode("utf-8")),
            ("someone", b""),
            ("prefill:1", b"after"),
        ])
        self.assertEqual(receiver.poll_notifications(), [])

    def test_two_threads_taking_nixl_notifications_each_get_distinct_ones_and_lose_none(self):
        """A Receiver polls while another thread waits for one message; NIXL appends a new
        one meanwhile. Each message goes to exactly one of them."""
        agents: dict = {}
        sender = NixlTransport(FakeNixlAgent("prefill", agents))
        receiver = NixlTransport(FakeNixlAgent("decode", agents))
        hooked = [True]
        waited: List[bool] = []

        def other_thread() -> None:
            sender.agent.send_notif("decode", b"m4")  # arrives during the poll
            waited.append(receiver._take_notification("prefill", b"m2"))

        class Racing(list):
            """The copy a poll takes of the list, then the other thread's turn."""

            def _turn(self):
                if hooked[0]:
                    hooked[0] = False
                    thread = threading.Thread(target=other_thread)
                    thread.start()
                    thread.join(0.5)  # it cannot finish while the poll holds the lock

            def __getitem__(self, index):
                copy = super().__getitem__(index)
                if isinstance(index, slice):
                    self._turn()
                return copy

            def __iter__(self):
                copy = list(super().__iter__())
                self._turn()
                return iter(copy)

        receiver.agent.notifs["prefill"] = Racing([b"m1", b"m2", b"m3"])
        polled = [m for _, m in receiver.poll_notifications()]
        until_done = time.monotonic() + LONG
        while not waited and time.monotonic() < until_done:
            time.sleep(0.001)
        polled += [m for _, m in receiver.poll_notifications()]
        taken = polled + ([b"m2"] if waited == [True] else [])
        self.assertEqual(sorted(taken), [b"m1", b"m2", b"m3", b"m4"], (polled, waited))

    def test_two_threads_taking_mooncake_notifications_each_get_distinct_ones_and_lose_none(
            self):
        """The same for Mooncake: a poll and a wait_notification that sets messages aside."""
        sides = src_sides()
        _, receiver, _, _ = mooncake_pair(sides)
        from engine_fakes import TransferNotify

        hooked = [True]
        waited: List[str] = []

        def other_thread() -> None:
            try:
                receiver.wait_notification("prefill", b"x", timeout=SHORT)
                waited.append("x")
            except TransferTimeoutError:
                waited.append("none")

        drain = receiver._set_aside.drain

        def racing() -> Any:
            # Another thread's wait_notification while this poll takes the set-aside ones.
            copy = drain()
            if hooked[0]:
                hooked[0] = False
                thread = threading.Thread(target=other_thread)
                thread.start()
                thread.join(0.5)
            return copy

        receiver._set_aside.drain = racing
        receiver.engine.inbox.extend([TransferNotify("prefill", "x"),
                                      TransferNotify("prefill", "y")])
        polled = [m for _, m in receiver.poll_notifications()]
        deadline = time.monotonic() + LONG
        while not waited and time.monotonic() < deadline:
            time.sleep(0.001)
        polled += [m for _, m in receiver.poll_notifications()]
        taken = polled + ([b"x"] if waited == ["x"] else [])
        self.assertEqual(sorted(taken), [b"x", b"y"], (polled, waited))

    def test_a_mooncake_notification_without_data_reads_and_never_writes_the_peer(self):
        """A seal or an abort rides on a one-byte read of the peer's memory: the peer's bytes
        do not change, and it needs no byte of the sender's request."""
        sides = src_sides()
        sender, receiver, peer, _ = mooncake_pair(sides)
        before = [d.copy() for d in sides.dst]
        sender.notify(peer, b"hello", carrier=int(sides.remote.buffers[0]))
        self.assertEqual(receiver.poll_notifications(), [(sender.session_id, b"hello")])
        self.assertTrue(all(np.array_equal(a, b) for a, b in zip(before, sides.dst)))
        with self.assertRaisesRegex(TransferError, "needs a carrier"):
            sender.notify(peer, b"hello")

    def test_a_mooncake_write_failing_at_the_engines_time_limit_is_engine_busy(self):
        """The binding gives a call up at MC_TRANSFER_TIMEOUT (plus 1 s per 10^9 bytes) and
        frees its batch with transfers possibly still queued: the error says engine_busy. An
        earlier -1 does not."""
        sides = src_sides()
        sender, _, peer, _ = mooncake_pair(sides)
        sender.engine_timeout = 0.2
        sender.engine.batch_transfer_sync_write = lambda *args: (time.sleep(0.3), -1)[1]
        with self.assertRaises(TransferError) as caught:
            sender.write(peer, *sides.plan(Staging.NONE).addresses(), request_id="r-6")
        self.assertTrue(caught.exception.engine_busy)
        self.assertIn("the engine's own time limit", str(caught.exception))
        sender.engine.batch_transfer_sync_write = lambda *args: -1
        with self.assertRaises(TransferError) as caught:
            sender.write(peer, *sides.plan(Staging.NONE).addresses(), request_id="r-7")
        self.assertFalse(caught.exception.engine_busy)


@needs_numpy
class ReceiverBoundsTest(unittest.TestCase):
    def test_no_progress_is_a_timeout_naming_peer_request_and_what_was_unpacked(self):
        sides = Sides(LAYOUTS[Staging.BOTH], *pair_staged(Staging.BOTH))
        sender, receiver_transport, peer, _ = mooncake_pair(sides)
        receiver = Receiver(receiver_transport).start()
        incoming = receiver.expect("half-1", sides.config, sides.request.dst_pages,
                                   memory=sides.remote, staging=Staging.BOTH, backend="host",
                                   timeout=SHORT)
        plan = sides.plan(Staging.BOTH)
        plan.pack(backend="host")
        src, dst, lengths = plan.addresses([(0, 2)])
        sender.write(peer, src, dst, lengths,
                     notification=chunk_message("half-1", incoming.token, 0, [(0, 2)],
                                                staging=Staging.BOTH))
        start = time.monotonic()
        with self.assertRaises(TransferTimeoutError) as caught:
            receiver.wait(incoming, timeout=LONG)
        self.assertLess(time.monotonic() - start, SHORT + 2)
        text = str(caught.exception)
        self.assertIn(f"request half-1 from {sender.session_id}: no progress for {SHORT} s",
                      text)
        self.assertIn("buffers [0, 1] (1 chunks) arrived and were unpacked into the page "
                      "buffers; no other data was unpacked", text)
        self.assertEqual(caught.exception.request_id, "half-1")
        # Buffers 2 and 3 never came: untouched.
        for b in (2, 3):
            self.assertTrue(np.array_equal(sides.dst[b], sides.initial[b]))

    def test_messages_for_a_request_never_expected_expire(self):
        sides = src_sides()
        sender, receiver_transport, peer, _ = nixl_pair(sides)
        receiver = Receiver(receiver_transport, early_timeout=SHORT)
        sender.notify(peer, b"mori-tp/4 ghost " + new_token().encode() +
                      b" abort ended the sender gave up")
        receiver.poll()
        self.assertIn("ghost", receiver._early)
        time.sleep(SHORT + 0.1)
        receiver.poll()
        self.assertNotIn("ghost", receiver._early)
        self.assertEqual(len(receiver.violations), 1, receiver.violations)
        self.assertIn("request ghost: 1 messages (abort) for a request never expected, "
                      f"dropped after {SHORT} s", receiver.violations[0])


if __name__ == "__main__":
    unittest.main()
