"""Buffers given as tensors, and the stream a copying call runs on.

Nothing here is public: the copying functions of :mod:`mori_tp` (send, pack and unpack, and
their pair and group variants) take any of these wherever they take a buffer, and this module
turns each into the address and byte length the library takes:

- an int: a raw address (a ``hipStream_t``'s device pointer, ``tensor.data_ptr()``, host
  memory); its size is unknown, so the call needs a capacity with it;
- a numpy array: host memory, read through ``__array_interface__``;
- an object with ``__dlpack__`` and ``__dlpack_device__`` (torch, CuPy, JAX, numpy): exported
  with the call's stream, so that the producer orders its pending work before it, and read
  through the capsule's ``DLTensor`` (its data pointer plus ``byte_offset``);
- else an object with ``__cuda_array_interface__`` (versions 0 to 3): its data pointer, shape,
  strides and typestr, and its ``stream`` where it has one.

A tensor must be C-contiguous (the library addresses a buffer as ``base + offset``) and, where
it is written, writable; its byte length (the product of its shape times its item size) is the
capacity the call checks. A DLPack tensor must be in memory the backend reaches.

The stream: ``stream=`` when given (an int, or an object carrying one); else the stream the
buffers' ``__cuda_array_interface__`` carry (version 3), which must agree; else the null stream.
The host backend takes no stream, so it ignores the interfaces' streams.
"""

from __future__ import annotations

import ctypes
import operator
import re
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ._errors import InvalidArgumentError

try:  # numpy is optional: its arrays are read directly when it is installed.
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None  # type: ignore[assignment]

_U64_MAX = (1 << 64) - 1

# DLPack device types (DLDeviceType in dlpack.h), and the names messages use for them.
DL_CPU = 1
DL_CUDA = 2
DL_CUDA_HOST = 3
DL_ROCM = 10
DL_ROCM_HOST = 11
DL_CUDA_MANAGED = 13

DEVICE_NAMES = {
    1: "CPU",
    2: "CUDA",
    3: "CUDA pinned host",
    4: "OpenCL",
    7: "Vulkan",
    8: "Metal",
    9: "VPI",
    10: "ROCm",
    11: "ROCm pinned host",
    12: "ext_dev",
    13: "CUDA managed",
    14: "oneAPI",
    15: "WebGPU",
    16: "Hexagon",
    17: "MAIA",
}

#: The DLPack device types each backend reaches. Host memory (pageable or pinned) every backend
#: copies; HIP reaches ROCm device memory, CUDA CUDA device and managed memory, the host
#: backend (the CPU) managed memory but no device memory. AUTO picks one of them at run time.
BACKEND_DEVICES = {
    "auto": frozenset({DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_ROCM, DL_ROCM_HOST, DL_CUDA_MANAGED}),
    "host": frozenset({DL_CPU, DL_CUDA_HOST, DL_ROCM_HOST, DL_CUDA_MANAGED}),
    "hip": frozenset({DL_CPU, DL_CUDA_HOST, DL_ROCM, DL_ROCM_HOST}),
    "cuda": frozenset({DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_ROCM_HOST, DL_CUDA_MANAGED}),
}

# DLManagedTensorVersioned.flags bits.
DLPACK_FLAG_READ_ONLY = 1
DLPACK_FLAG_IS_COPIED = 2


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # in elements; NULL: C-contiguous
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    """The struct behind a capsule named ``dltensor`` (DLPack before 1.0)."""

    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """The struct behind a capsule named ``dltensor_versioned`` (DLPack 1.x)."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# Prototypes of our own (not ctypes.pythonapi's shared function objects, whose argtypes other
# code may set): they hold the GIL and raise the Python error a failing call sets.
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


class Buffer(NamedTuple):
    """One buffer of a call, resolved."""

    #: The address the library gets (a DLPack tensor's data plus its byte_offset).
    address: int
    #: Its bytes (shape times item size), or None for a raw address.
    nbytes: Optional[int]
    #: What it was, for messages.
    what: str
    #: The DLPack (device_type, device_id), or None where the object does not say.
    device: Optional[Tuple[int, int]]
    #: The stream its ``__cuda_array_interface__`` carries (0: the legacy default stream, that
    #: is the null stream), or None.
    stream: Optional[int]
    #: What keeps the memory alive for the call: the object and its DLPack capsule.
    owner: Any


class _Pending(NamedTuple):
    """A DLPack producer, exported once the call's stream is known."""

    obj: Any
    name: str
    writable: bool
    device: Tuple[int, int]


def _address(value: Any, name: str, where: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: {name} must be an int, not {type(value).__name__}") from None
    if not 0 <= number <= _U64_MAX:
        raise InvalidArgumentError(
            f"{where}: {name} {number} does not fit in uint64_t (0..{_U64_MAX})"
        )
    return number


def _raw(value: int, name: str, where: str) -> Buffer:
    return Buffer(_address(value, name, where), None, "an address", None, None, None)


def _product(values: Sequence[int]) -> int:
    total = 1
    for value in values:
        total *= value
    return total


def _contiguous_strides(shape: Sequence[int], strides: Optional[Sequence[int]],
                        unit: int) -> Optional[Tuple[int, ...]]:
    """None when ``strides`` (in multiples of ``unit``) are those of a C-contiguous array of
    ``shape`` (ignoring dimensions of extent 1, and any strides of an empty array); else the
    strides a C-contiguous array would have."""
    if strides is None or 0 in shape:
        return None
    expected = []
    step = unit
    for extent in reversed(shape):
        expected.append(step)
        step *= extent
    expected.reverse()
    if all(extent == 1 or got == want
           for extent, got, want in zip(shape, strides, expected)):
        return None
    return tuple(expected)


def _not_contiguous(where: str, name: str, what: str, strides: Sequence[int],
                    expected: Tuple[int, ...], unit: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{where}: {name} is not C-contiguous: {what} has strides {tuple(strides)} ({unit}) "
        f"where a C-contiguous one has {expected}; the library addresses a buffer as base + "
        "offset: pass a contiguous tensor (torch: .contiguous()), or its data pointer as an int "
        "with an explicit capacity"
    )


def _read_only(where: str, name: str, what: str, how: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{where}: {name} is read-only ({what}; {how}), and this call writes it"
    )


def _from_numpy(array: Any, name: str, writable: bool, where: str) -> Buffer:
    what = f"a numpy array of shape {tuple(array.shape)} and dtype {array.dtype}"
    if not array.flags.c_contiguous:
        expected = _contiguous_strides(array.shape, array.strides, array.itemsize)
        raise _not_contiguous(where, name, what, array.strides, expected or (), "bytes")
    if writable and not array.flags.writeable:
        raise _read_only(where, name, what, "flags.writeable is False")
    return Buffer(array.__array_interface__["data"][0], array.nbytes, what, None, None, array)


_TYPESTR = re.compile(r"[<>|=][a-zA-Z](\d+)(\[.*\])?")


def cai_stream(value: Any, name: str, where: str) -> Optional[int]:
    """A ``__cuda_array_interface__`` stream as a handle: None (none given, or 0, which version
    3 disallows), 0 for 1 (the legacy default stream, which is the null stream), else the
    value (2 is the per-thread default stream's handle)."""
    if value is None:
        return None
    number = _address(value, f"{name}'s __cuda_array_interface__ stream", where)
    if number == 0:
        return None
    return 0 if number == 1 else number


def _from_cai(obj: Any, cai: Any, name: str, writable: bool, where: str) -> Buffer:
    label = f"{where}: {name}'s __cuda_array_interface__"
    if not isinstance(cai, dict):
        raise TypeError(f"{label} is a {type(cai).__name__}, not a dict")
    for key in ("data", "shape", "typestr"):
        if key not in cai:
            raise InvalidArgumentError(f"{label} has no {key!r} entry (version "
                                       f"{cai.get('version')})")
    if cai.get("mask") is not None:
        raise InvalidArgumentError(f"{label} has a mask: a masked array is not a buffer")
    try:
        pointer, readonly = cai["data"]
        shape = tuple(operator.index(extent) for extent in cai["shape"])
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"{label}: data {cai['data']!r} is not (pointer, read-only) or shape "
            f"{cai['shape']!r} is not a tuple of ints"
        ) from None
    typestr = cai["typestr"]
    match = _TYPESTR.fullmatch(typestr) if isinstance(typestr, str) else None
    if match is None:
        raise InvalidArgumentError(f"{label}: typestr {typestr!r} is not a numpy typestr")
    itemsize = int(match.group(1))
    what = (f"a __cuda_array_interface__ array of shape {shape} and typestr {typestr!r}")
    strides = cai.get("strides")
    if strides is not None:
        strides = tuple(operator.index(stride) for stride in strides)
        expected = _contiguous_strides(shape, strides, itemsize)
        if expected is not None:
            raise _not_contiguous(where, name, what, strides, expected, "bytes")
    if writable and readonly:
        raise _read_only(where, name, what, f"its data is ({pointer or 0:#x}, True)")
    stream = cai_stream(cai.get("stream"), name, where)
    address = _address(pointer or 0, f"{name}'s data pointer", where)
    return Buffer(address, _product(shape) * itemsize, what, None, stream, obj)


def _cai(obj: Any, name: str, where: str) -> Any:
    """``obj.__cuda_array_interface__``, or None when it has none."""
    try:
        return obj.__cuda_array_interface__
    except AttributeError:
        return None
    except Exception as error:  # a producer refusing (torch: a tensor that requires grad)
        raise InvalidArgumentError(
            f"{where}: {name}: reading its __cuda_array_interface__ failed: "
            f"{type(error).__name__}: {error}"
        ) from error


def device_name(device_type: int) -> str:
    return DEVICE_NAMES.get(device_type, "unknown")


def _check_device(device: Tuple[int, int], name: str, backend: str, where: str) -> None:
    """Refuses a DLPack device the backend does not reach, naming the values."""
    device_type, device_id = device
    if device_type in BACKEND_DEVICES.get(backend, BACKEND_DEVICES["auto"]):
        return
    where_it_is = (f"{name} is a DLPack tensor in {device_name(device_type)} memory (device "
                   f"type {device_type}, device {device_id})")
    if device_type not in BACKEND_DEVICES["auto"]:
        raise InvalidArgumentError(
            f"{where}: {where_it_is}; mori_tp copies host, CUDA and ROCm memory only (DLPack "
            f"device types {sorted(BACKEND_DEVICES['auto'])})"
        )
    fits = "cuda" if device_type in (DL_CUDA, DL_CUDA_MANAGED) else "hip"
    raise InvalidArgumentError(
        f"{where}: {where_it_is}, which backend {backend!r} cannot reach; use "
        f"backend={fits!r} or 'auto'"
    )


def _classify(obj: Any, name: str, writable: bool, where: str) -> Any:
    """A :class:`Buffer`, or a :class:`_Pending` DLPack producer."""
    if type(obj) is int:
        return _raw(obj, name, where)
    if isinstance(obj, bool):
        raise TypeError(f"{where}: {name} must be an address or a tensor, not a bool")
    if _np is not None:
        if isinstance(obj, _np.integer):
            return _raw(obj, name, where)
        if isinstance(obj, _np.ndarray):
            if obj.ndim == 0 and obj.dtype.kind in "iu":
                return _raw(obj, name, where)  # an address held in a 0-d array
            return _from_numpy(obj, name, writable, where)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        try:
            device_type, device_id = obj.__dlpack_device__()
            device = (int(device_type), int(device_id))
        except Exception as error:
            raise InvalidArgumentError(
                f"{where}: {name}: __dlpack_device__() failed: {type(error).__name__}: {error}"
            ) from error
        return _Pending(obj, name, writable, device)
    cai = _cai(obj, name, where)
    if cai is not None:
        return _from_cai(obj, cai, name, writable, where)
    try:
        operator.index(obj)
    except TypeError:
        raise TypeError(
            f"{where}: {name} must be an address (int), a numpy array, or a tensor with "
            f"__dlpack__ or __cuda_array_interface__, not {type(obj).__name__}"
        ) from None
    return _raw(obj, name, where)


def _dlpack_stream(device_type: int, stream: int) -> Optional[int]:
    """The ``stream`` argument of ``__dlpack__`` for the call's stream (0: the null stream):
    the producer makes that stream wait for its pending work. CUDA spells the legacy default
    stream 1 (0 is disallowed), ROCm 0; host memory takes None."""
    if device_type in (DL_CUDA, DL_CUDA_MANAGED):
        return stream if stream else 1
    if device_type == DL_ROCM:
        return stream
    return None


def _call_dlpack(obj: Any, stream: Optional[int], name: str, where: str) -> Any:
    """The producer's capsule: DLPack 1.x with no copy where the producer speaks it, else the
    older protocol (producers before the 2023.12 array API take ``stream`` only)."""
    attempts: List[Dict[str, Any]] = [{"max_version": (1, 0), "copy": False},
                                      {"max_version": (1, 0)}, {}]
    failure: Optional[BaseException] = None
    for extra in attempts:
        try:
            return obj.__dlpack__(stream=stream, **extra)
        except TypeError as error:  # a keyword this producer does not take
            failure = error
        except Exception as error:
            raise InvalidArgumentError(
                f"{where}: {name}: __dlpack__(stream={stream}) refused the export: "
                f"{type(error).__name__}: {error}"
            ) from error
    raise TypeError(f"{where}: {name}: __dlpack__(stream={stream}) failed: {failure}")


def _export(pending: _Pending, stream: int, where: str) -> Buffer:
    obj, name, writable, device = pending
    capsule = _call_dlpack(obj, _dlpack_stream(device[0], stream), name, where)
    if type(capsule).__name__ != "PyCapsule":
        raise TypeError(f"{where}: {name}: __dlpack__ returned a {type(capsule).__name__}, "
                        "not a PyCapsule")
    capsule_name = _capsule_name(capsule)
    if capsule_name == b"dltensor_versioned":
        managed = DLManagedTensorVersioned.from_address(
            _capsule_pointer(capsule, capsule_name))
        version = (managed.version.major, managed.version.minor)
        if version[0] != 1:
            raise InvalidArgumentError(
                f"{where}: {name}: a DLPack {version[0]}.{version[1]} tensor; mori_tp reads "
                "DLPack 1.x and the older unversioned capsules"
            )
        flags, tensor = managed.flags, managed.dl_tensor
    elif capsule_name == b"dltensor":
        managed_old = DLManagedTensor.from_address(_capsule_pointer(capsule, capsule_name))
        flags, tensor = 0, managed_old.dl_tensor
    else:
        raise InvalidArgumentError(
            f"{where}: {name}: __dlpack__ returned a capsule named {capsule_name!r}, not "
            "'dltensor' or 'dltensor_versioned' (a capsule already consumed?)"
        )
    given = (tensor.device.device_type, tensor.device.device_id)
    if given != device:
        raise InvalidArgumentError(
            f"{where}: {name}: its DLPack tensor is on device {given} but __dlpack_device__() "
            f"said {device}"
        )
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    bits, lanes = tensor.dtype.bits, tensor.dtype.lanes
    what = (f"a DLPack tensor in {device_name(device[0])} memory (device type {device[0]}, "
            f"device {device[1]}) of shape {shape} and {bits}-bit items"
            + (f" of {lanes} lanes" if lanes != 1 else ""))
    if flags & DLPACK_FLAG_IS_COPIED:
        raise InvalidArgumentError(
            f"{where}: {name}: the producer exported a copy ({what}; DLPack flag IS_COPIED): "
            "the library must read and write the tensor's own memory"
        )
    if writable and flags & DLPACK_FLAG_READ_ONLY:
        raise _read_only(where, name, what, "DLPack flag READ_ONLY")
    if bits == 0 or lanes == 0:
        raise InvalidArgumentError(f"{where}: {name}: {what}: an item of 0 bits has no size")
    if tensor.ndim and tensor.strides:
        strides = tuple(tensor.strides[i] for i in range(tensor.ndim))
        expected = _contiguous_strides(shape, strides, 1)
        if expected is not None:
            raise _not_contiguous(where, name, what, strides, expected, "elements")
    nbytes = (_product(shape) * bits * lanes + 7) // 8
    address = _address((tensor.data or 0) + tensor.byte_offset,
                       f"{name}'s data pointer plus byte_offset", where)
    return Buffer(address, nbytes, what, device, None, (obj, capsule))


def stream_handle(stream: Any, where: str) -> int:
    """The raw ``hipStream_t`` / ``cudaStream_t`` of ``stream=``: an int as it is; an object
    with ``__cuda_stream__()`` (the CUDA Python protocol), ``cuda_stream`` (torch.cuda.Stream),
    a ``__cuda_array_interface__`` that carries a stream (a CuPy array: its stream, the legacy
    default stream 1 being the null stream), or ``ptr`` (a CuPy Stream)."""
    if isinstance(stream, bool):
        raise TypeError(f"{where}: stream must be an int handle or a stream object, not a bool")
    try:
        return _address(operator.index(stream), "stream", where)
    except TypeError:
        pass
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        try:
            handle = value[1]  # (version, handle)
        except (TypeError, IndexError):
            raise TypeError(f"{where}: stream.__cuda_stream__() returned {value!r}, not "
                            "(version, handle)") from None
        return _address(handle, "stream.__cuda_stream__()[1]", where)
    if hasattr(stream, "cuda_stream"):
        return _address(stream.cuda_stream, "stream.cuda_stream", where)
    cai = _cai(stream, "stream", where)
    if isinstance(cai, dict):
        handle = cai_stream(cai.get("stream"), "stream", where)
        if handle is None:
            raise TypeError(
                f"{where}: stream: the object's __cuda_array_interface__ (version "
                f"{cai.get('version')}) carries no stream; pass the stream itself"
            )
        return handle
    if hasattr(stream, "ptr"):
        return _address(stream.ptr, "stream.ptr", where)
    raise TypeError(
        f"{where}: stream must be an int handle or an object carrying one (a torch.cuda.Stream, "
        "a CuPy Stream, an object with __cuda_stream__, a tensor whose __cuda_array_interface__ "
        f"has a stream), not {type(stream).__name__}"
    )


def _is_one_tensor(value: Any) -> bool:
    """Whether a list argument is a single tensor (iterating it would give its rows)."""
    if _np is not None and isinstance(value, _np.ndarray):
        return value.ndim != 1 or value.dtype.kind not in "iu"
    return hasattr(value, "__dlpack__") or _cai(value, "", "") is not None


class Operand:
    """One buffer argument of a call once resolved: a list (``src_ptrs``) or one buffer
    (``staging``)."""

    __slots__ = ("name", "single", "addresses", "tensors", "pending", "first_address")

    def __init__(self, name: str, single: bool) -> None:
        self.name = name
        self.single = single
        #: Every buffer's address (0 for a DLPack producer not yet exported).
        self.addresses: List[int] = []
        #: (index, Buffer) of the arrays and tensors, in order.
        self.tensors: List[Tuple[int, Buffer]] = []
        #: (index, _Pending) of the DLPack producers not yet exported.
        self.pending: List[Tuple[int, _Pending]] = []
        #: The index of the first raw address, or None.
        self.first_address: Optional[int] = None

    def item_name(self, index: int) -> str:
        return self.name if self.single else f"{self.name}[{index}]"

    def named_tensors(self) -> List[Tuple[str, Buffer]]:
        return [(self.item_name(index), buffer) for index, buffer in self.tensors]

    def capacity(self, given: Optional[int], capacity_name: str, where: str) -> Optional[int]:
        """The capacity of each buffer: ``given`` (already checked to fit uint64), which must
        not exceed any tensor's bytes; by default the smallest tensor's bytes, which needs
        every buffer to be a tensor or array (None: no buffers)."""
        if given is None:
            if self.first_address is not None:
                raise TypeError(
                    f"{where}: {capacity_name} is required when "
                    f"{self.item_name(self.first_address)} is an address (only arrays and "
                    "tensors carry their size)"
                )
            return min((buffer.nbytes for _, buffer in self.tensors), default=None)
        for index, buffer in self.tensors:
            if given > buffer.nbytes:
                raise InvalidArgumentError(
                    f"{where}: {capacity_name} {given} exceeds {self.item_name(index)}'s "
                    f"{buffer.nbytes} bytes ({buffer.what})"
                )
        return given

    def export(self, stream: int, where: str) -> None:
        """Exports the DLPack producers for ``stream`` (0: the null stream)."""
        for index, pending in self.pending:
            buffer = _export(pending, stream, where)
            self.addresses[index] = buffer.address
            self.tensors.append((index, buffer))
        self.tensors.sort(key=lambda entry: entry[0])
        self.pending = []


def _classify_operand(name: str, value: Any, writable: bool, single: bool,
                      where: str) -> Operand:
    if single:
        items = [value]
    else:
        if _is_one_tensor(value):
            raise TypeError(
                f"{where}: {name} must be a sequence of buffers (one per layer's K or V), not "
                f"a single {type(value).__name__}; wrap it in a list"
            )
        try:
            items = list(value)
        except TypeError:
            raise TypeError(f"{where}: {name} must be a sequence of buffers, not "
                            f"{type(value).__name__}") from None
    operand = Operand(name, single)
    addresses = operand.addresses
    for index, item in enumerate(items):
        if type(item) is int and 0 <= item <= _U64_MAX:  # the common case, kept cheap
            addresses.append(item)
            if operand.first_address is None:
                operand.first_address = index
            continue
        entry = _classify(item, operand.item_name(index), writable, where)
        if isinstance(entry, _Pending):
            addresses.append(0)
            operand.pending.append((index, entry))
            continue
        addresses.append(entry.address)
        if entry.nbytes is None:
            if operand.first_address is None:
                operand.first_address = index
        else:
            operand.tensors.append((index, entry))
    return operand


def choose_stream(where: str, backend: str, explicit: Optional[int],
                  buffers: Sequence[Tuple[str, Buffer]]) -> int:
    """The call's stream (0: the null stream): ``explicit`` when given; else, except for the
    host backend, the one stream the buffers' ``__cuda_array_interface__`` carry."""
    if explicit is not None:
        return explicit
    if backend == "host":
        return 0
    carried: Dict[int, str] = {}
    for name, buffer in buffers:
        if buffer.stream is not None:
            carried.setdefault(buffer.stream, name)
    if len(carried) > 1:
        listed = ", ".join(f"{name} stream {stream:#x}" for stream, name in carried.items())
        raise InvalidArgumentError(
            f"{where}: the buffers' __cuda_array_interface__ carry different streams ({listed}; "
            "0x0 is the legacy default stream); pass stream= to choose the one the copies run "
            "on"
        )
    return next(iter(carried), 0)


def resolve(where: str, backend: str, stream: Any,
            operands: Sequence[Tuple[str, Any, bool, bool]],
            extra: Sequence[Tuple[str, Buffer]] = ()) -> Tuple[List[Operand], Optional[int]]:
    """Resolves the buffer arguments of one copying call.

    ``operands``: ``(name, value, writable, single)`` each; ``extra``: buffers resolved before
    (a :class:`Group`'s) that take part in choosing the stream and in the device check.
    Returns the operands, every buffer resolved, and the stream for ``MoriSendOptions`` (None:
    the null stream). Refuses before anything is exported: a DLPack device the backend does
    not reach, CAI streams that disagree.
    """
    explicit = None if stream is None else stream_handle(stream, where)
    resolved = [_classify_operand(name, value, writable, single, where)
                for name, value, writable, single in operands]
    known: List[Tuple[str, Buffer]] = list(extra)
    for operand in resolved:
        for _, pending in operand.pending:
            _check_device(pending.device, pending.name, backend, where)
        known += operand.named_tensors()
    for name, buffer in extra:
        if buffer.device is not None:
            _check_device(buffer.device, name, backend, where)
    chosen = choose_stream(where, backend, explicit, known)
    for operand in resolved:
        operand.export(chosen, where)
    return resolved, chosen or None


def resolve_now(value: Any, name: str, writable: bool, where: str) -> Operand:
    """A list of buffers resolved outside a call (a :class:`Group`'s): DLPack producers are
    exported at once, for the null stream."""
    operand = _classify_operand(name, value, writable, False, where)
    operand.export(0, where)
    return operand
