//! The crate's error type and the mapping of the C ABI's status codes.

use cudarc::driver::DriverError;

use crate::ffi;
use crate::flag::FaultCode;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a call, naming the argument and why.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// An argument failed a host-side check (shape, stride, alignment, size, format, plan).
    InvalidArgument {
        /// The argument: a parameter of the function that was called, or a field of its
        /// argument struct (`"q"`, `"kv_cache"`, `"block_table"`, `"num_tokens"`, ...;
        /// [`validate`](crate::validate) lists them per call).
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The C layer rejected a call (`MLA_STATUS_INVALID_ARGUMENT`). From the safe API, whose
    /// own checks run first and answer [`Error::InvalidArgument`], this means the two
    /// disagree: a bug in this crate. From [`status_to_result`] over a raw FFI call, it is
    /// the caller's argument that `reason` names.
    Rejected {
        /// The C ABI function.
        call: &'static str,
        /// What the C layer said.
        reason: String,
    },
    /// The crate was built without nvcc, so it holds no kernels.
    KernelsNotBuilt,
    /// Valid but not implemented by this build or version (also: a GPU whose architecture
    /// this build has no kernels for; rebuild with it in `MLA_CUDA_ARCHS`).
    Unsupported(String),
    /// CUDA-graph capture: [`capture_graph`](crate::capture_graph) refused to start (event
    /// tracking still on, the stream already capturing) or the capture failed, or a call
    /// that allocates (a plan, a flag) was made on a capturing stream.
    Capture(String),
    /// A CUDA runtime call inside the C layer failed.
    Cuda {
        /// The C ABI function that reported it.
        call: &'static str,
        /// The `cudaError_t` (`mla_last_cuda_error()`).
        code: i32,
    },
    /// A CUDA driver call made through cudarc failed.
    Driver(DriverError),
    /// No CUDA driver or device.
    NoDevice,
    /// A kernel recorded a fault in an [`ErrorFlag`](crate::ErrorFlag).
    DeviceFault {
        /// What the kernel found.
        code: FaultCode,
        /// A request or a token index, per code: [`FaultCode`] says which (a gather's
        /// seq_len faults name the request, its other faults the token). One flag per call
        /// kind tells which call it came from.
        row: u32,
        /// The offending value, 64 bits wide (flag words 2 and 3: low and high halves).
        value: i64,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(arg: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            arg,
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::InvalidArgument { arg, reason } => {
                write!(f, "invalid argument `{arg}`: {reason}")
            }
            Error::KernelsNotBuilt => f.write_str(
                "mla-decode was built without nvcc, so it has no CUDA kernels: install a CUDA \
                 toolkit >= 12.8 (or the nvidia-cuda-nvcc 13.0 wheels), set NVCC=/path/to/nvcc \
                 (or CUDA_HOME), unset MLA_NO_KERNELS and rebuild",
            ),
            Error::Rejected { call, reason } => write!(
                f,
                "{call} rejected the call: {reason} (if it came through the safe API, whose \
                 checks passed it, that is a bug in mla-decode)"
            ),
            Error::Unsupported(what) => write!(f, "unsupported: {what}"),
            Error::Capture(what) => write!(f, "CUDA graph capture: {what}"),
            Error::Cuda { call, code } => {
                write!(f, "{call}: CUDA runtime error {code} (cudaError_t)")
            }
            // DriverError's own Debug/Display call into libcuda; print the enum instead.
            Error::Driver(e) => write!(f, "CUDA driver error {:?}", e.0),
            Error::NoDevice => f.write_str("no CUDA driver or device"),
            Error::DeviceFault { code, row, value } => {
                write!(f, "device fault: {code} (row {row}, value {value})")
            }
        }
    }
}

impl std::error::Error for Error {}

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Error {
        Error::Driver(e)
    }
}

/// The message of the last C ABI call on this thread that failed (`mla_last_error()`:
/// "function: field: why"), empty after a success.
pub fn last_c_error() -> String {
    // SAFETY: mla_last_error returns a NUL-terminated thread-local string, never NULL, valid
    // until the next call on this thread; it is copied at once.
    unsafe { std::ffi::CStr::from_ptr(ffi::mla_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Maps a raw `mla_status_t` value returned by C ABI function `call`, just now on this
/// thread, to a `Result` (the reason comes from the C layer's `mla_last_error()`).
pub fn status_to_result(call: &'static str, status: u32) -> Result<()> {
    const OK: u32 = ffi::mla_status_t::MLA_STATUS_OK.0;
    const INVALID: u32 = ffi::mla_status_t::MLA_STATUS_INVALID_ARGUMENT.0;
    const UNSUPPORTED: u32 = ffi::mla_status_t::MLA_STATUS_UNSUPPORTED.0;
    const NO_DEVICE: u32 = ffi::mla_status_t::MLA_STATUS_NO_DEVICE.0;
    const NOT_BUILT: u32 = ffi::mla_status_t::MLA_STATUS_NOT_BUILT.0;
    const WRONG_DEVICE: u32 = ffi::mla_status_t::MLA_STATUS_WRONG_DEVICE.0;
    const CUDA_ERROR: u32 = ffi::mla_status_t::MLA_STATUS_CUDA_ERROR.0;
    if status == OK {
        return Ok(());
    }
    let reason = last_c_error();
    Err(match status {
        INVALID => Error::Rejected { call, reason },
        UNSUPPORTED => Error::Unsupported(reason),
        NO_DEVICE => Error::NoDevice,
        NOT_BUILT => Error::KernelsNotBuilt,
        WRONG_DEVICE => Error::invalid("plan", reason),
        CUDA_ERROR => Error::Cuda {
            call,
            // SAFETY: a plain thread-local read.
            code: unsafe { ffi::mla_last_cuda_error() },
        },
        s => Error::Unsupported(format!("{call}: status {s}, unknown to this version")),
    })
}

/// Maps the `mla_status_t` returned by C ABI function `call` to a `Result`.
pub(crate) fn check(call: &'static str, status: ffi::mla_status_t) -> Result<()> {
    status_to_result(call, status.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(status_to_result("f", 0), Ok(()));
        assert_eq!(status_to_result("f", 4), Err(Error::KernelsNotBuilt));
        assert_eq!(status_to_result("f", 3), Err(Error::NoDevice));
        assert!(matches!(
            status_to_result("mla_dense_decode", 6),
            Err(Error::Cuda {
                call: "mla_dense_decode",
                ..
            })
        ));
        assert!(matches!(
            status_to_result("f", 5),
            Err(Error::InvalidArgument { arg: "plan", .. })
        ));
        assert!(matches!(
            status_to_result("f", 1),
            Err(Error::Rejected { call: "f", .. })
        ));
        assert!(matches!(
            status_to_result("f", 2),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            status_to_result("f", 77),
            Err(Error::Unsupported(_))
        ));
        assert_eq!(
            check("f", ffi::mla_status_t::MLA_STATUS_NOT_BUILT),
            Err(Error::KernelsNotBuilt)
        );
    }

    #[test]
    fn messages() {
        let m = Error::KernelsNotBuilt.to_string();
        assert!(m.contains("nvcc") && m.contains("NVCC") && m.contains("12.8"));
        let m = Error::invalid("q", "too short").to_string();
        assert_eq!(m, "invalid argument `q`: too short");
    }
}
