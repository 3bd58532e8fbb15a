"""Finding libmori_tp, and its C ABI (``include/mori_tp.h``) declared for ctypes.

Nothing here is public: ``mori_tp`` wraps these declarations in Python types and exceptions.
Every struct mirrors the header field for field, in order; every exported function gets its
``argtypes`` and ``restype``. At import the library's ABI version and the ctypes struct sizes
are checked against what this file was written for, so a stale or foreign library fails loudly
at ``import mori_tp`` instead of corrupting memory later.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

#: MORI_TP_ABI_VERSION of the header these declarations follow.
ABI_VERSION = 1

#: Environment variable naming the exact library file to load.
LIBRARY_ENV = "MORI_TP_LIBRARY"

# Status codes (MoriStatus), REFERENCE.md section 8.
MORI_OK = 0
MORI_ERR_BUFFER_TOO_SMALL = 7
MORI_ERR_POOL_FULL = 11

# MoriSendOptions.flags bits.
MORI_SEND_SYNCHRONIZE = 1
MORI_SEND_COPY_KERNEL = 2
MORI_SEND_MEMCPY2D = 4
# The SM budget: bits 16-31 of the flags (MORI_SEND_MAX_BLOCKS_SHIFT, _MASK, _LIMIT).
MORI_SEND_MAX_BLOCKS_SHIFT = 16
MORI_SEND_MAX_BLOCKS_MASK = 0xFFFF0000
MORI_SEND_MAX_BLOCKS_LIMIT = 65535

# MoriBackend values.
MORI_BACKEND_AUTO = 0
MORI_BACKEND_HOST = 1
MORI_BACKEND_HIP = 2
MORI_BACKEND_CUDA = 3


class MoriTpSliceParams(ctypes.Structure):
    _fields_ = [
        ("prefill_tp_size", ctypes.c_uint32),
        ("prefill_tp_rank", ctypes.c_uint32),
        ("decode_tp_size", ctypes.c_uint32),
        ("decode_tp_rank", ctypes.c_uint32),
        ("total_kv_heads", ctypes.c_uint32),
        ("page_size", ctypes.c_uint32),
        ("src_item_len", ctypes.c_uint64),
        ("dst_item_len", ctypes.c_uint64),
    ]


class MoriTpSliceConfig(ctypes.Structure):
    _fields_ = [
        ("action", ctypes.c_uint32),
        ("page_size", ctypes.c_uint32),
        ("first_head", ctypes.c_uint32),
        ("num_heads", ctypes.c_uint32),
        ("src_item_len", ctypes.c_uint64),
        ("dst_item_len", ctypes.c_uint64),
        ("bytes_per_token_src", ctypes.c_uint64),
        ("bytes_per_token_dst", ctypes.c_uint64),
        ("src_head_slice_offset", ctypes.c_uint64),
        ("dst_head_slice_offset", ctypes.c_uint64),
        ("heads_bytes_per_token_to_send", ctypes.c_uint64),
    ]


class MoriCopyRect(ctypes.Structure):
    _fields_ = [
        ("src_offset", ctypes.c_uint64),
        ("dst_offset", ctypes.c_uint64),
        ("src_pitch", ctypes.c_uint64),
        ("dst_pitch", ctypes.c_uint64),
        ("width", ctypes.c_uint64),
        ("height", ctypes.c_uint64),
    ]


class MoriSegment(ctypes.Structure):
    _fields_ = [
        ("src_offset", ctypes.c_uint64),
        ("dst_offset", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
    ]


class MoriKvBuffers(ctypes.Structure):
    _fields_ = [
        ("src", ctypes.POINTER(ctypes.c_void_p)),  # const void *const *
        ("dst", ctypes.POINTER(ctypes.c_void_p)),  # void *const *
        ("num_buffers", ctypes.c_size_t),
        ("src_capacity", ctypes.c_uint64),
        ("dst_capacity", ctypes.c_uint64),
    ]


class MoriSendOptions(ctypes.Structure):
    _fields_ = [
        ("backend", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("stream", ctypes.c_void_p),
    ]


class MoriTpMemory(ctypes.Structure):
    _fields_ = [
        ("num_buffers", ctypes.c_size_t),
        ("capacity", ctypes.c_uint64),
        ("staging_capacity", ctypes.c_uint64),
    ]


class MoriTpLayout(ctypes.Structure):
    _fields_ = [
        ("total_kv_heads", ctypes.c_uint32),
        ("tp_size", ctypes.c_uint32),
        ("tp_rank", ctypes.c_uint32),
        ("page_size", ctypes.c_uint32),
        ("head_bytes", ctypes.c_uint64),
        ("page_stride", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("token_stride", ctypes.c_uint64),
        ("head_stride", ctypes.c_uint64),
    ]


class MoriTpPairConfig(ctypes.Structure):
    _fields_ = [
        ("action", ctypes.c_uint32),
        ("first_head", ctypes.c_uint32),
        ("num_heads", ctypes.c_uint32),
        ("src_first_local", ctypes.c_uint32),
        ("dst_first_local", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("src", MoriTpLayout),
        ("dst", MoriTpLayout),
    ]


class MoriTpRequest(ctypes.Structure):
    _fields_ = [
        ("src_pages", ctypes.c_void_p),  # const int32_t *, passed by address
        ("num_src_pages", ctypes.c_size_t),
        ("dst_pages", ctypes.c_void_p),  # const int32_t *
        ("num_dst_pages", ctypes.c_size_t),
        ("num_tokens", ctypes.c_uint64),
    ]


class MoriTpGroup(ctypes.Structure):
    _fields_ = [
        ("config", MoriTpPairConfig),
        ("staging", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("first_token", ctypes.c_uint64),
        ("request", MoriTpRequest),
        ("buffers", MoriKvBuffers),
    ]


class MoriTpGroupInfo(ctypes.Structure):
    _fields_ = [
        ("first_segment", ctypes.c_uint64),
        ("num_segments", ctypes.c_uint64),
        ("staging_len", ctypes.c_uint64),
        ("src_staging_offset", ctypes.c_uint64),
        ("dst_staging_offset", ctypes.c_uint64),
    ]


class MoriTpGroupsTotal(ctypes.Structure):
    _fields_ = [
        ("num_segments", ctypes.c_uint64),
        ("transfer_segments", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("src_staging_bytes", ctypes.c_uint64),
        ("dst_staging_bytes", ctypes.c_uint64),
    ]


class MoriTpLayerRange(ctypes.Structure):
    _fields_ = [
        ("first_layer", ctypes.c_uint32),
        ("num_layers", ctypes.c_uint32),
        ("prefill_first_local", ctypes.c_uint32),
        ("decode_first_local", ctypes.c_uint32),
    ]


class MoriTpPoolOptions(ctypes.Structure):
    _fields_ = [
        ("capacity", ctypes.c_uint64),
        ("min_slot", ctypes.c_uint64),
        ("memory", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


class MoriTpSlot(ctypes.Structure):
    _fields_ = [
        ("offset", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
    ]


class MoriTpPoolInfo(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_void_p),
        ("capacity", ctypes.c_uint64),
        ("min_slot", ctypes.c_uint64),
        ("live_slots", ctypes.c_uint64),
        ("live_bytes", ctypes.c_uint64),
        ("free_bytes", ctypes.c_uint64),
        ("largest_free", ctypes.c_uint64),
        ("free_blocks", ctypes.c_uint64),
        ("memory", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("lock_errno", ctypes.c_int32),
        ("waiters", ctypes.c_uint32),
    ]


class MoriTpGpuCounters(ctypes.Structure):
    _fields_ = [
        ("kernel_launches", ctypes.c_uint64),
        ("fallbacks", ctypes.c_uint64),
        ("fallbacks_unloadable", ctypes.c_uint64),
        ("fallbacks_busy", ctypes.c_uint64),
        ("fallbacks_context", ctypes.c_uint64),
        ("fallbacks_capture", ctypes.c_uint64),
        ("fallbacks_memory", ctypes.c_uint64),
        ("load_failures", ctypes.c_uint64),
    ]


# MoriTpPoolMemory values and MoriTpPoolInfo.flags bits.
MORI_TP_POOL_HOST = 0
MORI_TP_POOL_DEVICE = 1
MORI_TP_POOL_LOCKED = 1
MORI_TP_POOL_HUGE_PAGES = 2

#: sizeof of each struct in include/mori_tp.h on a 64-bit (LP64 or LLP64) platform.
EXPECTED_SIZES = {
    MoriTpSliceParams: 40,
    MoriTpSliceConfig: 72,
    MoriCopyRect: 48,
    MoriSegment: 24,
    MoriKvBuffers: 40,
    MoriSendOptions: 16,
    MoriTpMemory: 24,
    MoriTpLayout: 56,
    MoriTpPairConfig: 136,
    MoriTpRequest: 40,
    MoriTpPoolOptions: 24,
    MoriTpSlot: 24,
    MoriTpPoolInfo: 80,
    MoriTpGpuCounters: 64,
    MoriTpGroup: 232,
    MoriTpGroupInfo: 40,
    MoriTpGroupsTotal: 40,
    MoriTpLayerRange: 16,
}

_STATUS = ctypes.c_int32
_CONFIG_P = ctypes.POINTER(MoriTpSliceConfig)
_LAYOUT_P = ctypes.POINTER(MoriTpLayout)
_PAIR_P = ctypes.POINTER(MoriTpPairConfig)
_REQUEST_P = ctypes.POINTER(MoriTpRequest)
_MEMORY_P = ctypes.POINTER(MoriTpMemory)
_GROUP_P = ctypes.POINTER(MoriTpGroup)
_OPTIONS_P = ctypes.POINTER(MoriSendOptions)

# Page arrays and plan outputs are declared as addresses (void *) rather than typed pointers:
# numpy and array.array buffers are then passed by their address with no ctypes wrapper object
# per call. Their element types are int32_t, MoriCopyRect and MoriSegment, as in the header.
SIGNATURES = {
    "mori_tp_slice_config": (
        _STATUS,
        [ctypes.POINTER(MoriTpSliceParams), _CONFIG_P],
    ),
    "mori_tp_rank_heads": (
        _STATUS,
        [
            ctypes.c_uint32,  # total_kv_heads
            ctypes.c_uint32,  # tp_size
            ctypes.c_uint32,  # tp_rank
            ctypes.POINTER(ctypes.c_uint32),  # first_head
            ctypes.POINTER(ctypes.c_uint32),  # num_heads
        ],
    ),
    "mori_tp_head_sender": (
        _STATUS,
        [
            ctypes.c_uint32,  # total_kv_heads
            ctypes.c_uint32,  # prefill_tp_size
            ctypes.c_uint32,  # decode_tp_size
            ctypes.c_uint32,  # decode_tp_rank
            ctypes.c_uint32,  # head
            ctypes.POINTER(ctypes.c_uint32),  # prefill_tp_rank
        ],
    ),
    "mori_tp_plan": (
        _STATUS,
        [
            _CONFIG_P,
            ctypes.c_void_p,  # const int32_t *src_pages
            ctypes.c_void_p,  # const int32_t *dst_pages
            ctypes.c_size_t,  # num_pages
            ctypes.c_void_p,  # MoriCopyRect *out
            ctypes.c_size_t,  # capacity
            ctypes.POINTER(ctypes.c_size_t),  # out_len
        ],
    ),
    "mori_tp_plan_segments": (
        _STATUS,
        [
            _CONFIG_P,
            ctypes.c_void_p,  # const int32_t *src_pages
            ctypes.c_void_p,  # const int32_t *dst_pages
            ctypes.c_size_t,  # num_pages
            ctypes.c_void_p,  # MoriSegment *out
            ctypes.c_size_t,  # capacity
            ctypes.POINTER(ctypes.c_size_t),  # out_len
        ],
    ),
    "mori_tp_kvcache_send": (
        _STATUS,
        [
            _CONFIG_P,
            ctypes.POINTER(MoriKvBuffers),
            ctypes.c_void_p,  # const int32_t *src_pages
            ctypes.c_void_p,  # const int32_t *dst_pages
            ctypes.c_size_t,  # num_pages
            ctypes.POINTER(MoriSendOptions),
        ],
    ),
    "mori_tp_staging_for": (
        _STATUS,
        [_CONFIG_P, ctypes.POINTER(ctypes.c_uint32)],
    ),
    "mori_tp_staging_len": (
        _STATUS,
        [_CONFIG_P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)],
    ),
    "mori_tp_plan_transfer": (
        _STATUS,
        [
            _CONFIG_P,
            ctypes.c_uint32,  # MoriTpStaging staging
            ctypes.c_void_p,  # const int32_t *src_pages
            ctypes.c_void_p,  # const int32_t *dst_pages
            ctypes.c_size_t,  # num_pages
            ctypes.c_void_p,  # MoriSegment *out
            ctypes.c_size_t,  # capacity
            ctypes.POINTER(ctypes.c_size_t),  # out_len
        ],
    ),
    "mori_tp_check_transfer": (
        _STATUS,
        [
            _CONFIG_P,
            ctypes.c_uint32,  # MoriTpStaging staging
            ctypes.c_void_p,  # const int32_t *src_pages
            ctypes.c_void_p,  # const int32_t *dst_pages
            ctypes.c_size_t,  # num_pages
            ctypes.POINTER(MoriTpMemory),  # prefill
            ctypes.POINTER(MoriTpMemory),  # decode
        ],
    ),
    "mori_tp_kvcache_pack": (
        _STATUS,
        [
            _CONFIG_P,
            ctypes.POINTER(ctypes.c_void_p),  # const void *const *src
            ctypes.c_size_t,  # num_buffers
            ctypes.c_uint64,  # src_capacity
            ctypes.c_void_p,  # const int32_t *src_pages
            ctypes.c_size_t,  # num_pages
            ctypes.c_void_p,  # void *staging
            ctypes.c_uint64,  # staging_capacity
            ctypes.POINTER(MoriSendOptions),
        ],
    ),
    "mori_tp_kvcache_unpack": (
        _STATUS,
        [
            _CONFIG_P,
            ctypes.c_void_p,  # const void *staging
            ctypes.c_uint64,  # staging_capacity
            ctypes.POINTER(ctypes.c_void_p),  # void *const *dst
            ctypes.c_size_t,  # num_buffers
            ctypes.c_uint64,  # dst_capacity
            ctypes.c_void_p,  # const int32_t *dst_pages
            ctypes.c_size_t,  # num_pages
            ctypes.POINTER(MoriSendOptions),
        ],
    ),
    "mori_tp_layout_nhd": (
        _STATUS,
        [
            ctypes.c_uint32,  # total_kv_heads
            ctypes.c_uint32,  # tp_size
            ctypes.c_uint32,  # tp_rank
            ctypes.c_uint32,  # page_size
            ctypes.c_uint64,  # head_bytes
            _LAYOUT_P,
        ],
    ),
    "mori_tp_layout_hnd": (
        _STATUS,
        [
            ctypes.c_uint32,  # total_kv_heads
            ctypes.c_uint32,  # tp_size
            ctypes.c_uint32,  # tp_rank
            ctypes.c_uint32,  # page_size
            ctypes.c_uint64,  # head_bytes
            _LAYOUT_P,
        ],
    ),
    "mori_tp_pair_config": (_STATUS, [_LAYOUT_P, _LAYOUT_P, _PAIR_P]),
    "mori_tp_pair_segments": (
        _STATUS,
        [
            _PAIR_P,
            _REQUEST_P,
            ctypes.c_uint32,  # MoriTpStaging staging
            ctypes.c_void_p,  # MoriSegment *out
            ctypes.c_size_t,  # capacity
            ctypes.POINTER(ctypes.c_size_t),  # out_len
        ],
    ),
    "mori_tp_pair_plan": (
        _STATUS,
        [
            _PAIR_P,
            _REQUEST_P,
            ctypes.c_void_p,  # MoriCopyRect *out
            ctypes.c_size_t,  # capacity
            ctypes.POINTER(ctypes.c_size_t),  # out_len
        ],
    ),
    "mori_tp_pair_staging_for": (_STATUS, [_PAIR_P, ctypes.POINTER(ctypes.c_uint32)]),
    "mori_tp_pair_staging_len": (
        _STATUS,
        [_PAIR_P, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)],
    ),
    "mori_tp_check_pair_transfer": (
        _STATUS,
        [
            _PAIR_P,
            _REQUEST_P,
            ctypes.c_uint32,  # MoriTpStaging staging
            _MEMORY_P,  # prefill
            _MEMORY_P,  # decode
        ],
    ),
    "mori_tp_pair_send": (
        _STATUS,
        [_PAIR_P, ctypes.POINTER(MoriKvBuffers), _REQUEST_P, ctypes.POINTER(MoriSendOptions)],
    ),
    "mori_tp_pair_pack": (
        _STATUS,
        [
            _PAIR_P,
            ctypes.c_uint32,  # MoriTpStaging staging_mode
            ctypes.POINTER(ctypes.c_void_p),  # const void *const *src
            ctypes.c_size_t,  # num_buffers
            ctypes.c_uint64,  # src_capacity
            _REQUEST_P,
            ctypes.c_void_p,  # void *staging
            ctypes.c_uint64,  # staging_capacity
            ctypes.POINTER(MoriSendOptions),
        ],
    ),
    "mori_tp_pair_unpack": (
        _STATUS,
        [
            _PAIR_P,
            ctypes.c_uint32,  # MoriTpStaging staging_mode
            ctypes.c_void_p,  # const void *staging
            ctypes.c_uint64,  # staging_capacity
            ctypes.POINTER(ctypes.c_void_p),  # void *const *dst
            ctypes.c_size_t,  # num_buffers
            ctypes.c_uint64,  # dst_capacity
            _REQUEST_P,
            ctypes.POINTER(MoriSendOptions),
        ],
    ),
    "mori_tp_groups_info": (
        _STATUS,
        [
            _GROUP_P,
            ctypes.c_size_t,  # num_groups
            ctypes.POINTER(MoriTpGroupInfo),  # out: num_groups entries
            ctypes.POINTER(MoriTpGroupsTotal),
        ],
    ),
    "mori_tp_groups_segments": (
        _STATUS,
        [
            _GROUP_P,
            ctypes.c_size_t,  # num_groups
            ctypes.c_void_p,  # MoriSegment *out
            ctypes.c_size_t,  # capacity
            ctypes.POINTER(ctypes.c_size_t),  # out_len
        ],
    ),
    "mori_tp_check_groups_transfer": (
        _STATUS,
        [_GROUP_P, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64],
    ),
    "mori_tp_groups_send": (_STATUS, [_GROUP_P, ctypes.c_size_t, _OPTIONS_P]),
    "mori_tp_groups_pack": (
        _STATUS,
        [
            _GROUP_P,
            ctypes.c_size_t,  # num_groups
            ctypes.c_void_p,  # void *staging
            ctypes.c_uint64,  # staging_capacity
            _OPTIONS_P,
        ],
    ),
    "mori_tp_groups_unpack": (
        _STATUS,
        [
            _GROUP_P,
            ctypes.c_size_t,  # num_groups
            ctypes.c_void_p,  # const void *staging
            ctypes.c_uint64,  # staging_capacity
            _OPTIONS_P,
        ],
    ),
    "mori_tp_pp_layers": (
        _STATUS,
        [
            ctypes.POINTER(ctypes.c_uint32),  # prefill_layers
            ctypes.c_size_t,  # prefill_stages
            ctypes.POINTER(ctypes.c_uint32),  # decode_layers
            ctypes.c_size_t,  # decode_stages
            ctypes.c_uint32,  # prefill_stage
            ctypes.c_uint32,  # decode_stage
            ctypes.POINTER(MoriTpLayerRange),
        ],
    ),
    "mori_tp_pool_create": (
        _STATUS,
        [ctypes.POINTER(MoriTpPoolOptions), ctypes.POINTER(ctypes.c_uint64)],
    ),
    "mori_tp_pool_try_alloc": (
        _STATUS,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(MoriTpSlot)],
    ),
    "mori_tp_pool_alloc": (
        _STATUS,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(MoriTpSlot)],
    ),
    "mori_tp_pool_free": (_STATUS, [ctypes.c_uint64, ctypes.c_uint64]),
    "mori_tp_pool_info": (_STATUS, [ctypes.c_uint64, ctypes.POINTER(MoriTpPoolInfo)]),
    "mori_tp_gpu_counters_get": (_STATUS, [ctypes.c_uint32, ctypes.POINTER(MoriTpGpuCounters)]),
    "mori_tp_pool_destroy": (_STATUS, [ctypes.c_uint64]),
    "mori_tp_status_name": (ctypes.c_char_p, [_STATUS]),
    "mori_tp_last_error_message": (ctypes.c_char_p, []),
    "mori_tp_version": (ctypes.c_char_p, []),
    "mori_tp_abi_version": (ctypes.c_uint32, []),
    "mori_tp_action_name": (ctypes.c_char_p, [ctypes.c_uint32]),
    "mori_tp_staging_name": (ctypes.c_char_p, [ctypes.c_uint32]),
    "mori_tp_backend_name": (ctypes.c_char_p, [ctypes.c_uint32]),
}


#: The names the library's functions had before the ``mori_tp_`` prefix, each an alias of its
#: new name (include/mori_tp.h documents them). They are declared, so that loading checks the
#: library exports both; the package itself calls the new names.
ALIASES = {
    "mori_send_kvcache": "mori_tp_kvcache_send",
    "mori_pack_kvcache": "mori_tp_kvcache_pack",
    "mori_unpack_kvcache": "mori_tp_kvcache_unpack",
    "mori_send_kvcache_pair": "mori_tp_pair_send",
    "mori_pack_kvcache_pair": "mori_tp_pair_pack",
    "mori_unpack_kvcache_pair": "mori_tp_pair_unpack",
    "mori_send_kvcache_groups": "mori_tp_groups_send",
    "mori_pack_kvcache_groups": "mori_tp_groups_pack",
    "mori_unpack_kvcache_groups": "mori_tp_groups_unpack",
    "mori_status_str": "mori_tp_status_name",
    "mori_last_error_message": "mori_tp_last_error_message",
    "mori_version": "mori_tp_version",
    "mori_abi_version": "mori_tp_abi_version",
    "mori_backend_name": "mori_tp_backend_name",
}
SIGNATURES.update({old: SIGNATURES[new] for old, new in ALIASES.items()})


def library_file_name() -> str:
    """The platform's file name for the mori_tp shared library."""
    if sys.platform == "darwin":
        return "libmori_tp.dylib"
    if sys.platform == "win32":
        return "mori_tp.dll"
    return "libmori_tp.so"


def candidate_paths() -> List[Path]:
    """Where the library is looked for when MORI_TP_LIBRARY is unset, in order.

    Inside the package directory (where ``pip install`` puts it), beside it, then, when the
    package runs from a checkout (``python/mori_tp`` two levels below ``Cargo.toml``), the
    crate's ``target/release`` and ``target/debug``.
    """
    package_dir = Path(__file__).resolve().parent
    crate_dir = package_dir.parent.parent
    name = library_file_name()
    paths = [package_dir / name, package_dir.parent / name]
    if (crate_dir / "Cargo.toml").is_file():
        paths += [crate_dir / "target" / "release" / name, crate_dir / "target" / "debug" / name]
    return paths


def find_library() -> Path:
    """The library file to load, or ImportError naming every place that was tried."""
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        # An explicit choice that is wrong must not silently fall back to another build.
        path = Path(explicit)
        if not path.is_file():
            raise ImportError(
                f"mori_tp: {LIBRARY_ENV} is set to {explicit!r}, which is not a file"
            )
        return path
    tried = candidate_paths()
    for path in tried:
        if path.is_file():
            return path
    listed = "\n  ".join(str(p) for p in tried)
    raise ImportError(
        f"mori_tp: cannot find {library_file_name()}; install the package with `pip install .` "
        f"in the mori-tp repository (which builds the library into it), build it there with "
        f"`cargo build --release`, or set {LIBRARY_ENV} to its path. Tried:\n  {listed}"
    )


def check_layout(abi_version: int, pointer_size: int) -> Optional[str]:
    """Why the loaded library or this interpreter does not match these declarations, or None."""
    if abi_version != ABI_VERSION:
        return (
            f"the library has ABI version {abi_version}, but this mori_tp package was written "
            f"for ABI version {ABI_VERSION}; use the package and library of the same build"
        )
    if pointer_size != 8:
        return f"mori_tp supports 64-bit platforms only (pointer size {pointer_size} bytes)"
    for struct, expected in EXPECTED_SIZES.items():
        actual = ctypes.sizeof(struct)
        if actual != expected:
            return (
                f"ctypes lays {struct.__name__} out in {actual} bytes, "
                f"but the C header's is {expected} bytes"
            )
    return None


def load() -> Tuple[ctypes.CDLL, Path]:
    """Loads the library, declares every function and checks the ABI."""
    path = find_library()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise ImportError(f"mori_tp: cannot load {path}: {error}") from error
    for name, (restype, argtypes) in SIGNATURES.items():
        try:
            function = getattr(lib, name)
        except AttributeError:
            raise ImportError(
                f"mori_tp: {path} does not export {name}; is it a libmori_tp build?"
            ) from None
        function.restype = restype
        function.argtypes = argtypes
    problem = check_layout(lib.mori_tp_abi_version(), ctypes.sizeof(ctypes.c_void_p))
    if problem is not None:
        raise ImportError(f"mori_tp: {path}: {problem}")
    return lib, path
