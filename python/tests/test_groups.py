"""Requests of several groups and pipeline layer maps through the Python API, against the
element-by-element oracle of hybrid.py: full-attention HND KV, sliding-window pages, the
indexer's per-token keys and scales on one buffer, a Mamba2 conv state of three parts (DS and
SD layouts, B and C replicated or split) and an SSM state, moved as one request per pair over
TP ratios both ways, directly and through pack, every group's segments and unpack; a prefill
pipeline of two stages into one decode stage; refusals with the library's messages and
nothing written; numpy outputs equal to lists."""

from __future__ import annotations

import ctypes
import dataclasses
import random
import unittest
from typing import Dict, List, Tuple

import hybrid
import mori_tp
from hybrid import Hybrid, Mamba, Part
from layouts import tools_required
from mori_tp import Staging

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

MODELS = [
    Hybrid(),
    # Fewer KV heads than the TP sizes, B and C split by 4 groups, the SD conv layout, page
    # sizes the other way, the indexer from 64-token pages to 1-token pages.
    Hybrid(kv_heads=2, mamba=Mamba(n_groups=4, dim_first=False), page_sizes=(32, 16),
           indexer_pages=(64, 1), tokens=97, window=70),
]
TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2)]


class Memory:
    """One rank's buffer sets: ctypes arrays of random bytes, and their addresses."""

    def __init__(self, shapes: Dict[str, Tuple[int, int]], seed: int) -> None:
        rng = random.Random(seed)
        self.sets = {name: [(ctypes.c_ubyte * size).from_buffer_copy(rng.randbytes(size))
                            for _ in range(count)] for name, (count, size) in shapes.items()}
        self.capacity = {name: size for name, (_, size) in shapes.items()}
        self.initial = self.snapshot()

    def ptrs(self) -> Dict[str, List[int]]:
        return {name: [ctypes.addressof(b) for b in buffers] for name, buffers in self.sets.items()}

    def snapshot(self) -> Dict[str, List[bytearray]]:
        return {name: [bytearray(b) for b in buffers] for name, buffers in self.sets.items()}

    def reset(self) -> None:
        for name, buffers in self.sets.items():
            for buffer, initial in zip(buffers, self.initial[name]):
                ctypes.memmove(buffer, bytes(initial), len(initial))


def request_of(model: Hybrid, p_tp: int, p: int, p_layers, d_tp: int, d: int, d_layers,
               seed: int) -> Tuple[List[Part], Memory, Memory]:
    parts = model.parts(model.request_pages(seed), p_tp, p, p_layers, d_tp, d, d_layers)
    src = Memory(model.set_shapes(0, p_tp, p_layers), seed * 2 + 1)
    dst = Memory(model.set_shapes(1, d_tp, d_layers), seed * 2 + 2)
    return parts, src, dst


def expected(parts: List[Part], src: Memory, dst: Memory) -> Dict[str, List[bytearray]]:
    want = dst.snapshot()
    hybrid.oracle(parts, {n: [bytes(b) for b in bs] for n, bs in src.sets.items()}, want)
    return want


def staged_src(mode: Staging) -> bool:
    return mode in (Staging.SRC, Staging.BOTH)


def staged_dst(mode: Staging) -> bool:
    return mode in (Staging.DST, Staging.BOTH)


def transport(groups: List[mori_tp.Group], src_region: bytearray, dst_region: ctypes.Array,
              dst: Memory, parts: List[Part], src: Memory) -> None:
    """What an engine does with groups_segments: each group's segments on each of its buffers,
    from its buffer or its part of the prefill region to its buffer or part of the decode
    region."""
    infos, _ = mori_tp.groups_info(groups)
    local, remote, sizes = mori_tp.groups_segments(groups)
    for group, info, part in zip(groups, infos, parts):
        for i, (sb, db) in enumerate(zip(part.src_buffers, part.dst_buffers)):
            for s in range(info.first_segment, info.first_segment + info.num_segments):
                n = sizes[s]
                if staged_src(group.staging):
                    at = info.src_staging_offset + i * info.staging_len + local[s]
                    data = bytes(src_region[at:at + n])
                else:
                    data = bytes(src.sets[part.set][sb])[local[s]:local[s] + n]
                if staged_dst(group.staging):
                    at = info.dst_staging_offset + i * info.staging_len + remote[s]
                    ctypes.memmove(ctypes.addressof(dst_region) + at, data, n)
                else:
                    ctypes.memmove(ctypes.addressof(dst.sets[part.set][db]) + remote[s], data, n)


class GroupsTest(unittest.TestCase):
    def check_request(self, parts: List[Part], src: Memory, dst: Memory, label: str,
                      staging=None) -> None:
        want = expected(parts, src, dst)
        dst.reset()
        groups = hybrid.groups(parts, src.ptrs(), dst.ptrs(), src.capacity, dst.capacity,
                               staging)
        mori_tp.send_kvcache_groups(groups, backend="host")
        self.assertEqual(dst.snapshot(), want, f"{label}: direct send")

        infos, total = mori_tp.groups_info(groups)
        local, remote, sizes = mori_tp.groups_segments(groups)
        self.assertEqual(len(sizes), total.num_segments)
        first = src_off = dst_off = 0
        for group, info in zip(groups, infos):
            own = mori_tp.pair_segments(group.config, group.request, group.staging)
            span = slice(info.first_segment, info.first_segment + info.num_segments)
            self.assertEqual(info.first_segment, first, label)
            self.assertEqual((local[span], remote[span], sizes[span]), own, label)
            length = mori_tp.pair_staging_len(group.config, group.request.num_tokens)
            self.assertEqual(info.staging_len, length, label)
            self.assertEqual(info.src_staging_offset, src_off if staged_src(group.staging) else 0)
            self.assertEqual(info.dst_staging_offset, dst_off if staged_dst(group.staging) else 0)
            src_off += length * group.num_buffers if staged_src(group.staging) else 0
            dst_off += length * group.num_buffers if staged_dst(group.staging) else 0
            first += info.num_segments
        self.assertEqual((total.src_staging_bytes, total.dst_staging_bytes), (src_off, dst_off))
        mori_tp.check_groups_transfer(groups, src_staging_capacity=src_off,
                                      dst_staging_capacity=dst_off)

        dst.reset()
        src_region = (ctypes.c_ubyte * max(src_off, 1))()
        dst_region = (ctypes.c_ubyte * max(dst_off, 1))()
        mori_tp.pack_kvcache_groups(groups, ctypes.addressof(src_region),
                                    staging_capacity=src_off, backend="host")
        transport(groups, bytearray(src_region), dst_region, dst, parts, src)
        mori_tp.unpack_kvcache_groups(groups, ctypes.addressof(dst_region),
                                      staging_capacity=dst_off, backend="host")
        got = dst.snapshot()
        wrong = [p.name for p in parts
                 if any(got[p.set][b] != want[p.set][b] for b in p.dst_buffers)]
        self.assertEqual(wrong, [], f"{label}: pack, segments and unpack")

    def test_every_kind_of_group_moves_byte_exact_in_one_request(self):
        moved = set()
        for m, model in enumerate(MODELS):
            layers = range(len(model.kinds))
            for p_tp, d_tp in TP_PAIRS:
                for p in range(p_tp):
                    for d in range(d_tp):
                        seed = m * 1000 + p_tp * 100 + p * 10 + d
                        parts, src, dst = request_of(model, p_tp, p, layers, d_tp, d, layers,
                                                     seed)
                        label = f"model {m} TP {p_tp} -> {d_tp} ({p}, {d})"
                        self.check_request(parts, src, dst, f"{label}, the library's modes")
                        self.check_request(parts, src, dst, f"{label}, BOTH",
                                           lambda i, c: Staging.BOTH)
                        rng = random.Random(seed)
                        modes = [rng.choice(list(Staging)) for _ in parts]
                        self.check_request(parts, src, dst, f"{label}, mixed",
                                           lambda i, c: modes[i])
                        moved.update(part.name for part in parts
                                     if part.config().action is mori_tp.Action.SEND)
        self.assertEqual(len(moved), 8, moved)

    def test_prefill_pp_2_to_decode_pp_1_moves_every_layer_once(self):
        model = MODELS[0]
        prefill, decode = [4, 2], [6]
        p_tp, d_tp = 2, 4
        for d in range(d_tp):
            decode_layers = list(range(6))
            dst = Memory(model.set_shapes(1, d_tp, decode_layers), 50 + d)
            want = dst.snapshot()
            pages = model.request_pages(d)
            for stage in range(2):
                shared = mori_tp.pp_layers(prefill, decode, stage, 0)
                stage_layers = [layer for layer, _, _ in shared.layers()]
                self.assertEqual(stage_layers, list(range(sum(prefill[:stage]),
                                                          sum(prefill[:stage + 1]))))
                for p in range(p_tp):
                    parts = model.parts(pages, p_tp, p, stage_layers, d_tp, d, decode_layers)
                    src = Memory(model.set_shapes(0, p_tp, stage_layers), 10 * stage + p)
                    hybrid.oracle(parts, {n: [bytes(b) for b in bs]
                                          for n, bs in src.sets.items()}, want)
                    groups = hybrid.groups(parts, src.ptrs(), dst.ptrs(), src.capacity,
                                           dst.capacity)
                    mori_tp.send_kvcache_groups(groups, backend="host")
            self.assertEqual(dst.snapshot(), want, f"decode rank {d}")
            # Every decode buffer of every layer changed: both stages reached it.
            for name, buffers in dst.snapshot().items():
                for b, data in enumerate(buffers):
                    self.assertNotEqual(data, dst.initial[name][b], f"{name} buffer {b}")

    def test_refusals_name_the_group_and_write_nothing(self):
        model = MODELS[0]
        layers = range(len(model.kinds))
        parts, src, dst = request_of(model, 2, 1, layers, 4, 3, layers, 7)
        groups = hybrid.groups(parts, src.ptrs(), dst.ptrs(), src.capacity, dst.capacity)
        window = next(i for i, p in enumerate(parts) if p.name.startswith("sliding"))

        def refused(edited, error, message):
            with self.assertRaises(error) as caught:
                mori_tp.send_kvcache_groups(edited, backend="host")
            self.assertIn(message, str(caught.exception))
            self.assertEqual(dst.snapshot(), dst.initial)

        off = dataclasses.replace(groups[window], first_token=groups[window].first_token + 16)
        edited = list(groups)
        edited[window] = off
        refused(edited, mori_tp.InvalidArgumentError,
                f"mori_tp_groups_send: invalid argument: group {window}: first_token "
                f"{off.first_token} is not a multiple of both page sizes (prefill page_size 16, "
                f"decode page_size 32): a window starts on a page of each side; round it down "
                f"to {off.first_token // 32 * 32}, a multiple of 32")
        edited = list(groups)
        edited[2] = dataclasses.replace(groups[2], staging=7)
        refused(edited, mori_tp.InvalidArgumentError,
                "invalid argument: group 2: staging 7 is not a MoriTpStaging")
        edited = list(groups)
        last = len(groups) - 1
        edited[last] = dataclasses.replace(groups[last], dst_ptrs=None)
        refused(edited, mori_tp.NullPointerError,
                f"null pointer: group {last}: decode side: the group's buffer pointers are not "
                "given")
        edited = list(groups)
        edited[0] = dataclasses.replace(groups[0], dst_capacity=100)
        refused(edited, mori_tp.OutOfBoundsError, "out of bounds: group 0: decode side: page")
        # A staging region too small for the groups that stage the decode side.
        _, total = mori_tp.groups_info(groups)
        region = (ctypes.c_ubyte * total.dst_staging_bytes)()
        if total.dst_staging_bytes:
            with self.assertRaises(mori_tp.BufferTooSmallError) as caught:
                mori_tp.unpack_kvcache_groups(groups, ctypes.addressof(region),
                                              staging_capacity=total.dst_staging_bytes - 1,
                                              backend="host")
            self.assertIn(f"decode side: staging_capacity {total.dst_staging_bytes - 1} is below "
                          f"the {total.dst_staging_bytes} bytes", str(caught.exception))
        self.assertEqual(dst.snapshot(), dst.initial)
        # What Python checks itself: a pointer list that is not num_buffers long.
        with self.assertRaises(mori_tp.InvalidArgumentError) as caught:
            mori_tp.Group(groups[0].config, groups[0].request, num_buffers=3, src_ptrs=[1, 2])
        self.assertIn("src_ptrs has 2 entries for num_buffers 3", str(caught.exception))
        with self.assertRaises(TypeError):
            mori_tp.Group(groups[0].config, groups[0].request)
        with self.assertRaises(TypeError):
            mori_tp.groups_info([groups[0], "not a group"])

    @unittest.skipIf(np is None, "numpy is not installed")
    def test_numpy_segments_equal_the_lists(self):
        model = MODELS[1]
        layers = range(len(model.kinds))
        parts, src, dst = request_of(model, 4, 2, layers, 2, 1, layers, 3)
        groups = hybrid.groups(parts, None, None, src.capacity, dst.capacity)
        lists = mori_tp.groups_segments(groups)
        arrays = mori_tp.groups_segments(groups, as_arrays=True)
        for column, array in zip(lists, arrays):
            self.assertEqual(array.dtype, np.uint64)
            self.assertEqual(array.tolist(), column)

    @unittest.skipIf(np is None, "numpy is not installed")
    def test_mori_io_writes_a_request_of_groups_one_entry_per_group_buffer(self):
        """MORI-IO (a recording stand-in that copies) takes a GroupsPlan: one batch entry per
        buffer of each group that moves, each in the registered region holding it, and the
        request lands byte for byte after unpack, for every staging mode."""
        from engine_fakes import FakeMoriIo
        from engine_fakes import FakeMemoryDesc
        from mori_tp.engines import KvMemory, TransferError, plan_groups, unpack_groups
        from mori_tp.engines.mori_io import MoriIoTransport

        model = MODELS[1]
        layers = range(len(model.kinds))
        parts, src, dst = request_of(model, 4, 2, layers, 2, 1, layers, 11)
        for label, staging in (("the library's modes", None),
                               ("BOTH", lambda i, c: Staging.BOTH)):
            want = expected(parts, src, dst)
            dst.reset()
            groups = hybrid.groups(parts, src.ptrs(), dst.ptrs(), src.capacity, dst.capacity,
                                   staging)
            _, total = mori_tp.groups_info(groups)
            src_region = (ctypes.c_ubyte * max(total.src_staging_bytes, 1))()
            dst_region = (ctypes.c_ubyte * max(total.dst_staging_bytes, 1))()
            sender = MoriIoTransport(FakeMoriIo("prefill-engine"), location="CPU")
            receiver = MoriIoTransport(FakeMoriIo("decode-engine"), location="CPU")
            remote_descs = []
            for memory, region, transport in ((src, src_region, sender),
                                              (dst, dst_region, receiver)):
                descs = transport.register_descs(KvMemory((), 0, ctypes.addressof(region),
                                                          len(region)))
                for name, buffers in memory.sets.items():
                    descs += transport.register_descs(KvMemory(
                        tuple(ctypes.addressof(x) for x in buffers), memory.capacity[name]))
                remote_descs = descs
            sender.add_remote_memory("decode-engine", remote_descs)
            plan = plan_groups(groups, local_staging=ctypes.addressof(src_region),
                               local_staging_capacity=total.src_staging_bytes,
                               remote_staging=ctypes.addressof(dst_region),
                               remote_staging_capacity=total.dst_staging_bytes)
            result = sender.send("decode-engine", plan, backend="host")
            unpack_groups(groups, staging=ctypes.addressof(dst_region),
                          staging_capacity=total.dst_staging_bytes, backend="host")
            self.assertEqual(dst.snapshot(), want, label)
            batch = [args for name, args in sender.engine.calls if name == "batch_write"]
            self.assertEqual(len(batch), 1, label)
            spans = plan.buffer_spans()
            entries = batch[0][4]
            self.assertEqual(len(entries), len(spans), label)
            self.assertEqual(len(result.transfer_ids), len(spans), label)
            self.assertEqual(sum(len(sizes) for sizes in entries), plan.segments, label)
            self.assertEqual(sum(sum(sizes) for sizes in entries), plan.bytes, label)
            # Groups without their own buffers in the stand-in's regions are refused, typed.
            lonely = MoriIoTransport(FakeMoriIo("lonely"), location="CPU")
            lonely.add_remote_memory("decode-engine", [FakeMemoryDesc("d", 1, 1, -1, "CPU")])
            with self.assertRaisesRegex(TransferError,
                                        "local group \\d+ buffer 0 \\[0x"):
                lonely.send("decode-engine", plan, backend="host")

    def test_an_empty_request_plans_nothing(self):
        self.assertEqual(mori_tp.groups_info([]), ([], mori_tp.GroupsTotal(0, 0, 0, 0, 0)))
        self.assertEqual(mori_tp.groups_segments([]), ([], [], []))
        mori_tp.send_kvcache_groups([], backend="host")


class PipelineTest(unittest.TestCase):
    def test_small_partitions_against_a_per_layer_oracle(self):
        def compositions(layers, stages):
            if stages == 1:
                return [[layers]]
            return [[first] + rest for first in range(1, layers - stages + 2)
                    for rest in compositions(layers - first, stages - 1)]

        checked = 0
        for layers in range(1, 6):
            partitions = [c for k in range(1, min(layers, 3) + 1) for c in compositions(layers, k)]
            for prefill in partitions:
                for decode in partitions:
                    owner_p = [(s, i) for s, n in enumerate(prefill) for i in range(n)]
                    owner_d = [(s, i) for s, n in enumerate(decode) for i in range(n)]
                    for p in range(len(prefill)):
                        for d in range(len(decode)):
                            want = [(layer, owner_p[layer][1], owner_d[layer][1])
                                    for layer in range(layers)
                                    if owner_p[layer][0] == p and owner_d[layer][0] == d]
                            got = mori_tp.pp_layers(prefill, decode, p, d)
                            self.assertEqual(got.layers(), want, (prefill, decode, p, d))
                            checked += 1
        self.assertGreater(checked, 1000)

    def test_refusals_name_the_partitions_and_the_numbers(self):
        cases = [
            (([4, 2], [3, 4], 0, 0), "the prefill pipeline partition [4, 2] holds 6 layers but "
                                     "the decode partition [3, 4] holds 7"),
            (([4, 0, 2], [6], 0, 0), "prefill side: stage 1 of the pipeline partition [4, 0, 2] "
                                     "holds no layer"),
            (([6], [3, 3], 0, 2), "decode side: pipeline stage 2 is out of range for 2 stages"),
            (([], [6], 0, 0), "prefill side: the pipeline partition is empty"),
        ]
        for args, message in cases:
            with self.assertRaises(mori_tp.InvalidArgumentError) as caught:
                mori_tp.pp_layers(*args)
            self.assertIn(message, str(caught.exception))
        with self.assertRaises(mori_tp.InvalidArgumentError):
            mori_tp.pp_layers([-1], [1], 0, 0)
        with self.assertRaises(TypeError):
            mori_tp.pp_layers([1.5], [1], 0, 0)


if __name__ == "__main__":
    unittest.main()
