"""StagingPool through the Python API: slots inside one region, full pools that answer None or
wait, misuse refused with the library's messages, a closed pool refused, threads that queue
for space instead of failing."""

from __future__ import annotations

import threading
import time
import unittest

import mori_tp
from layouts import tools_required
from mori_tp import BufferTooSmallError, InvalidArgumentError, PoolFullError, StagingPool

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

KIB = 1 << 10
MIB = 1 << 20


class StagingPoolTest(unittest.TestCase):
    def test_slots_lie_in_the_region_rounded_to_the_unit_and_disjoint(self) -> None:
        with StagingPool(4 * MIB, min_slot=64 * KIB) as pool:
            info = pool.info()
            self.assertEqual((info.capacity, info.min_slot, info.memory), (4 * MIB, 64 * KIB,
                                                                           "host"))
            self.assertEqual(info.locked, info.lock_errno == 0)
            slots = [pool.alloc(size) for size in (1, 100 * KIB, MIB, 3 * 64 * KIB)]
            self.assertEqual([s.size for s in slots], [64 * KIB, 128 * KIB, MIB, 192 * KIB])
            spans = sorted((s.offset, s.offset + s.size) for s in slots)
            for (_, end), (start, _) in zip(spans, spans[1:]):
                self.assertLessEqual(end, start)
            for slot in slots:
                self.assertEqual(slot.address, pool.address + slot.offset)
                self.assertLessEqual(slot.offset + slot.size, pool.capacity)
            self.assertEqual(pool.info().live_bytes, sum(s.size for s in slots))
            for slot in slots:
                pool.free(slot)
            self.assertEqual(pool.info().largest_free, 4 * MIB)

    @unittest.skipIf(np is None, "numpy is not installed")
    def test_a_host_slot_is_writable_through_its_view(self) -> None:
        with StagingPool(MIB, min_slot=4 * KIB) as pool:
            a, b = pool.alloc(5000), pool.alloc(5000)
            pool.view(a)[:] = 1
            pool.view(b)[:] = 2
            region = pool.view()
            self.assertTrue((region[a.offset:a.offset + a.size] == 1).all())
            self.assertTrue((region[b.offset:b.offset + b.size] == 2).all())
            pool.free(a)
            pool.free(b)

    @unittest.skipIf(np is None, "numpy is not installed")
    def test_a_view_keeps_the_region_mapped_after_close_until_it_is_dropped(self) -> None:
        def mapped(address: int) -> bool:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if lo <= address < hi:
                        return True
            return False

        pool = StagingPool(MIB, min_slot=4 * KIB)
        address = pool.address
        slot = pool.alloc(5000)
        view = pool.view(slot)
        view[:] = 7
        part = pool.view()[slot.offset + 10:slot.offset + 20]  # a slice keeps its base
        self.assertEqual(pool.live_views, 2)
        # Live slots still refuse closing, views or not; the pool stays open.
        with self.assertRaisesRegex(InvalidArgumentError, "1 slots .* are still allocated"):
            pool.close()
        self.assertFalse(pool.closed)
        pool.free(slot)
        pool.close()
        self.assertTrue(pool.closed)
        self.assertTrue(mapped(address))
        self.assertTrue((view == 7).all())  # reads the region: still mapped
        self.assertEqual(part.tolist(), [7] * 10)
        dead = f"pool {pool.handle} is not a live staging pool"
        for call in (lambda: pool.alloc(1), lambda: pool.try_alloc(1), lambda: pool.free(0),
                     pool.info, pool.view):
            with self.assertRaisesRegex(InvalidArgumentError, dead):
                call()
        pool.close()  # closing twice does nothing
        del view
        self.assertEqual(pool.live_views, 1)
        self.assertTrue(mapped(address))
        del part
        self.assertEqual(pool.live_views, 0)
        self.assertFalse(mapped(address), "the last view dropped: the region is unmapped")
        # With no view alive, close unmaps at once.
        pool = StagingPool(MIB, min_slot=4 * KIB)
        address = pool.address
        pool.view()[0] = 1  # a view dropped at once
        self.assertEqual(pool.live_views, 0)
        pool.close()
        self.assertFalse(mapped(address))

    def test_a_full_pool_answers_none_or_waits_then_raises(self) -> None:
        with StagingPool(MIB, min_slot=64 * KIB) as pool:
            whole = pool.alloc(MIB)
            self.assertIsNone(pool.try_alloc(1))
            with self.assertRaisesRegex(PoolFullError, "still full after waiting") as caught:
                pool.alloc(1, timeout=0.02)
            # MORI_ERR_POOL_FULL: its own code, still caught as a BufferTooSmallError.
            self.assertEqual((caught.exception.code, caught.exception.status),
                             (11, "MORI_ERR_POOL_FULL"))
            self.assertIsInstance(caught.exception, BufferTooSmallError)
            # A slot the pool can never hold is the other code, at once, never None.
            with self.assertRaisesRegex(BufferTooSmallError, "can never be granted") as never:
                pool.try_alloc(2 * MIB)
            self.assertNotIsInstance(never.exception, PoolFullError)
            self.assertEqual(never.exception.code, 7)
            with self.assertRaisesRegex(BufferTooSmallError, "can never be granted") as never:
                pool.alloc(2 * MIB, timeout=3600)
            self.assertNotIsInstance(never.exception, PoolFullError)
            pool.free(whole)

    def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused(self) -> None:
        """No wait is unbounded: infinity, NaN, a negative time and one past uint64_t
        milliseconds are refused with the value, and nothing is allocated (issue 33.18: inf
        raised OverflowError)."""
        with StagingPool(MIB, min_slot=64 * KIB) as pool:
            for timeout in (float("inf"), float("nan"), -1.0, 1e30):
                with self.assertRaisesRegex(InvalidArgumentError, "timeout") as caught:
                    pool.alloc(4096, timeout=timeout)
                self.assertIn("StagingPool.alloc", str(caught.exception))
                self.assertEqual(pool.info().live_slots, 0)
            self.assertIn("finite", str(self._refusal(pool, float("inf"))))
            pool.free(pool.alloc(4096, timeout=0))

    @staticmethod
    def _refusal(pool: StagingPool, timeout: float) -> BaseException:
        try:
            pool.alloc(4096, timeout=timeout)
        except InvalidArgumentError as error:
            return error
        raise AssertionError(f"alloc(timeout={timeout}) was accepted")

    def test_misuse_is_refused_with_the_offsets(self) -> None:
        with StagingPool(MIB, min_slot=64 * KIB) as pool:
            slot = pool.alloc(200 * KIB)
            with self.assertRaisesRegex(InvalidArgumentError, "inside the live slot at offset 0"):
                pool.free(slot.offset + 64 * KIB)
            pool.free(slot)
            with self.assertRaisesRegex(InvalidArgumentError, "a double free"):
                pool.free(slot)
            with self.assertRaisesRegex(InvalidArgumentError, "a slot of 0 bytes"):
                pool.try_alloc(0)

    def test_a_closed_pool_refuses_every_call_and_live_slots_prevent_closing(self) -> None:
        pool = StagingPool(MIB, min_slot=64 * KIB)
        slot = pool.alloc(1)
        with self.assertRaisesRegex(InvalidArgumentError, "still allocated"):
            pool.close()
        pool.free(slot)
        pool.close()
        pool.close()
        dead = f"pool {pool.handle} is not a live staging pool"
        for call in (lambda: pool.alloc(1), lambda: pool.try_alloc(1), lambda: pool.free(0),
                     pool.info):
            with self.assertRaisesRegex(InvalidArgumentError, dead):
                call()

    def test_bad_shapes_are_refused(self) -> None:
        for kwargs, pattern in (
            (dict(capacity=0), "capacity is 0"),
            (dict(capacity=MIB, min_slot=3000), "min_slot must be a power of two"),
            (dict(capacity=100 * KIB, min_slot=64 * KIB), "multiple of min_slot"),
            (dict(capacity=MIB, memory="gpu"), "memory 'gpu'"),
        ):
            with self.subTest(**kwargs), self.assertRaisesRegex(InvalidArgumentError, pattern):
                StagingPool(**kwargs)

    def test_threads_queue_for_space_instead_of_failing(self) -> None:
        # Six threads each take 3/8 of the pool at a time: at most two fit at once. The test
        # holds the pool full first, so every thread's first alloc must wait for its frees.
        with StagingPool(8 * MIB, min_slot=64 * KIB) as pool:
            failures = []
            peak = []
            freeing = threading.Event()
            first_grants_before_free = []
            held = [pool.alloc(3 * MIB), pool.alloc(3 * MIB)]
            self.assertIsNone(pool.try_alloc(3 * MIB))

            def work() -> None:
                try:
                    for i in range(10):
                        slot = pool.alloc(3 * MIB, timeout=60)
                        if i == 0 and not freeing.is_set():
                            first_grants_before_free.append(slot)  # granted while full
                        peak.append(pool.info().live_slots)
                        pool.free(slot)
                except mori_tp.MoriError as error:  # pragma: no cover - reported below
                    failures.append(error)

            threads = [threading.Thread(target=work) for _ in range(6)]
            for thread in threads:
                thread.start()
            # The pool reports all six waiting on the full pool: they blocked, in whatever
            # order they ran (bounded, so that a bug cannot hang the test).
            deadline = time.monotonic() + 60
            while pool.info().waiters < 6:
                self.assertLess(time.monotonic(), deadline, f"waiting: {pool.info()}")
                time.sleep(0.001)
            self.assertEqual(peak, [], "no thread got a slot while the pool was full")
            freeing.set()
            for slot in held:
                pool.free(slot)
            for thread in threads:
                thread.join(120)
            self.assertEqual(failures, [])
            self.assertEqual(first_grants_before_free, [])
            self.assertEqual(len(peak), 60)
            self.assertLessEqual(max(peak), 2)
            self.assertEqual(pool.info().live_slots, 0)
            self.assertEqual(pool.info().waiters, 0)


if __name__ == "__main__":
    unittest.main()
