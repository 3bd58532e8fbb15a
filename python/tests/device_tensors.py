"""Device tensors through mori_tp's Python API, on a GPU: torch and CuPy tensors as the buffers,
staging regions and streams of send, pack and unpack and their pair and group variants, every
destination byte checked against a host reference.

    MORI_TP_LIBRARY=target/release/libmori_tp.so PYTHONPATH=python \\
        python3 python/tests/device_tensors.py [--frameworks torch,cupy] [--backend cuda]
                                               [--device 0] [--timeout 300] [--require]

The library must be built with the GPU backend (``cargo build --release --features cuda`` for
NVIDIA GPUs; ``--backend hip`` with ``--features hip`` on AMD GPUs). For each framework it
runs, with tensors on the device:

- ``send``: send_kvcache of a slice config (TP 2 -> 4, 8 KV heads of 256 bytes as bf16 or
  fp16 tensors of shape (pages, page_size, heads, head_dim), pages of 16, fragmented), per rect
  and with the copy kernel;
- ``pack/unpack``: through a device staging tensor, per rect and with the copy kernel;
- ``pair``: HND pages of 16 to NHD pages of 64 with a partial last page, send_kvcache_pair and
  pack/unpack in BOTH through device staging tensors;
- ``groups``: a KV group and a state-slot group, send_kvcache_groups, and pack/unpack of both
  staged (BOTH);
- ``streams``: ``stream=`` as the framework's stream object and as an int, without
  synchronize (the script waits on the stream); no ``stream=`` with the data written on a side
  stream (the DLPack export orders it before the null stream); a tensor seen only through its
  ``__cuda_array_interface__`` (CuPy's carries its stream);
- ``refusals``: a non-contiguous tensor, a device tensor with the host backend, a capacity
  larger than a tensor, a staging tensor too small: each refused with its class and message,
  the destination unchanged.

Every byte of every destination buffer (untouched bytes included) must equal what a host
oracle built from the plan's segments leaves in a copy of it. It prints one line per case
(``PASS``, ``FAIL`` with the first wrong byte, or ``SKIP`` with the reason) and a summary.

``--frameworks numpy --backend host`` runs the same cases on host memory with numpy arrays and
the host backend (``python/tests/test_tensors.py`` runs it so, to keep this script working
where no GPU is).

Exit status: 0 every case passed; 1 a case failed, or ``--timeout`` seconds passed (the stacks
are printed); 77 skipped: a framework or the GPU is missing (a failure with ``--require`` or
``MORI_TP_REQUIRE_TOOLS=1``); 2 a usage error.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import mori_tp
from mori_tp import Staging

SKIPPED = 77
BUFFERS = 4  # K and V of two layers


class Skip(Exception):
    """The case does not apply here (the reason is printed)."""


# --- The frameworks: how to put bytes on the device and read them back ----------------------


class Numpy:
    """Host arrays and the host backend: the cases' own check where no GPU is."""

    name = "numpy"
    has_streams = False

    def upload(self, data: np.ndarray, shape: Tuple[int, ...], half: bool = False) -> Any:
        array = data.copy()
        return (array.view(np.float16) if half else array).reshape(shape)

    def download(self, tensor: Any) -> bytes:
        return np.ascontiguousarray(tensor).tobytes()

    def zeros(self, nbytes: int) -> Any:
        return np.zeros(nbytes, dtype=np.uint8)

    def copy(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def synchronize(self) -> None:
        pass

    def transposed(self, tensor: Any) -> Any:
        return tensor.swapaxes(0, 1)

    def cai_only(self, tensor: Any) -> Any:
        return _CaiOnly(tensor, {
            "data": (tensor.ctypes.data, False), "shape": tensor.shape,
            "typestr": tensor.dtype.str, "strides": None, "version": 3, "stream": None})


class Torch:
    name = "torch"
    has_streams = True

    def __init__(self, device: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise Skip("torch sees no GPU (torch.cuda.is_available() is False)")
        self.torch = torch
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)

    def upload(self, data: np.ndarray, shape: Tuple[int, ...], half: bool = False) -> Any:
        tensor = self.torch.from_numpy(data.copy()).to(self.device)
        if half:
            tensor = tensor.view(self.torch.bfloat16)
        return tensor.reshape(shape)

    def download(self, tensor: Any) -> bytes:
        flat = tensor.contiguous().reshape(-1).view(self.torch.uint8)
        return flat.cpu().numpy().tobytes()

    def zeros(self, nbytes: int) -> Any:
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, device=self.device)

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def transposed(self, tensor: Any) -> Any:
        return tensor.transpose(0, 1)

    def stream(self) -> Any:
        return self.torch.cuda.Stream(device=self.device)

    def using(self, stream: Any) -> Any:
        return self.torch.cuda.stream(stream)

    def handle(self, stream: Any) -> int:
        return stream.cuda_stream

    def cai_only(self, tensor: Any) -> Any:
        return _CaiOnly(tensor, tensor.__cuda_array_interface__)


class Cupy:
    name = "cupy"
    has_streams = True

    def __init__(self, device: int) -> None:
        import cupy

        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # no driver, no device
            raise Skip(f"CuPy sees no GPU ({error})") from None
        if count <= device:
            raise Skip(f"CuPy sees {count} GPUs, not device {device}")
        self.cupy = cupy
        cupy.cuda.Device(device).use()

    def upload(self, data: np.ndarray, shape: Tuple[int, ...], half: bool = False) -> Any:
        array = self.cupy.asarray(data.copy())
        if half:
            array = array.view(self.cupy.float16)
        return array.reshape(shape)

    def download(self, tensor: Any) -> bytes:
        flat = self.cupy.ascontiguousarray(tensor).reshape(-1).view(self.cupy.uint8)
        return self.cupy.asnumpy(flat).tobytes()

    def zeros(self, nbytes: int) -> Any:
        return self.cupy.zeros(nbytes, dtype=self.cupy.uint8)

    def copy(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def synchronize(self) -> None:
        self.cupy.cuda.Device().synchronize()

    def transposed(self, tensor: Any) -> Any:
        return tensor.swapaxes(0, 1)

    def stream(self) -> Any:
        return self.cupy.cuda.Stream(non_blocking=True)

    def using(self, stream: Any) -> Any:
        return stream

    def handle(self, stream: Any) -> int:
        return stream.ptr

    def cai_only(self, tensor: Any) -> Any:
        return _CaiOnly(tensor, tensor.__cuda_array_interface__)


class _CaiOnly:
    """A tensor seen only through its ``__cuda_array_interface__`` (no DLPack), as read at
    wrapping time (CuPy's carries the stream current then)."""

    def __init__(self, tensor: Any, interface: Dict[str, Any]) -> None:
        self.tensor = tensor
        self.__cuda_array_interface__ = dict(interface)


# --- The requests and the host oracle ---------------------------------------------------------

HEADS, HEAD_BYTES, PAGE = 8, 256, 16
P_TP, P_RANK, D_TP, D_RANK = 2, 1, 4, 2
SRC_HEADS, DST_HEADS = HEADS // P_TP, HEADS // D_TP
CAPACITY_PAGES = 64
CONFIG = mori_tp.slice_config(
    prefill_tp_size=P_TP, prefill_tp_rank=P_RANK, decode_tp_size=D_TP, decode_tp_rank=D_RANK,
    total_kv_heads=HEADS, page_size=PAGE, src_item_len=PAGE * SRC_HEADS * HEAD_BYTES,
    dst_item_len=PAGE * DST_HEADS * HEAD_BYTES)
_rng = np.random.default_rng(30)
SRC_PAGES = [int(p) for p in _rng.permutation(CAPACITY_PAGES)[:40]]
DST_PAGES = [int(p) for p in _rng.permutation(CAPACITY_PAGES)[:40]]
SRC_SHAPE = (CAPACITY_PAGES, PAGE, SRC_HEADS, HEAD_BYTES // 2)  # bf16 / fp16 head_dim 128
DST_SHAPE = (CAPACITY_PAGES, PAGE, DST_HEADS, HEAD_BYTES // 2)

PREFILL = mori_tp.Layout.hnd(HEADS, P_TP, P_RANK, page_size=16, head_bytes=HEAD_BYTES)
DECODE = mori_tp.Layout.nhd(HEADS, D_TP, D_RANK, page_size=64, head_bytes=HEAD_BYTES)
PAIR = mori_tp.pair_config(PREFILL, DECODE)
PAIR_TOKENS = 37 * 16 + 5  # partial last pages on both sides
PAIR_REQUEST = mori_tp.Request([int(p) for p in _rng.permutation(48)[:38]],
                               [int(p) for p in _rng.permutation(12)[:10]], PAIR_TOKENS)
PAIR_SRC_LEN, PAIR_DST_LEN = 48 * PREFILL.page_stride, 12 * DECODE.page_stride

# A state slot part: 4 local heads of 128 bytes at 256 bytes into a 4096-byte slot, to 2 heads.
SLOT_SRC = mori_tp.Layout(total_kv_heads=8, tp_size=2, tp_rank=1, page_size=1, head_bytes=128,
                          page_stride=4096, offset=256, token_stride=512, head_stride=128)
SLOT_DST = mori_tp.Layout(total_kv_heads=8, tp_size=4, tp_rank=2, page_size=1, head_bytes=128,
                          page_stride=4096, offset=0, token_stride=256, head_stride=128)
SLOT_PAIR = mori_tp.pair_config(SLOT_SRC, SLOT_DST)
SLOT_REQUEST = mori_tp.Request([5], [2], 1)
SLOTS = 8


def noise(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sentinel(seed: int, nbytes: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint64) * 31 + seed * 7).astype(np.uint8) ^ 0xA5


def oracle(sources: Sequence[bytes], destinations: Sequence[bytes],
           segments: Tuple[Any, Any, Any]) -> List[bytes]:
    """Each destination after copying every segment from its source (offsets from each
    buffer's base)."""
    out = []
    for source, destination in zip(sources, destinations):
        buffer = bytearray(destination)
        for local, remote, size in zip(*segments):
            buffer[remote:remote + size] = source[local:local + size]
        out.append(bytes(buffer))
    return out


def compare(got: Sequence[bytes], want: Sequence[bytes], what: str) -> int:
    """The bytes checked; raises AssertionError naming the first wrong byte."""
    checked = 0
    for index, (g, w) in enumerate(zip(got, want)):
        if g != w:
            if len(g) != len(w):
                raise AssertionError(f"{what} {index}: {len(g)} bytes, expected {len(w)}")
            at = next(i for i, (x, y) in enumerate(zip(g, w)) if x != y)
            raise AssertionError(f"{what} {index}: first wrong byte at {at} "
                                 f"(got {g[at]:#04x}, expected {w[at]:#04x})")
        checked += len(g)
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} {what}s, expected {len(want)}")
    return checked


# --- The cases ---------------------------------------------------------------------------------


class Cases:
    def __init__(self, fw: Any, backend: str) -> None:
        self.fw = fw
        self.backend = backend
        #: Said after the case's PASS line.
        self.note = ""

    def kv(self, seed: int, half: bool = True
           ) -> Tuple[List[np.ndarray], List[np.ndarray], List[Any], List[Any]]:
        """Host sources and destinations, and their device copies (16-bit tensors of shape
        (pages, page_size, heads, head_dim), or bytes)."""
        src_len = int(np.prod(SRC_SHAPE)) * 2
        dst_len = int(np.prod(DST_SHAPE)) * 2
        srcs = [noise(seed + b, src_len) for b in range(BUFFERS)]
        dsts = [sentinel(seed + b, dst_len) for b in range(BUFFERS)]
        src_shape = SRC_SHAPE if half else (src_len,)
        dst_shape = DST_SHAPE if half else (dst_len,)
        return (srcs, dsts, [self.fw.upload(s, src_shape, half=half) for s in srcs],
                [self.fw.upload(d, dst_shape, half=half) for d in dsts])

    def want_send(self, srcs: List[np.ndarray], dsts: List[np.ndarray]) -> List[bytes]:
        return oracle([s.tobytes() for s in srcs], [d.tobytes() for d in dsts],
                      mori_tp.plan_segments(CONFIG, SRC_PAGES, DST_PAGES))

    def check(self, tensors: Sequence[Any], want: Sequence[bytes], what: str = "buffer") -> int:
        self.fw.synchronize()
        return compare([self.fw.download(t) for t in tensors], want, what)

    def send(self, copy_kernel: bool) -> int:
        srcs, dsts, d_srcs, d_dsts = self.kv(1)
        mori_tp.send_kvcache(CONFIG, d_srcs, d_dsts, src_pages=SRC_PAGES, dst_pages=DST_PAGES,
                             backend=self.backend, synchronize=True, copy_kernel=copy_kernel)
        return self.check(d_dsts, self.want_send(srcs, dsts))

    def pack_unpack(self, copy_kernel: bool) -> int:
        srcs, dsts, d_srcs, d_dsts = self.kv(2)
        region = self.fw.zeros(BUFFERS * mori_tp.staging_len(CONFIG, len(SRC_PAGES)))
        mori_tp.pack_kvcache(CONFIG, d_srcs, region, src_pages=SRC_PAGES, backend=self.backend,
                             synchronize=True, copy_kernel=copy_kernel)
        mori_tp.unpack_kvcache(CONFIG, region, d_dsts, dst_pages=DST_PAGES,
                               backend=self.backend, synchronize=True, copy_kernel=copy_kernel)
        return self.check(d_dsts, self.want_send(srcs, dsts))

    def pair(self) -> int:
        srcs = [noise(10 + b, PAIR_SRC_LEN) for b in range(BUFFERS)]
        dsts = [sentinel(10 + b, PAIR_DST_LEN) for b in range(BUFFERS)]
        want = oracle([s.tobytes() for s in srcs], [d.tobytes() for d in dsts],
                      mori_tp.pair_segments(PAIR, PAIR_REQUEST))
        d_srcs = [self.fw.upload(s, (PAIR_SRC_LEN,)) for s in srcs]
        d_dsts = [self.fw.upload(d, (PAIR_DST_LEN,)) for d in dsts]
        mori_tp.send_kvcache_pair(PAIR, d_srcs, d_dsts, request=PAIR_REQUEST,
                                  backend=self.backend, synchronize=True)
        checked = self.check(d_dsts, want)
        # BOTH: pack on the prefill side, the engine's one segment per buffer (the whole
        # region), unpack on the decode side.
        length = BUFFERS * mori_tp.pair_staging_len(PAIR, PAIR_TOKENS)
        prefill_region, decode_region = self.fw.zeros(length), self.fw.zeros(length)
        landed = [self.fw.upload(d, (PAIR_DST_LEN,)) for d in dsts]
        mori_tp.pack_kvcache_pair(PAIR, Staging.BOTH, d_srcs, prefill_region,
                                  request=PAIR_REQUEST, backend=self.backend, synchronize=True)
        self.fw.copy(decode_region, prefill_region)
        self.fw.synchronize()
        mori_tp.unpack_kvcache_pair(PAIR, Staging.BOTH, decode_region, landed,
                                    request=PAIR_REQUEST, backend=self.backend,
                                    synchronize=True)
        return checked + self.check(landed, want)

    def groups(self) -> int:
        srcs = [noise(20 + b, PAIR_SRC_LEN) for b in range(BUFFERS)]
        dsts = [sentinel(20 + b, PAIR_DST_LEN) for b in range(BUFFERS)]
        slots_src, slots_dst = noise(30, SLOTS * 4096), sentinel(30, SLOTS * 4096)
        want = oracle([s.tobytes() for s in srcs], [d.tobytes() for d in dsts],
                      mori_tp.pair_segments(PAIR, PAIR_REQUEST))
        want += oracle([slots_src.tobytes()], [slots_dst.tobytes()],
                       mori_tp.pair_segments(SLOT_PAIR, SLOT_REQUEST))

        def make(staging: Staging) -> Tuple[List[Any], List[mori_tp.Group]]:
            d_dsts = [self.fw.upload(d, (PAIR_DST_LEN,)) for d in dsts]
            d_slots = self.fw.upload(slots_dst, (SLOTS, 4096))
            groups = [
                mori_tp.Group(PAIR, PAIR_REQUEST, staging=staging,
                              src_ptrs=[self.fw.upload(s, (PAIR_SRC_LEN,)) for s in srcs],
                              dst_ptrs=d_dsts),
                mori_tp.Group(SLOT_PAIR, SLOT_REQUEST, staging=staging,
                              src_ptrs=[self.fw.upload(slots_src, (SLOTS, 4096))],
                              dst_ptrs=[d_slots]),
            ]
            return d_dsts + [d_slots], groups

        landed, groups = make(Staging.NONE)
        self.fw.synchronize()  # the uploads, before copies on the null stream
        mori_tp.send_kvcache_groups(groups, backend=self.backend, synchronize=True)
        checked = self.check(landed, want)
        landed, groups = make(Staging.BOTH)
        _, total = mori_tp.groups_info(groups)
        prefill_region = self.fw.zeros(total.src_staging_bytes)
        decode_region = self.fw.zeros(total.dst_staging_bytes)
        self.fw.synchronize()
        mori_tp.pack_kvcache_groups(groups, prefill_region, backend=self.backend,
                                    synchronize=True)
        self.fw.copy(decode_region, prefill_region)
        self.fw.synchronize()
        mori_tp.unpack_kvcache_groups(groups, decode_region, backend=self.backend,
                                      synchronize=True)
        return checked + self.check(landed, want)

    def stream_object(self, as_int: bool) -> int:
        if not self.fw.has_streams:
            raise Skip("the host backend takes no stream")
        stream = self.fw.stream()
        with self.fw.using(stream):
            srcs, dsts, d_srcs, d_dsts = self.kv(3)
        given = self.fw.handle(stream) if as_int else stream
        mori_tp.send_kvcache(CONFIG, d_srcs, d_dsts, src_pages=SRC_PAGES, dst_pages=DST_PAGES,
                             backend=self.backend, stream=given)
        stream.synchronize()
        return self.check(d_dsts, self.want_send(srcs, dsts))

    def side_stream_without_stream(self) -> int:
        """Data written on a side stream, no stream= and no synchronize: the DLPack export
        (for the null stream) must order the side stream's work before the copies."""
        if not self.fw.has_streams:
            raise Skip("the host backend takes no stream")
        stream = self.fw.stream()
        srcs, dsts, d_srcs, d_dsts = self.kv(4)
        self.fw.synchronize()
        with self.fw.using(stream):
            # Rewrite the sources on the side stream: the copies must see the new bytes.
            fresh = [noise(40 + b, len(s)) for b, s in enumerate(srcs)]
            for d_src, data in zip(d_srcs, fresh):
                self.fw.copy(d_src, self.fw.upload(data, SRC_SHAPE, half=True))
            mori_tp.send_kvcache(CONFIG, d_srcs, d_dsts, src_pages=SRC_PAGES,
                                 dst_pages=DST_PAGES, backend=self.backend)
        return self.check(d_dsts, self.want_send(fresh, dsts))

    def cai_only(self) -> int:
        """Byte tensors seen only through ``__cuda_array_interface__``. CuPy's carries the
        stream current when it is read (here a side stream, which the call then runs on);
        torch's carries none (the null stream: the data is written before)."""
        stream = self.fw.stream() if self.fw.name == "cupy" else None
        with self.fw.using(stream) if stream is not None else _Nothing():
            srcs, dsts, d_srcs, d_dsts = self.kv(5, half=False)
            cai_srcs = [self.fw.cai_only(t) for t in d_srcs]
            cai_dsts = [self.fw.cai_only(t) for t in d_dsts]
        if stream is None:
            self.fw.synchronize()
        carried = cai_srcs[0].__cuda_array_interface__.get("stream")
        mori_tp.send_kvcache(CONFIG, cai_srcs, cai_dsts, src_pages=SRC_PAGES,
                             dst_pages=DST_PAGES, backend=self.backend)
        if stream is not None:
            stream.synchronize()
        self.note = f"the interface's stream {carried!r}"
        return self.check(d_dsts, self.want_send(srcs, dsts))

    def refusals(self) -> int:
        srcs, dsts, d_srcs, d_dsts = self.kv(6)
        self.fw.synchronize()
        before = [self.fw.download(t) for t in d_dsts]
        region_len = BUFFERS * mori_tp.staging_len(CONFIG, len(SRC_PAGES))
        cases: List[Tuple[str, type, str, Callable[[], None]]] = [
            ("non-contiguous", mori_tp.InvalidArgumentError, "dst_ptrs[1] is not C-contiguous",
             lambda: self._send(d_srcs, [d_dsts[0], self.fw.transposed(d_dsts[1])]
                                + d_dsts[2:])),
            ("capacity over a tensor", mori_tp.InvalidArgumentError,
             f"src_capacity {len(srcs[0]) + 1} exceeds src_ptrs[0]'s {len(srcs[0])} bytes",
             lambda: self._send(d_srcs, d_dsts, src_capacity=len(srcs[0]) + 1)),
            ("staging too small", mori_tp.BufferTooSmallError, "mori_tp_kvcache_pack",
             lambda: mori_tp.pack_kvcache(CONFIG, d_srcs, self.fw.zeros(region_len - 1),
                                          src_pages=SRC_PAGES, backend=self.backend)),
        ]
        if self.backend != "host":
            cases.append(("device memory, host backend", mori_tp.InvalidArgumentError,
                          "which backend 'host' cannot reach",
                          lambda: self._send(d_srcs, d_dsts, backend="host")))
        for name, error, part, call in cases:
            try:
                call()
            except error as caught:
                if part not in str(caught):
                    raise AssertionError(f"{name}: {type(caught).__name__} without {part!r}: "
                                         f"{caught}") from None
            else:
                raise AssertionError(f"{name}: not refused (expected {error.__name__})")
        self.note = f"{len(cases)} refusals"
        return self.check(d_dsts, before)

    def _send(self, srcs: List[Any], dsts: List[Any], **options: Any) -> None:
        options.setdefault("backend", self.backend)
        mori_tp.send_kvcache(CONFIG, srcs, dsts, src_pages=SRC_PAGES, dst_pages=DST_PAGES,
                             synchronize=True, **options)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


CASES: List[Tuple[str, Callable[[Cases], int]]] = [
    ("send per rect", lambda c: c.send(False)),
    ("send copy kernel", lambda c: c.send(True)),
    ("pack/unpack per rect", lambda c: c.pack_unpack(False)),
    ("pack/unpack copy kernel", lambda c: c.pack_unpack(True)),
    ("pair hnd16->nhd64 partial, send and BOTH", lambda c: c.pair()),
    ("groups kv + state slot, send and BOTH", lambda c: c.groups()),
    ("stream= stream object", lambda c: c.stream_object(False)),
    ("stream= int handle", lambda c: c.stream_object(True)),
    ("side stream, no stream=", lambda c: c.side_stream_without_stream()),
    ("__cuda_array_interface__ only", lambda c: c.cai_only()),
    ("refusals", lambda c: c.refusals()),
]


def run_framework(name: str, backend: str, device: int) -> Tuple[int, int, Optional[str]]:
    """(passed, failed, skip reason) for one framework."""
    try:
        fw = {"numpy": lambda: Numpy(), "torch": lambda: Torch(device),
              "cupy": lambda: Cupy(device)}[name]()
    except ImportError as error:
        return 0, 0, f"{name} is not installed ({error})"
    except Skip as skip:
        return 0, 0, str(skip)
    passed = failed = 0
    for case_name, case in CASES:
        cases = Cases(fw, backend)
        start = time.perf_counter()
        try:
            checked = case(cases)
        except Skip as skip:
            print(f"SKIP {name}: {case_name}: {skip}", flush=True)
            continue
        except Exception as error:  # a mismatch or an unexpected refusal: report, go on
            failed += 1
            print(f"FAIL {name}: {case_name}: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc(file=sys.stdout)
            continue
        passed += 1
        note = f", {cases.note}" if cases.note else ""
        print(f"PASS {name}: {case_name}: {checked} bytes checked{note} "
              f"({(time.perf_counter() - start) * 1e3:.0f} ms)", flush=True)
    return passed, failed, None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="torch,cupy",
                        help="comma-separated: torch, cupy, numpy (default torch,cupy)")
    parser.add_argument("--backend", default="cuda",
                        help="mori_tp backend: cuda (default), hip, auto, host (numpy only)")
    parser.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before the run is stopped with its stacks (default 300)")
    parser.add_argument("--require", action="store_true",
                        help="a missing framework or GPU fails instead of skipping")
    args = parser.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in ("torch", "cupy", "numpy")]
    if unknown or not frameworks:
        parser.error(f"unknown frameworks {unknown}; choose from torch, cupy, numpy")
    if args.backend not in mori_tp._BACKENDS:
        print(f"FAIL setup: this mori_tp package has no backend {args.backend!r} (it has "
              f"{', '.join(mori_tp._BACKENDS)}); library {mori_tp.library_path}", flush=True)
        return 1
    if args.backend == "host" and frameworks != ["numpy"]:
        parser.error("the host backend copies host memory: use it with --frameworks numpy")
    require = args.require or os.environ.get("MORI_TP_REQUIRE_TOOLS", "") not in ("", "0")
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    print(f"device_tensors: backend {args.backend}, library {mori_tp.library_path}, "
          f"frameworks {', '.join(frameworks)}", flush=True)
    passed = failed = 0
    skipped = []
    for name in frameworks:
        p, f, skip = run_framework(name, args.backend, args.device)
        passed, failed = passed + p, failed + f
        if skip is not None:
            print(f"SKIP {name}: {skip}", flush=True)
            skipped.append(name)
    faulthandler.cancel_dump_traceback_later()
    print(f"device_tensors: {passed} passed, {failed} failed, "
          f"{len(skipped)} frameworks skipped", flush=True)
    if failed:
        return 1
    if skipped:
        return 1 if require else SKIPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
