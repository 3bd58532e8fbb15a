//! The panic and error boundary every exported function runs inside: no panic unwinds into C,
//! every failure becomes its status code and this thread's last error message.

use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::panic::{AssertUnwindSafe, catch_unwind};

use super::types::*;
use crate::error::{Error, ErrorClass};

/// Why an exported function failed: a core [`Error`], or a condition only a C caller can create.
/// Each message starts with its class's label, as the core's do.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Failure {
    /// The safe core refused the request.
    #[error(transparent)]
    Core(Error),
    /// A required pointer argument is NULL.
    #[error("null pointer: {0} is NULL")]
    NullArgument(&'static str),
    /// An array pointer is NULL but its length is not 0.
    #[error("null pointer: {name} is NULL but its length is {len}")]
    NullArray { name: &'static str, len: usize },
    /// A pointer is not aligned for its type.
    #[error("invalid argument: {name} ({address:#x}) is not aligned to {align} bytes")]
    Misaligned {
        name: &'static str,
        address: usize,
        align: usize,
    },
    /// An array's byte size exceeds the address space.
    #[error("invalid argument: {name} length {len} is too large")]
    ArrayTooLong { name: &'static str, len: usize },
    /// An enum field holds a value the ABI does not define; `allowed` lists the values.
    #[error("invalid argument: {field} {value} is not a {allowed}")]
    UnknownValue {
        field: &'static str,
        value: u32,
        allowed: String,
    },
    /// A flags field has bits the ABI does not define.
    #[error(
        "invalid argument: options.flags {flags:#x} has unknown bits {unknown:#x} (only \
         MORI_SEND_SYNCHRONIZE = 0x1, MORI_SEND_COPY_KERNEL = 0x2, MORI_SEND_MEMCPY2D = 0x4 and \
         the block budget in bits 16-31, MORI_SEND_MAX_BLOCKS_MASK = 0xffff0000, are defined)"
    )]
    UnknownFlags { flags: u32, unknown: u32 },
    /// A block budget (MORI_SEND_MAX_BLOCKS) with the per-rect copies, which it cannot bound.
    #[error(
        "invalid argument: options.flags {flags:#x} sets a block budget of {blocks} \
         (MORI_SEND_MAX_BLOCKS, bits 16-31) together with MORI_SEND_MEMCPY2D (0x4): the budget \
         bounds the copy kernel's grid, and the per-rect copies run on the runtime's own copy \
         engines or blit kernels, which it cannot bound; drop one of them"
    )]
    BudgetWithMemcpy2d { flags: u32, blocks: u32 },
    /// A flags field asks for two copy paths at once.
    #[error(
        "invalid argument: options.flags {flags:#x} sets both MORI_SEND_COPY_KERNEL (0x2) and \
         MORI_SEND_MEMCPY2D (0x4), which ask for different copy paths: set one, or neither for \
         the library's choice"
    )]
    ConflictingFlags { flags: u32 },
    /// The caller's output array holds fewer entries than the result needs.
    #[error(
        "buffer too small: the result needs {needed} entries, the output array holds {capacity}"
    )]
    BufferTooSmall {
        needed: usize,
        capacity: usize,
        /// `out == NULL && capacity == 0`: the caller asked for the size, nothing failed.
        size_query: bool,
    },
    /// A pool handle that is not a live pool.
    #[error(
        "invalid argument: pool {0} is not a live staging pool (destroyed, or never returned by \
         mori_tp_pool_create)"
    )]
    UnknownPool(u64),
    /// A failure of one group of a request of several groups (a core error carries its group
    /// in [`Error::InGroup`] instead).
    #[error("{}", in_group(*.group, .failure))]
    InGroup { group: usize, failure: Box<Failure> },
    /// A panic (a bug) was caught at the boundary.
    #[error("internal error: {0}")]
    Panic(String),
}

/// A group's failure: `group {group}: ` after the failure's class label.
fn in_group(group: usize, failure: &Failure) -> String {
    let label = failure.class().map_or("internal error", ErrorClass::label);
    crate::error::with_group(group, label, &failure.to_string())
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure::Core(error)
    }
}

/// `Result` of the FFI layer.
pub(crate) type Result<T, E = Failure> = std::result::Result<T, E>;

/// The status code of each class: the one table between the core's classes and the C codes.
pub(crate) fn status_of(class: ErrorClass) -> MoriStatus {
    match class {
        ErrorClass::NullPointer => MORI_ERR_NULL_POINTER,
        ErrorClass::InvalidArgument => MORI_ERR_INVALID_ARGUMENT,
        ErrorClass::Topology => MORI_ERR_TOPOLOGY,
        ErrorClass::LayoutMismatch => MORI_ERR_LAYOUT_MISMATCH,
        ErrorClass::SliceOverflow => MORI_ERR_SLICE_OVERFLOW,
        ErrorClass::OutOfBounds => MORI_ERR_OUT_OF_BOUNDS,
        ErrorClass::BufferTooSmall => MORI_ERR_BUFFER_TOO_SMALL,
        ErrorClass::BackendUnavailable => MORI_ERR_BACKEND_UNAVAILABLE,
        ErrorClass::Gpu => MORI_ERR_GPU,
        ErrorClass::PoolFull => MORI_ERR_POOL_FULL,
    }
}

impl Failure {
    /// This failure as the refusal of group `group` of a request of several groups.
    pub(crate) fn in_group(self, group: usize) -> Failure {
        match self {
            Failure::Core(error) => Failure::Core(error.in_group(group)),
            other => Failure::InGroup {
                group,
                failure: Box::new(other),
            },
        }
    }

    /// The class of the failure; `None` for a caught panic, which has a code of its own.
    fn class(&self) -> Option<ErrorClass> {
        Some(match self {
            Failure::Core(error) => error.class(),
            Failure::InGroup { failure, .. } => return failure.class(),
            Failure::NullArgument(_) | Failure::NullArray { .. } => ErrorClass::NullPointer,
            Failure::Misaligned { .. }
            | Failure::ArrayTooLong { .. }
            | Failure::UnknownValue { .. }
            | Failure::UnknownFlags { .. }
            | Failure::ConflictingFlags { .. }
            | Failure::BudgetWithMemcpy2d { .. }
            | Failure::UnknownPool(_) => ErrorClass::InvalidArgument,
            Failure::BufferTooSmall { .. } => ErrorClass::BufferTooSmall,
            Failure::Panic(_) => return None,
        })
    }

    pub(crate) fn status(&self) -> MoriStatus {
        self.class().map_or(MORI_ERR_PANIC, status_of)
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Stores this thread's last error. During thread teardown, after the slot has been destroyed
/// (a C++ `thread_local` destructor calling mori-tp), the message is dropped: the status code
/// still reaches the caller.
fn set_last_error(message: String) {
    let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = message;
        }
    });
}

/// This thread's last error message, as a pointer valid until the next failure on the thread
/// (a size query is not one); `None` while the thread is being torn down.
pub(crate) fn last_error_ptr() -> Option<*const std::ffi::c_char> {
    LAST_ERROR
        .try_with(|slot| slot.try_borrow().map(|message| message.as_ptr()).ok())
        .ok()
        .flatten()
}

/// Initialises `env_logger` once, and only when `MORI_TP_LOG` is set: the library never prints
/// unless an operator asks it to.
#[cfg(feature = "c-logging")]
fn init_logging() {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        if let Ok(filters) = std::env::var("MORI_TP_LOG") {
            // A host program that already installed a logger keeps it.
            let _ = env_logger::Builder::new()
                .parse_filters(&filters)
                .try_init();
        }
    });
}

/// Without `c-logging`, the records go to whatever `log` backend the program installed.
#[cfg(not(feature = "c-logging"))]
fn init_logging() {}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".into())
}

/// Runs an exported function's body (see `ffi_boundary!`): no panic unwinds into C, every failure
/// becomes its status code and this thread's last error message, prefixed with `function`.
/// Everything, the logging set-up and the message store included, runs under `catch_unwind`,
/// and nothing here can abort: a call made while its thread is being torn down still returns its
/// status.
pub(crate) fn boundary(function: &str, body: impl FnOnce() -> Result<()>) -> MoriStatus {
    // An alias (src/ffi/aliases.rs) named the call: its messages use the name the caller used.
    let function = CALLED_AS
        .try_with(Cell::take)
        .ok()
        .flatten()
        .unwrap_or(function);
    let run = AssertUnwindSafe(|| {
        init_logging();
        let failure = match body() {
            Ok(()) => return MORI_OK,
            Err(failure) => failure,
        };
        let message = format!("{function}: {failure}");
        if matches!(
            failure,
            Failure::BufferTooSmall {
                size_query: true,
                ..
            }
        ) {
            // A size query is not a failure: the last error (and a pointer the caller took to
            // it before) stays as it was.
            log::trace!("{message} (a size query)");
        } else {
            log::debug!("{message}");
            set_last_error(message);
        }
        failure.status()
    });
    match catch_unwind(run) {
        Ok(status) => status,
        Err(payload) => {
            // Storing the message may itself fail during teardown: contain that too.
            let message = format!(
                "{function}: {}",
                Failure::Panic(panic_message(payload.as_ref()))
            );
            let _ = catch_unwind(AssertUnwindSafe(|| set_last_error(message)));
            MORI_ERR_PANIC
        }
    }
}

thread_local! {
    /// The name an alias was called by, for the export it forwards to (no destructor: readable
    /// while the thread exits).
    static CALLED_AS: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Runs `call`, an export, so that the messages of its boundary name `alias`: the name the
/// caller used. A call that fails the same way through either name gets the same message but
/// for that name.
pub(crate) fn called_as<R>(alias: &'static str, call: impl FnOnce() -> R) -> R {
    let _ = CALLED_AS.try_with(|name| name.set(Some(alias)));
    let result = call();
    let _ = CALLED_AS.try_with(|name| name.set(None));
    result
}

/// The name of the function this expands in (`mori_tp_plan`), for messages: each export names
/// itself once, in its signature.
macro_rules! function_name {
    () => {{
        fn here() {}
        let path = std::any::type_name_of_val(&here);
        let path = path.strip_suffix("::here").unwrap_or(path);
        path.rsplit("::").next().unwrap_or(path)
    }};
}

/// The body of an exported function: `ffi_boundary! { ...; Ok(()) }` runs it inside
/// [`boundary`], with the function's own name for its messages.
macro_rules! ffi_boundary {
    ($($body:tt)*) => {
        $crate::ffi::boundary::boundary($crate::ffi::boundary::function_name!(), || { $($body)* })
    };
}

pub(crate) use {ffi_boundary, function_name};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Side;
    use std::ffi::CStr;

    fn last_error() -> String {
        let message = last_error_ptr().expect("the thread is alive");
        // SAFETY: a valid NUL-terminated string owned by this thread's slot.
        unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_inside_the_boundary_becomes_mori_err_panic_with_its_message() {
        let status = boundary("test_fn", || panic!("boom at {}", 42));
        assert_eq!(status, MORI_ERR_PANIC);
        assert_eq!(last_error(), "test_fn: internal error: boom at 42");
    }

    #[test]
    fn successful_calls_leave_the_last_error_alone() {
        let status = boundary("failing", || Err(Error::ZeroKvHeads.into()));
        assert_eq!(status, MORI_ERR_TOPOLOGY);
        assert_eq!(boundary("ok", || Ok(())), MORI_OK);
        assert_eq!(
            last_error(),
            "failing: invalid topology: total_kv_heads is 0 (use 1 for MLA and MQA models)"
        );
    }

    fn exported_like() -> MoriStatus {
        ffi_boundary! { Err(Failure::NullArgument("x")) }
    }

    #[test]
    fn the_boundary_macro_names_the_function_it_runs_in() {
        assert_eq!(exported_like(), MORI_ERR_NULL_POINTER);
        assert_eq!(last_error(), "exported_like: null pointer: x is NULL");
    }

    #[test]
    fn every_status_class_maps_to_its_own_code() {
        let classes = [
            Failure::NullArgument("x"),
            Failure::Core(Error::ZeroPageSize),
            Failure::Core(Error::ZeroKvHeads),
            Failure::Core(Error::ItemLenNotWholeTokens {
                side: Side::Prefill,
                item_len: 3,
                page_size: 2,
            }),
            Failure::Core(Error::SliceOverflow {
                side: Side::Decode,
                offset: 1,
                width: 2,
                bytes_per_token: 2,
            }),
            Failure::Core(Error::NegativePage {
                side: Side::Prefill,
                page: -1,
                position: 0,
            }),
            Failure::BufferTooSmall {
                needed: 1,
                capacity: 0,
                size_query: true,
            },
            Failure::Core(Error::BackendUnavailable { reason: "x".into() }),
            Failure::Core(Error::Gpu {
                call: "hipX",
                status: 1,
                message: "x".into(),
                buffer: None,
                rect: None,
            }),
            Failure::Panic(String::new()),
            Failure::Core(Error::PoolFull {
                size: 1,
                block: 1,
                largest_free: 0,
                live_slots: 1,
                live_bytes: 1,
                capacity: 1,
                waited_ms: Some(5),
            }),
        ];
        let codes: Vec<MoriStatus> = classes.iter().map(Failure::status).collect();
        assert_eq!(codes, (1..=11).collect::<Vec<_>>());
    }

    #[test]
    fn a_size_query_leaves_the_last_error_and_its_pointer_alone() {
        let status = boundary("failing", || Err(Error::ZeroKvHeads.into()));
        assert_eq!(status, MORI_ERR_TOPOLOGY);
        let before = last_error_ptr().expect("the thread is alive");
        let query = boundary("sizing", || {
            Err(Failure::BufferTooSmall {
                needed: 3,
                capacity: 0,
                size_query: true,
            })
        });
        assert_eq!(query, MORI_ERR_BUFFER_TOO_SMALL);
        assert_eq!(last_error_ptr(), Some(before), "the message was replaced");
        assert!(last_error().starts_with("failing: invalid topology"));
        // An array that is really too small is a failure, with its message.
        let short = boundary("short", || {
            Err(Failure::BufferTooSmall {
                needed: 3,
                capacity: 1,
                size_query: false,
            })
        });
        assert_eq!(short, MORI_ERR_BUFFER_TOO_SMALL);
        assert_eq!(
            last_error(),
            "short: buffer too small: the result needs 3 entries, the output array holds 1"
        );
    }

    #[test]
    fn every_message_starts_with_its_class_label() {
        for failure in [
            Failure::NullArray { name: "a", len: 2 },
            Failure::Misaligned {
                name: "b",
                address: 3,
                align: 8,
            },
            Failure::UnknownFlags {
                flags: 8,
                unknown: 8,
            },
            Failure::ConflictingFlags { flags: 6 },
            Failure::BudgetWithMemcpy2d {
                flags: 0x40004,
                blocks: 4,
            },
            Failure::BufferTooSmall {
                needed: 2,
                capacity: 1,
                size_query: false,
            },
            Failure::UnknownPool(5),
        ] {
            let label = failure.class().unwrap().label();
            assert!(failure.to_string().starts_with(&format!("{label}: ")));
        }
    }
}
