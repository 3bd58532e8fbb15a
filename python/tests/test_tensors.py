"""Tensors as buffers: numpy arrays, objects with ``__cuda_array_interface__`` and DLPack
producers, in send, pack and unpack and their pair and group variants.

On this machine they all lie over host memory, so the host backend moves real bytes through
every new path: numpy's own DLPack export, stand-ins that expose ``__cuda_array_interface__``
over a numpy array, and a DLPack producer written here (its capsules hold ctypes structs laid
out from dlpack.h) that can say any device, version, flag, stride or byte_offset. Every
destination byte is checked against an oracle built from the plan's segments. What reaches the
C call for device memory (addresses, capacities, the stream, the stream each producer was told)
is read by a stand-in for the C function, as test_transfer does. Every refusal is checked with
its class and message, and must leave the destination unchanged.
``python/tests/device_tensors.py`` runs the same cases with torch and CuPy on a GPU."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import subprocess
import sys
import unittest
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple
from unittest import mock

import mori_tp
from layouts import Layout, fragmented_request, tools_required
from mori_tp import Staging

try:
    import numpy as np
except ImportError as error:
    if tools_required():
        raise ImportError("numpy is missing but MORI_TP_REQUIRE_TOOLS is set") from error
    np = None

needs_numpy = unittest.skipIf(np is None, "numpy is not installed")


# --- DLPack structs from dlpack.h (v1.1), written independently of mori_tp's ---------------


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [("version", _Version), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _Tensor)]


_CAPSULE_NEW = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
# Capsule names must outlive their capsules: module constants.
_NAMES = {name: name for name in (b"dltensor", b"dltensor_versioned", b"used_dltensor")}

CPU, CUDA, ROCM, VULKAN, ROCM_HOST = 1, 2, 10, 7, 11
READ_ONLY, IS_COPIED = 1, 2


class FakeDLPack:
    """A DLPack producer over a numpy array's memory that describes it as told: device, DLPack
    version (None: the unversioned capsule), flags, byte_offset, shape, strides (elements),
    item bits. It records the ``stream`` of every export."""

    def __init__(self, array: "np.ndarray", *, device: Tuple[int, int] = (CPU, 0),
                 version: Optional[Tuple[int, int]] = (1, 0), flags: int = 0,
                 byte_offset: int = 0, shape: Optional[Tuple[int, ...]] = None,
                 strides: Optional[Tuple[int, ...]] = None, bits: int = 8,
                 capsule_name: Optional[bytes] = None,
                 capsule_device: Optional[Tuple[int, int]] = None) -> None:
        self.array = array
        self.device = device
        self.version = version
        self.flags = flags
        self.byte_offset = byte_offset
        self.bits = bits
        self.shape = shape if shape is not None else (
            (array.nbytes - byte_offset) * 8 // bits,)
        self.strides = strides
        self.capsule_name = capsule_name
        self.capsule_device = capsule_device or device
        self.streams: List[Any] = []
        self._keep: List[Any] = []

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self.device

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None,
                   copy: Any = None) -> Any:
        self.streams.append(stream)
        return self._capsule(versioned=self.version is not None and max_version is not None)

    def _capsule(self, versioned: bool) -> Any:
        shape = (ctypes.c_int64 * len(self.shape))(*self.shape)
        strides = None
        if self.strides is not None:
            strides = (ctypes.c_int64 * len(self.strides))(*self.strides)
        int64_p = ctypes.POINTER(ctypes.c_int64)
        tensor = _Tensor(self.array.ctypes.data, _Device(*self.capsule_device), len(self.shape),
                         _DataType(1, self.bits, 1), ctypes.cast(shape, int64_p),
                         None if strides is None else ctypes.cast(strides, int64_p),
                         self.byte_offset)
        if versioned:
            managed: Any = _ManagedVersioned(_Version(*self.version), None, None, self.flags,
                                             tensor)
            name = b"dltensor_versioned"
        else:
            managed = _Managed(tensor, None, None)
            name = b"dltensor"
        name = _NAMES[self.capsule_name or name]
        self._keep.append((shape, strides, managed))
        return _CAPSULE_NEW(ctypes.addressof(managed), name, None)


class OldFakeDLPack(FakeDLPack):
    """A producer from before the 2023.12 array API: ``__dlpack__(stream=None)`` only, and the
    unversioned capsule."""

    def __dlpack__(self, stream: Any = None) -> Any:  # type: ignore[override]
        self.streams.append(stream)
        return self._capsule(versioned=False)


class DLPackOnly:
    """numpy's own DLPack export, without numpy's type (so mori_tp cannot read it as numpy)."""

    def __init__(self, array: "np.ndarray") -> None:
        self.array = array
        self.calls: List[Dict[str, Any]] = []

    def __dlpack_device__(self) -> Any:
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self.array.__dlpack__(**kwargs)


class CaiArray:
    """``__cuda_array_interface__`` over a numpy array's memory (as CuPy exports it, version 3
    by default: strides None when C-contiguous, and a stream)."""

    def __init__(self, array: "np.ndarray", *, version: int = 3, stream: Any = None,
                 readonly: Optional[bool] = None, explicit_strides: bool = False,
                 shape: Optional[Tuple[int, ...]] = None, mask: Any = None,
                 typestr: Optional[str] = None) -> None:
        self.array = array
        interface = {
            "shape": tuple(array.shape) if shape is None else shape,
            "typestr": typestr or array.dtype.str,
            "data": (array.ctypes.data,
                     (not array.flags.writeable) if readonly is None else readonly),
            "version": version,
            "strides": (tuple(array.strides)
                        if explicit_strides or not array.flags.c_contiguous else None),
        }
        if mask is not None:
            interface["mask"] = mask
        if version >= 3:
            interface["stream"] = stream
        self.__cuda_array_interface__ = interface


class TorchStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class CupyStream:
    def __init__(self, handle: int) -> None:
        self.ptr = handle


class CudaPythonStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.handle)


# --- The requests, and the oracle --------------------------------------------------------------

LAYOUT = Layout(heads=8, p_tp=2, d_tp=4, page_size=4, bytes_per_head=8)
CONFIG = LAYOUT.config(1, 2)
REQUEST = fragmented_request(seed=30, runs=5)
SRC_LEN = REQUEST.src_capacity_pages * LAYOUT.src_item_len
DST_LEN = REQUEST.dst_capacity_pages * LAYOUT.dst_item_len
BUFFERS = 3
STAGING_LEN = mori_tp.staging_len(CONFIG, len(REQUEST.src_pages))


def apply_segments(sources: List[bytes], destinations: List[bytearray],
                   segments: Tuple[List[int], List[int], List[int]],
                   src_base: Callable[[int], int] = lambda b: 0,
                   dst_base: Callable[[int], int] = lambda b: 0) -> None:
    for b, (source, destination) in enumerate(zip(sources, destinations)):
        for local, remote, size in zip(*segments):
            s, d = src_base(b) + local, dst_base(b) + remote
            destination[d:d + size] = source[s:s + size]


def sources(seed: int, count: int = BUFFERS, length: int = SRC_LEN) -> List["np.ndarray"]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(count)]


def destinations(count: int = BUFFERS, length: int = DST_LEN) -> List["np.ndarray"]:
    return [np.full(length, 0xEE, dtype=np.uint8) for _ in range(count)]


def expected_send(srcs: List["np.ndarray"], dsts: List["np.ndarray"]) -> List[bytes]:
    want = [bytearray(d.tobytes()) for d in dsts]
    apply_segments([s.tobytes() for s in srcs], want,
                   mori_tp.plan_segments(CONFIG, REQUEST.src_pages, REQUEST.dst_pages))
    return [bytes(w) for w in want]


def bytes_of(arrays: List["np.ndarray"]) -> List[bytes]:
    return [a.tobytes() for a in arrays]


#: Each way of handing a host buffer as a tensor; all must move the same bytes.
WRAPPERS: Dict[str, Callable[["np.ndarray"], Any]] = {
    "numpy array": lambda a: a,
    "CAI v3, strides None, no stream": lambda a: CaiArray(a),
    "CAI v2": lambda a: CaiArray(a, version=2),
    "CAI v3, explicit C strides, float16 rows": lambda a: CaiArray(
        a.view(np.float16).reshape(-1, 4), explicit_strides=True),
    "CAI v0 float64": lambda a: CaiArray(a.view(np.float64), version=0),
    "numpy's DLPack": DLPackOnly,
    "numpy's DLPack, 2-D int32": lambda a: DLPackOnly(a.view(np.int32).reshape(-1, 2)),
    "DLPack 1.0 capsule": FakeDLPack,
    "unversioned DLPack capsule": lambda a: FakeDLPack(a, version=None),
    "producer before DLPack 1.0": OldFakeDLPack,
    "DLPack 16-bit 2-D, C strides given": lambda a: FakeDLPack(
        a, bits=16, shape=(a.nbytes // 8, 4), strides=(4, 1)),
    "DLPack CUDA pinned host": lambda a: FakeDLPack(a, device=(3, 0)),
    "DLPack ROCm pinned host": lambda a: FakeDLPack(a, device=(ROCM_HOST, 0)),
    "DLPack CUDA managed": lambda a: FakeDLPack(a, device=(13, 0)),
}


def capture(function: str, call: Callable[[], None]) -> List[Tuple[Any, ...]]:
    """Runs ``call`` with a stand-in for the C function ``function`` that records its
    arguments as they are during the call (the arrays behind pointers die with it)."""
    calls: List[Tuple[Any, ...]] = []

    def fake(*args: Any) -> int:
        recorded = []
        for arg in args:
            obj = getattr(arg, "_obj", arg)
            if isinstance(obj, mori_tp._ffi.MoriKvBuffers):
                n = obj.num_buffers
                obj = ([obj.src[i] for i in range(n)], [obj.dst[i] for i in range(n)],
                       obj.src_capacity, obj.dst_capacity)
            elif isinstance(obj, mori_tp._ffi.MoriSendOptions):
                obj = (obj.backend, obj.flags, obj.stream)
            recorded.append(obj)
        calls.append(tuple(recorded))
        return 0

    fake_lib = mock.Mock(wraps=mori_tp._lib)
    setattr(fake_lib, function, fake)
    # The pair and group modules hold their own reference to the library.
    with mock.patch.object(mori_tp._core, "_lib", fake_lib), \
            mock.patch.object(mori_tp._pair, "_lib", fake_lib), \
            mock.patch.object(mori_tp._groups, "_lib", fake_lib):
        call()
    return calls


@needs_numpy
class TensorsMoveBytesTest(unittest.TestCase):
    """Every kind of tensor, host backend, every byte."""

    def assertSent(self, wrap: Callable[["np.ndarray"], Any], **options: Any) -> None:
        srcs, dsts = sources(1), destinations()
        want = expected_send(srcs, dsts)
        before = bytes_of(srcs)
        mori_tp.send_kvcache(CONFIG, [wrap(s) for s in srcs], [wrap(d) for d in dsts],
                             src_pages=REQUEST.src_pages, dst_pages=REQUEST.dst_pages,
                             backend="host", **options)
        self.assertEqual(bytes_of(dsts), want)
        self.assertNotEqual(want, bytes_of(destinations()), "the request moves bytes")
        self.assertEqual(bytes_of(srcs), before)

    def test_send_with_every_kind_of_tensor_and_default_capacities(self):
        for name, wrap in WRAPPERS.items():
            with self.subTest(name):
                self.assertSent(wrap)

    def test_tensors_and_addresses_mix_with_explicit_capacities(self):
        srcs, dsts = sources(2), destinations()
        want = expected_send(srcs, dsts)
        mori_tp.send_kvcache(
            CONFIG, [srcs[0], CaiArray(srcs[1]), srcs[2].ctypes.data],
            [FakeDLPack(dsts[0]), dsts[1].ctypes.data, DLPackOnly(dsts[2])],
            src_capacity=SRC_LEN, dst_capacity=DST_LEN - 1,
            src_pages=REQUEST.src_pages, dst_pages=REQUEST.dst_pages, backend="host")
        self.assertEqual(bytes_of(dsts), want)

    def test_a_read_only_source_is_read(self):
        srcs, dsts = sources(3), destinations()
        want = expected_send(srcs, dsts)
        for s in srcs:
            s.flags.writeable = False
        mori_tp.send_kvcache(
            CONFIG, [srcs[0], CaiArray(srcs[1]), FakeDLPack(srcs[2], flags=READ_ONLY)],
            [DLPackOnly(d) for d in dsts],
            src_pages=REQUEST.src_pages, dst_pages=REQUEST.dst_pages, backend="host")
        self.assertEqual(bytes_of(dsts), want)

    def test_byte_offset_is_added_to_the_data_pointer(self):
        # Each buffer starts 24 bytes into its allocation; the producer says so in byte_offset
        # alone (data is the allocation's start).
        offset = 24
        srcs = sources(4, length=SRC_LEN + offset)
        dsts = destinations(length=DST_LEN + offset)
        want = expected_send([s[offset:] for s in srcs], [d[offset:] for d in dsts])
        mori_tp.send_kvcache(CONFIG, [FakeDLPack(s, byte_offset=offset) for s in srcs],
                             [FakeDLPack(d, byte_offset=offset, version=None) for d in dsts],
                             src_pages=REQUEST.src_pages, dst_pages=REQUEST.dst_pages,
                             backend="host")
        self.assertEqual([d[offset:].tobytes() for d in dsts], want)
        self.assertEqual([d[:offset].tobytes() for d in dsts], [b"\xee" * offset] * BUFFERS)

    def test_pack_and_unpack_through_a_tensor_staging_region(self):
        needed = BUFFERS * STAGING_LEN
        for name, wrap in WRAPPERS.items():
            with self.subTest(name):
                srcs, dsts = sources(5), destinations()
                want = expected_send(srcs, dsts)
                region = np.zeros(needed, dtype=np.uint8)
                mori_tp.pack_kvcache(CONFIG, [wrap(s) for s in srcs], wrap(region),
                                     src_pages=REQUEST.src_pages, backend="host")
                self.assertGreater(int(np.count_nonzero(region)), 0)
                mori_tp.unpack_kvcache(CONFIG, wrap(region), [wrap(d) for d in dsts],
                                       dst_pages=REQUEST.dst_pages, backend="host")
                self.assertEqual(bytes_of(dsts), want)

    def test_pair_send_pack_and_unpack_with_tensors(self):
        prefill = mori_tp.Layout.hnd(8, 2, 0, page_size=16, head_bytes=16)
        decode = mori_tp.Layout.nhd(8, 4, 1, page_size=64, head_bytes=16)
        pair = mori_tp.pair_config(prefill, decode)
        request = mori_tp.Request([5, 0, 2, 3, 9, 7, 1], [1, 0], 100)  # partial last pages
        src_len, dst_len = 10 * prefill.page_stride, 2 * decode.page_stride
        srcs, dsts = sources(6, length=src_len), destinations(length=dst_len)
        want = [bytearray(d.tobytes()) for d in dsts]
        apply_segments(bytes_of(srcs), want, mori_tp.pair_segments(pair, request))
        mori_tp.send_kvcache_pair(pair, [CaiArray(s) for s in srcs], [DLPackOnly(d) for d in dsts],
                                  request=request, backend="host")
        self.assertEqual(bytes_of(dsts), [bytes(w) for w in want])
        for mode in (Staging.SRC, Staging.DST, Staging.BOTH):
            with self.subTest(mode=mode.name):
                length = mori_tp.pair_staging_len(pair, request.num_tokens)
                region = FakeDLPack(np.zeros(BUFFERS * length, dtype=np.uint8))
                landed = destinations(length=dst_len)
                # The transport's part: the segments between the region and the pages.
                local, remote, sizes = mori_tp.pair_segments(pair, request, mode)
                staged_src = np.zeros(BUFFERS * length, dtype=np.uint8)
                if mode.packs:
                    mori_tp.pack_kvcache_pair(pair, mode, [FakeDLPack(s) for s in srcs],
                                              CaiArray(staged_src), request=request,
                                              backend="host")
                source = [staged_src[b * length:(b + 1) * length] if mode.packs else srcs[b]
                          for b in range(BUFFERS)]
                target = ([bytearray(length) for _ in range(BUFFERS)] if mode.unpacks
                          else [bytearray(d.tobytes()) for d in landed])
                apply_segments(bytes_of(source), target, (local, remote, sizes))
                if mode.unpacks:
                    region.array[:] = np.frombuffer(b"".join(target), dtype=np.uint8)
                    mori_tp.unpack_kvcache_pair(pair, mode, region, [CaiArray(d) for d in landed],
                                                request=request, backend="host")
                else:
                    for d, t in zip(landed, target):
                        d[:] = np.frombuffer(bytes(t), dtype=np.uint8)
                self.assertEqual(bytes_of(landed), bytes_of(dsts))

    def test_groups_take_tensors_keep_them_alive_and_move_every_byte(self):
        prefill = mori_tp.Layout.hnd(8, 2, 0, page_size=16, head_bytes=16)
        decode = mori_tp.Layout.hnd(8, 4, 1, page_size=16, head_bytes=16)
        pair = mori_tp.pair_config(prefill, decode)
        request = mori_tp.Request([3, 1, 2], [0, 2, 1], 40)
        src_len, dst_len = 4 * prefill.page_stride, 3 * decode.page_stride
        srcs, dsts = sources(7, length=src_len), destinations(length=dst_len)
        want = [bytearray(d.tobytes()) for d in dsts]
        apply_segments(bytes_of(srcs), want, mori_tp.pair_segments(pair, request))
        wrapped = [CaiArray(srcs[0]), DLPackOnly(srcs[1]), FakeDLPack(srcs[2])]
        watch = [weakref.ref(w) for w in wrapped]
        group = mori_tp.Group(pair, request, staging=Staging.BOTH, src_ptrs=wrapped,
                              dst_ptrs=[CaiArray(d) for d in dsts])
        del wrapped
        gc.collect()
        self.assertTrue(all(w() is not None for w in watch), "the group keeps its tensors")
        # The fields hold the addresses, as engines read them; capacities are the tensors'.
        self.assertEqual(group.src_ptrs, tuple(s.ctypes.data for s in srcs))
        self.assertEqual((group.src_capacity, group.dst_capacity), (src_len, dst_len))
        mori_tp.send_kvcache_groups([group], backend="host")
        self.assertEqual(bytes_of(dsts), [bytes(w) for w in want])
        # Through a staging region given as tensors on both sides.
        infos, total = mori_tp.groups_info([group])
        staged = np.zeros(total.src_staging_bytes, dtype=np.uint8)
        mori_tp.pack_kvcache_groups([group], FakeDLPack(staged), backend="host")
        landed = destinations(length=dst_len)
        receiving = mori_tp.Group(pair, request, staging=Staging.BOTH,
                                  dst_ptrs=[DLPackOnly(d) for d in landed])
        mori_tp.unpack_kvcache_groups([receiving], CaiArray(staged), backend="host")
        self.assertEqual(bytes_of(landed), bytes_of(dsts))


@needs_numpy
class RefusalsTest(unittest.TestCase):
    """Each refusal: its class, a message naming the values, and nothing written."""

    def setUp(self) -> None:
        self.srcs, self.dsts = sources(8), destinations()
        self.before = bytes_of(self.dsts)

    def send(self, src: Optional[List[Any]] = None, dst: Optional[List[Any]] = None,
             **options: Any) -> None:
        options.setdefault("backend", "host")
        mori_tp.send_kvcache(CONFIG, self.srcs if src is None else src,
                             self.dsts if dst is None else dst, src_pages=REQUEST.src_pages,
                             dst_pages=REQUEST.dst_pages, **options)

    def assertRefused(self, error: type, pattern: str, call: Callable[[], None]) -> None:
        with self.assertRaisesRegex(error, pattern):
            call()
        self.assertEqual(bytes_of(self.dsts), self.before, "a refused call writes nothing")

    def test_non_contiguous_tensors(self):
        strided = np.zeros(2 * DST_LEN, dtype=np.uint8)[::2]
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: dst_ptrs\[1\] is not C-contiguous: a __cuda_array_interface__ "
            rf"array of shape \({DST_LEN},\) and typestr '\|u1' has strides \(2,\) \(bytes\) "
            r"where a C-contiguous one has \(1,\)",
            lambda: self.send(dst=[self.dsts[0], CaiArray(strided), self.dsts[2]]))
        transposed = self.srcs[0].view(np.int32).reshape(-1, 4).T
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: src_ptrs\[0\] is not C-contiguous: a DLPack tensor in CPU memory "
            rf"\(device type 1, device 0\) of shape \(4, {SRC_LEN // 16}\) and 32-bit items has "
            rf"strides \(1, 4\) \(elements\) where a C-contiguous one has \({SRC_LEN // 16}, 1\)",
            lambda: self.send(src=[DLPackOnly(transposed)] + self.srcs[1:]))
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            rf"^send_kvcache: src_ptrs\[2\] is not C-contiguous: a numpy array of shape "
            rf"\({SRC_LEN},\) and dtype uint8 has strides \(2,\) \(bytes\) where a C-contiguous "
            r"one has \(1,\)",
            lambda: self.send(src=self.srcs[:2] + [np.zeros(2 * SRC_LEN, np.uint8)[::2]]))
        self.assertRefused(
            mori_tp.InvalidArgumentError, r"^pack_kvcache: staging is not C-contiguous",
            lambda: mori_tp.pack_kvcache(
                CONFIG, self.srcs, FakeDLPack(np.zeros(2 * BUFFERS * STAGING_LEN, np.uint8),
                                              shape=(BUFFERS * STAGING_LEN,), strides=(2,)),
                src_pages=REQUEST.src_pages, backend="host"))

    def test_dlpack_devices_the_backend_does_not_reach(self):
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: dst_ptrs\[0\] is a DLPack tensor in Vulkan memory \(device type 7, "
            r"device 0\); mori_tp copies host, CUDA and ROCm memory only \(DLPack device types "
            r"\[1, 2, 3, 10, 11, 13\]\)",
            lambda: self.send(dst=[FakeDLPack(self.dsts[0], device=(VULKAN, 0))] + self.dsts[1:],
                              backend="auto"))
        cases = [
            ("host", (CUDA, 1), "CUDA", "cuda"),
            ("host", (ROCM, 0), "ROCm", "hip"),
            ("hip", (CUDA, 0), "CUDA", "cuda"),
            ("hip", (13, 0), "CUDA managed", "cuda"),
        ]
        for backend, device, memory, fits in cases:
            with self.subTest(backend=backend, device=device):
                producer = FakeDLPack(self.srcs[1], device=device)
                self.assertRefused(
                    mori_tp.InvalidArgumentError,
                    rf"^send_kvcache: src_ptrs\[1\] is a DLPack tensor in {memory} memory "
                    rf"\(device type {device[0]}, device {device[1]}\), which backend "
                    rf"'{backend}' cannot reach; use backend='{fits}' or 'auto'",
                    lambda: self.send(src=[self.srcs[0], producer, self.srcs[2]],
                                      backend=backend))
                self.assertEqual(producer.streams, [], "refused before the export")
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"dst_ptrs\[2\]: its DLPack tensor is on device \(2, 0\) but __dlpack_device__\(\) "
            r"said \(1, 0\)",
            lambda: self.send(dst=self.dsts[:2] + [FakeDLPack(self.dsts[2],
                                                              capsule_device=(CUDA, 0))]))

    def test_read_only_destinations(self):
        readonly = self.dsts[0].copy()
        readonly.flags.writeable = False
        address = self.dsts[1].ctypes.data
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            rf"^send_kvcache: dst_ptrs\[1\] is read-only \(a __cuda_array_interface__ array of "
            rf"shape \({DST_LEN},\) and typestr '\|u1'; its data is \({address:#x}, True\)\), "
            "and this call writes it",
            lambda: self.send(dst=[self.dsts[0], CaiArray(self.dsts[1], readonly=True),
                                   self.dsts[2]]))
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: dst_ptrs\[2\] is read-only \(a DLPack tensor in CPU memory .*; "
            "DLPack flag READ_ONLY\\), and this call writes it",
            lambda: self.send(dst=self.dsts[:2] + [FakeDLPack(self.dsts[2], flags=READ_ONLY)]))
        # numpy's own export of a read-only array carries the flag (DLPack 1.0).
        self.assertRefused(
            mori_tp.InvalidArgumentError, r"dst_ptrs\[0\] is read-only .*DLPack flag READ_ONLY",
            lambda: self.send(dst=[DLPackOnly(readonly)] + self.dsts[1:]))
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: dst_ptrs\[0\] is read-only \(a numpy array of shape .*; "
            "flags.writeable is False\\)",
            lambda: self.send(dst=[readonly] + self.dsts[1:]))
        self.assertRefused(
            mori_tp.InvalidArgumentError, r"^pack_kvcache: staging is read-only",
            lambda: mori_tp.pack_kvcache(
                CONFIG, self.srcs, CaiArray(np.zeros(BUFFERS * STAGING_LEN, np.uint8),
                                            readonly=True),
                src_pages=REQUEST.src_pages, backend="host"))
        self.assertRefused(
            mori_tp.InvalidArgumentError, r"^Group: dst_ptrs\[0\] is read-only",
            lambda: mori_tp.Group(*_group_pair(), dst_ptrs=[CaiArray(self.dsts[0],
                                                                     readonly=True)]))

    def test_capacities_tensors_do_not_have(self):
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            rf"^send_kvcache: src_capacity {SRC_LEN + 1} exceeds src_ptrs\[0\]'s {SRC_LEN} "
            r"bytes \(a __cuda_array_interface__ array",
            lambda: self.send(src=[CaiArray(s) for s in self.srcs], src_capacity=SRC_LEN + 1))
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            rf"^send_kvcache: dst_capacity {DST_LEN} exceeds dst_ptrs\[1\]'s {DST_LEN - 8} "
            r"bytes \(a DLPack tensor",
            lambda: self.send(dst=[self.dsts[0], FakeDLPack(self.dsts[1][:-8]), self.dsts[2]],
                              dst_capacity=DST_LEN))
        # By default the capacity is the smallest tensor's: a page past it is out of bounds.
        end = (max(REQUEST.dst_pages) + 1) * LAYOUT.dst_item_len
        short = self.dsts[2][:end - 1]
        self.assertRefused(
            mori_tp.OutOfBoundsError,
            rf"^mori_tp_kvcache_send: .*dst_capacity {end - 1}",
            lambda: self.send(dst=self.dsts[:2] + [CaiArray(short)]))
        # A staging tensor smaller than the request: the library names both sizes.
        small = np.zeros(BUFFERS * STAGING_LEN - 1, dtype=np.uint8)
        self.assertRefused(
            mori_tp.BufferTooSmallError,
            rf"^mori_tp_kvcache_pack: .*{BUFFERS * STAGING_LEN - 1}.*{BUFFERS * STAGING_LEN}|"
            rf"^mori_tp_kvcache_pack: .*{BUFFERS * STAGING_LEN}.*{BUFFERS * STAGING_LEN - 1}",
            lambda: mori_tp.pack_kvcache(CONFIG, self.srcs, DLPackOnly(small),
                                         src_pages=REQUEST.src_pages, backend="host"))
        self.assertEqual(int(np.count_nonzero(small)), 0)
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            rf"^unpack_kvcache: staging_capacity {BUFFERS * STAGING_LEN} exceeds staging's "
            rf"{BUFFERS * STAGING_LEN - 1} bytes",
            lambda: mori_tp.unpack_kvcache(CONFIG, CaiArray(small), self.dsts,
                                           staging_capacity=BUFFERS * STAGING_LEN,
                                           dst_pages=REQUEST.dst_pages, backend="host"))
        self.assertRefused(
            TypeError, r"^send_kvcache: src_capacity is required when src_ptrs\[1\] is an address",
            lambda: self.send(src=[self.srcs[0], self.srcs[1].ctypes.data, self.srcs[2]]))
        pair, request = _group_pair()
        with self.assertRaisesRegex(
                mori_tp.InvalidArgumentError,
                r"^Group: src_capacity 99999 exceeds src_ptrs\[0\]'s 64 bytes"):
            mori_tp.Group(pair, request, src_ptrs=[np.zeros(64, np.uint8)], src_capacity=99999)

    def test_dlpack_exports_that_cannot_be_used(self):
        cases = [
            (dict(flags=IS_COPIED), r"dst_ptrs\[0\]: the producer exported a copy .*IS_COPIED"),
            (dict(version=(2, 0)), r"dst_ptrs\[0\]: a DLPack 2\.0 tensor; mori_tp reads DLPack "
                                   r"1\.x"),
            (dict(capsule_name=b"used_dltensor"), r"dst_ptrs\[0\]: __dlpack__ returned a capsule "
                                                  r"named b'used_dltensor'"),
            (dict(bits=0, shape=(16,)), r"dst_ptrs\[0\]: .*an item of 0 bits has no size"),
        ]
        for fields, pattern in cases:
            with self.subTest(fields):
                self.assertRefused(
                    mori_tp.InvalidArgumentError, "^send_kvcache: " + pattern,
                    lambda: self.send(dst=[FakeDLPack(self.dsts[0], **fields)] + self.dsts[1:]))

        class Refusing(FakeDLPack):
            def __dlpack__(self, **kwargs: Any) -> Any:
                raise BufferError("cannot export this one")

        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: src_ptrs\[0\]: __dlpack__\(stream=None\) refused the export: "
            "BufferError: cannot export this one",
            lambda: self.send(src=[Refusing(self.srcs[0])] + self.srcs[1:]))

    def test_other_objects_and_a_single_tensor_for_a_list(self):
        self.assertRefused(
            TypeError, r"^send_kvcache: dst_ptrs\[0\] must be an address \(int\), a numpy "
                       "array, or a tensor with __dlpack__ or __cuda_array_interface__, not str",
            lambda: self.send(dst=["0x1000"] + self.dsts[1:]))
        self.assertRefused(
            TypeError, r"^send_kvcache: dst_ptrs must be a sequence of buffers \(one per layer's "
                       r"K or V\), not a single CaiArray; wrap it in a list",
            lambda: self.send(src=[self.srcs[0]], dst=CaiArray(self.dsts[0])))
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: dst_ptrs\[0\]'s __cuda_array_interface__ has a mask",
            lambda: self.send(dst=[CaiArray(self.dsts[0], mask=self.dsts[0])] + self.dsts[1:]))
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: dst_ptrs\[0\]'s __cuda_array_interface__: typestr 'float' is not",
            lambda: self.send(dst=[CaiArray(self.dsts[0], typestr="float")] + self.dsts[1:]))

    def test_streams_of_other_kinds(self):
        self.assertRefused(TypeError, "^send_kvcache: stream must be an int handle",
                           lambda: self.send(stream=object()))
        self.assertRefused(
            TypeError, r"^send_kvcache: stream: the object's __cuda_array_interface__ \(version "
                       r"2\) carries no stream",
            lambda: self.send(stream=CaiArray(self.srcs[0], version=2)))
        # CAI streams that disagree, with no stream= to settle it.
        self.assertRefused(
            mori_tp.InvalidArgumentError,
            r"^send_kvcache: the buffers' __cuda_array_interface__ carry different streams "
            r"\(src_ptrs\[0\] stream 0x5000, dst_ptrs\[1\] stream 0x0; .*pass stream=",
            lambda: self.send(src=[CaiArray(self.srcs[0], stream=0x5000)] + self.srcs[1:],
                              dst=[self.dsts[0], CaiArray(self.dsts[1], stream=1),
                                   self.dsts[2]], backend="auto"))

    def test_the_host_backend_ignores_the_interfaces_streams_but_not_stream(self):
        srcs = [CaiArray(s, stream=0x5000) for s in self.srcs]
        want = expected_send(self.srcs, self.dsts)
        self.send(src=srcs)
        self.assertEqual(bytes_of(self.dsts), want)
        self.before = want
        self.assertRefused(mori_tp.InvalidArgumentError, "host backend",
                           lambda: self.send(src=srcs, stream=TorchStream(0x7000)))


def _group_pair() -> Tuple[mori_tp.PairConfig, mori_tp.Request]:
    layout = mori_tp.Layout.nhd(8, 2, 0, page_size=1, head_bytes=16)
    return mori_tp.pair_config(layout, layout), mori_tp.Request([0], [0], 1)


@needs_numpy
class WhatReachesTheCallTest(unittest.TestCase):
    """Device tensors (described over host memory, never dereferenced here): the addresses,
    capacities, backend and stream the C function gets, and the stream each DLPack producer was
    asked to order its work before."""

    def send(self, src: List[Any], dst: List[Any], **options: Any) -> Tuple[Any, ...]:
        calls = capture("mori_tp_kvcache_send", lambda: mori_tp.send_kvcache(
            CONFIG, src, dst, src_pages=[0], dst_pages=[0], **options))
        self.assertEqual(len(calls), 1)
        config, buffers, src_pages, dst_pages, num_pages, c_options = calls[0]
        return buffers, c_options

    def test_cuda_tensors_reach_the_cuda_backend_with_their_addresses_and_sizes(self):
        a, b = np.zeros(4096, np.uint8), np.zeros(8192, np.uint8)
        src = [FakeDLPack(a, device=(CUDA, 0), byte_offset=256), CaiArray(b, version=2)]
        dst = [FakeDLPack(b, device=(CUDA, 0)), FakeDLPack(a, device=(CUDA, 0), bits=16)]
        buffers, options = self.send(src, dst, backend="cuda", synchronize=True)
        self.assertEqual(buffers, ([a.ctypes.data + 256, b.ctypes.data],
                                   [b.ctypes.data, a.ctypes.data], 4096 - 256, 4096))
        self.assertEqual(options, (mori_tp._BACKENDS.get("cuda", 3), 1, None))
        # No stream anywhere: the null stream, which CUDA's DLPack spells 1 (legacy default).
        self.assertEqual(src[0].streams + dst[0].streams + dst[1].streams, [1, 1, 1])

    def test_copy_kernel_picks_the_copy_path_flag(self):
        a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        src, dst = [FakeDLPack(a, device=(CUDA, 0))], [FakeDLPack(b, device=(CUDA, 0))]
        ffi = mori_tp._ffi
        for choice, flags in [(None, 0), (True, ffi.MORI_SEND_COPY_KERNEL),
                              (False, ffi.MORI_SEND_MEMCPY2D)]:
            with self.subTest(copy_kernel=choice):
                _, options = self.send(src, dst, backend="cuda", copy_kernel=choice,
                                       synchronize=True)
                self.assertEqual(options[1], ffi.MORI_SEND_SYNCHRONIZE | flags)
        with self.assertRaisesRegex(TypeError, "copy_kernel must be None, True or False"):
            self.send(src, dst, backend="cuda", copy_kernel=1)

    def test_max_blocks_is_the_sm_budget_in_the_flags_high_bits(self):
        a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        src, dst = [FakeDLPack(a, device=(CUDA, 0))], [FakeDLPack(b, device=(CUDA, 0))]
        ffi = mori_tp._ffi
        for blocks in [None, 1, 8, ffi.MORI_SEND_MAX_BLOCKS_LIMIT]:
            with self.subTest(max_blocks=blocks):
                _, options = self.send(src, dst, backend="cuda", copy_kernel=True,
                                       max_blocks=blocks)
                budget = (blocks or 0) << ffi.MORI_SEND_MAX_BLOCKS_SHIFT
                self.assertEqual(options[1], ffi.MORI_SEND_COPY_KERNEL | budget)
        for bad in [0, -1, ffi.MORI_SEND_MAX_BLOCKS_LIMIT + 1]:
            with self.subTest(max_blocks=bad):
                with self.assertRaisesRegex(mori_tp.InvalidArgumentError,
                                            f"max_blocks {bad} is outside 1..65535"):
                    self.send(src, dst, backend="cuda", max_blocks=bad)
        with self.assertRaisesRegex(TypeError, "max_blocks must be None or an int"):
            self.send(src, dst, backend="cuda", max_blocks=2.0)

    def test_stream_wins_over_the_interfaces_and_is_told_to_every_producer(self):
        a = np.zeros(4096, np.uint8)
        for stream, handle in [(0xABC0, 0xABC0), (TorchStream(0xABC8), 0xABC8),
                               (CupyStream(0xABD0), 0xABD0), (CudaPythonStream(0xABD8), 0xABD8),
                               (CaiArray(a, stream=0xABE0), 0xABE0), (np.uint64(0xABE8), 0xABE8)]:
            with self.subTest(stream=type(stream).__name__):
                cuda, rocm = FakeDLPack(a, device=(CUDA, 0)), FakeDLPack(a, device=(ROCM, 0))
                host = FakeDLPack(a)
                _, options = self.send([cuda, CaiArray(a, stream=0x5000)], [rocm, host],
                                       stream=stream)
                self.assertEqual(options[2], handle)
                self.assertEqual((cuda.streams, rocm.streams, host.streams),
                                 ([handle], [handle], [None]))

    def test_without_stream_the_interfaces_stream_is_used(self):
        a = np.zeros(4096, np.uint8)
        cases = [(0x5000, 0x5000, 0x5000), (1, None, 1), (2, 2, 2), (None, None, 1)]
        for carried, passed, told in cases:
            with self.subTest(carried=carried):
                cuda = FakeDLPack(a, device=(CUDA, 0))
                _, options = self.send([CaiArray(a, stream=carried), cuda],
                                       [CaiArray(a, stream=carried), CaiArray(a, version=2)])
                self.assertEqual(options[2], passed)
                self.assertEqual(cuda.streams, [told])
        # On ROCm the default stream is 0 for DLPack.
        rocm = FakeDLPack(a, device=(ROCM, 0))
        _, options = self.send([rocm], [a], backend="hip")
        self.assertEqual((options, rocm.streams), ((2, 0, None), [0]))

    def test_a_producer_that_speaks_dlpack_and_cai_is_read_through_dlpack(self):
        a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)

        class Both(FakeDLPack):
            # A CAI that points elsewhere: if it were read, the address would be b's.
            __cuda_array_interface__ = {"data": (b.ctypes.data, False), "shape": (4096,),
                                        "typestr": "|u1", "version": 3, "strides": None,
                                        "stream": 0x9000}

        both = Both(a, device=(CUDA, 0))
        buffers, options = self.send([both], [a], backend="auto")
        self.assertEqual((buffers[0], options[2], both.streams), ([a.ctypes.data], None, [1]))

    def test_numpy_dlpack_is_asked_for_version_1_without_copies(self):
        a = np.zeros(64, np.uint8)
        wrapped = DLPackOnly(a)
        self.send([wrapped], [a], backend="host")
        self.assertEqual(wrapped.calls, [{"stream": None, "max_version": (1, 0), "copy": False}])

    def test_group_tensors_take_part_in_the_stream_and_device_checks(self):
        pair, request = _group_pair()
        a = np.zeros(256, np.uint8)
        group = mori_tp.Group(pair, request, src_ptrs=[CaiArray(a, stream=0x6000)],
                              dst_ptrs=[FakeDLPack(a, device=(CUDA, 0))])
        calls = capture("mori_tp_groups_send",
                        lambda: mori_tp.send_kvcache_groups([group], backend="cuda"))
        self.assertEqual(calls[0][-1], (mori_tp._BACKENDS.get("cuda", 3), 0, 0x6000))
        with self.assertRaisesRegex(
                mori_tp.InvalidArgumentError,
                r"^send_kvcache_groups: group 0 dst_ptrs\[0\] is a DLPack tensor in CUDA memory "
                r"\(device type 2, device 0\), which backend 'host' cannot reach"):
            mori_tp.send_kvcache_groups([group], backend="host")
        other = mori_tp.Group(pair, request, src_ptrs=[CaiArray(a, stream=0x7000)],
                              dst_ptrs=[a])
        with self.assertRaisesRegex(
                mori_tp.InvalidArgumentError,
                r"group 0 src_ptrs\[0\] stream 0x6000, group 1 src_ptrs\[0\] stream 0x7000"):
            mori_tp.send_kvcache_groups([group, other], backend="auto")


@needs_numpy
class DeviceScriptOnTheHostTest(unittest.TestCase):
    """python/tests/device_tensors.py, the GPU check, run with numpy arrays and the host
    backend: its cases, its oracle and its command line work where no GPU is."""

    SCRIPT = Path(__file__).resolve().parent / "device_tensors.py"

    def run_script(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, MORI_TP_LIBRARY=mori_tp.library_path,
                   PYTHONPATH=str(Path(mori_tp.__file__).resolve().parents[1]))
        env.pop("MORI_TP_REQUIRE_TOOLS", None)
        return subprocess.run([sys.executable, str(self.SCRIPT), *args], env=env,
                              capture_output=True, text=True, timeout=300)

    def test_every_case_passes_on_host_memory(self):
        result = self.run_script("--frameworks", "numpy", "--backend", "host", "--timeout",
                                 "240")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result.stdout.splitlines()
        self.assertEqual(sum(line.startswith("PASS numpy: ") for line in lines), 8, lines)
        self.assertEqual(sum(line.startswith("SKIP numpy: ") for line in lines), 3, lines)
        self.assertIn("device_tensors: 8 passed, 0 failed, 0 frameworks skipped", lines)

    def test_a_missing_framework_skips_or_fails_when_required(self):
        if importlib.util.find_spec("torch") is not None:
            self.skipTest("torch is installed here")
        result = self.run_script("--frameworks", "torch", "--backend", "auto")
        self.assertEqual(result.returncode, 77, result.stdout + result.stderr)
        self.assertIn("SKIP torch: torch is not installed", result.stdout)
        result = self.run_script("--frameworks", "torch", "--backend", "auto", "--require")
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
