//! The names the exports had before every one took the `mori_tp_` prefix (`mori_` alone is
//! MORI's own, as in `mori_shmem_*`): each is an alias that forwards to its `mori_tp_` function,
//! kept so that programs built against them still link and run. REFERENCE.md section 8 lists
//! them; tests/ffi.rs checks that each behaves as its new name.
//!
//! Each alias is written out by hand (a macro that generates exports would hide them from
//! cbindgen) and names itself in its messages, as every export does.

use std::ffi::{c_char, c_void};

use super::boundary::{called_as, function_name};
use super::*;

/// Alias of mori_tp_kvcache_send (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_send_kvcache.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_send_kvcache(
    config: *const MoriTpSliceConfig,
    buffers: *const MoriKvBuffers,
    src_pages: *const i32,
    dst_pages: *const i32,
    num_pages: usize,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_kvcache_send.
    called_as(function_name!(), || unsafe {
        mori_tp_kvcache_send(config, buffers, src_pages, dst_pages, num_pages, options)
    })
}

/// Alias of mori_tp_kvcache_pack (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_pack_kvcache.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_pack_kvcache(
    config: *const MoriTpSliceConfig,
    src: *const *const c_void,
    num_buffers: usize,
    src_capacity: u64,
    src_pages: *const i32,
    num_pages: usize,
    staging: *mut c_void,
    staging_capacity: u64,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_kvcache_pack.
    called_as(function_name!(), || unsafe {
        mori_tp_kvcache_pack(
            config,
            src,
            num_buffers,
            src_capacity,
            src_pages,
            num_pages,
            staging,
            staging_capacity,
            options,
        )
    })
}

/// Alias of mori_tp_kvcache_unpack (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_unpack_kvcache.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_unpack_kvcache(
    config: *const MoriTpSliceConfig,
    staging: *const c_void,
    staging_capacity: u64,
    dst: *const *mut c_void,
    num_buffers: usize,
    dst_capacity: u64,
    dst_pages: *const i32,
    num_pages: usize,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_kvcache_unpack.
    called_as(function_name!(), || unsafe {
        mori_tp_kvcache_unpack(
            config,
            staging,
            staging_capacity,
            dst,
            num_buffers,
            dst_capacity,
            dst_pages,
            num_pages,
            options,
        )
    })
}

/// Alias of mori_tp_pair_send (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_send_kvcache_pair.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_send_kvcache_pair(
    config: *const MoriTpPairConfig,
    buffers: *const MoriKvBuffers,
    request: *const MoriTpRequest,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_pair_send.
    called_as(function_name!(), || unsafe {
        mori_tp_pair_send(config, buffers, request, options)
    })
}

/// Alias of mori_tp_pair_pack (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_pack_kvcache_pair.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_pack_kvcache_pair(
    config: *const MoriTpPairConfig,
    staging_mode: u32,
    src: *const *const c_void,
    num_buffers: usize,
    src_capacity: u64,
    request: *const MoriTpRequest,
    staging: *mut c_void,
    staging_capacity: u64,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_pair_pack.
    called_as(function_name!(), || unsafe {
        mori_tp_pair_pack(
            config,
            staging_mode,
            src,
            num_buffers,
            src_capacity,
            request,
            staging,
            staging_capacity,
            options,
        )
    })
}

/// Alias of mori_tp_pair_unpack (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_unpack_kvcache_pair.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_unpack_kvcache_pair(
    config: *const MoriTpPairConfig,
    staging_mode: u32,
    staging: *const c_void,
    staging_capacity: u64,
    dst: *const *mut c_void,
    num_buffers: usize,
    dst_capacity: u64,
    request: *const MoriTpRequest,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_pair_unpack.
    called_as(function_name!(), || unsafe {
        mori_tp_pair_unpack(
            config,
            staging_mode,
            staging,
            staging_capacity,
            dst,
            num_buffers,
            dst_capacity,
            request,
            options,
        )
    })
}

/// Alias of mori_tp_groups_send (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_send_kvcache_groups.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_send_kvcache_groups(
    groups: *const MoriTpGroup,
    num_groups: usize,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_groups_send.
    called_as(function_name!(), || unsafe {
        mori_tp_groups_send(groups, num_groups, options)
    })
}

/// Alias of mori_tp_groups_pack (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_pack_kvcache_groups.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_pack_kvcache_groups(
    groups: *const MoriTpGroup,
    num_groups: usize,
    staging: *mut c_void,
    staging_capacity: u64,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_groups_pack.
    called_as(function_name!(), || unsafe {
        mori_tp_groups_pack(groups, num_groups, staging, staging_capacity, options)
    })
}

/// Alias of mori_tp_groups_unpack (its name before the mori_tp_ prefix): the same
/// parameters, return codes and behaviour; its messages name mori_unpack_kvcache_groups.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mori_unpack_kvcache_groups(
    groups: *const MoriTpGroup,
    num_groups: usize,
    staging: *const c_void,
    staging_capacity: u64,
    options: *const MoriSendOptions,
) -> MoriStatus {
    // SAFETY: the caller's pointers, with the contract of mori_tp_groups_unpack.
    called_as(function_name!(), || unsafe {
        mori_tp_groups_unpack(groups, num_groups, staging, staging_capacity, options)
    })
}

/// Alias of mori_tp_status_name (its name before the mori_tp_ prefix): the same result.
#[unsafe(no_mangle)]
pub extern "C" fn mori_status_str(status: MoriStatus) -> *const c_char {
    mori_tp_status_name(status)
}

/// Alias of mori_tp_backend_name (its name before the mori_tp_ prefix): the same result.
#[unsafe(no_mangle)]
pub extern "C" fn mori_backend_name(backend: u32) -> *const c_char {
    mori_tp_backend_name(backend)
}

/// Alias of mori_tp_last_error_message (its name before the mori_tp_ prefix): the same result.
#[unsafe(no_mangle)]
pub extern "C" fn mori_last_error_message() -> *const c_char {
    mori_tp_last_error_message()
}

/// Alias of mori_tp_version (its name before the mori_tp_ prefix): the same result.
#[unsafe(no_mangle)]
pub extern "C" fn mori_version() -> *const c_char {
    mori_tp_version()
}

/// Alias of mori_tp_abi_version (its name before the mori_tp_ prefix): the same result.
#[unsafe(no_mangle)]
pub extern "C" fn mori_abi_version() -> u32 {
    mori_tp_abi_version()
}
