//! Device discovery.

use std::sync::OnceLock;

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{result, CudaContext};

use crate::error::Result;

/// Whether this build of the crate holds its kernels: `false` when it was built without nvcc
/// (`MLA_NO_KERNELS=1`, docs.rs, or no nvcc found, which the build reports only as a warning
/// that cargo hides for git and registry dependencies); every call then returns
/// [`Error::KernelsNotBuilt`](crate::Error::KernelsNotBuilt). An engine can assert it at
/// start-up, or build with `MLA_REQUIRE_KERNELS=1` to make a missing nvcc a build error.
pub const KERNELS_BUILT: bool = !cfg!(mla_no_kernels);

/// Whether CUDA is usable here: the driver library (libcuda) loads, initializes (`cuInit`)
/// and reports at least one device. Computed once.
///
/// Check this before creating a cudarc context: where cudarc loads libcuda at run time (its
/// `dynamic-loading`, the default), it panics instead of returning an error when there is
/// none. The answer does not depend on how the application's cudarc reaches the driver
/// (loaded at run time, or linked dynamically or statically: then the program does not
/// start without libcuda). `true` does not promise a context: creating one may still fail
/// (a device in exclusive mode, out of memory).
pub fn cuda_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // The library first: cudarc's first call would panic without it. A stub libcuda (the
        // toolkit's lib/stubs) loads but fails cuInit.
        driver_library_loads()
            && result::init().is_ok()
            && result::device::get_count().is_ok_and(|n| n > 0)
    })
}

/// Whether the driver library loads under a name cudarc's run-time loading also tries (so
/// that cudarc then finds it too). Not cudarc's `is_culib_present`: that exists only when
/// cudarc loads the driver at run time, and the application may link it instead. The library
/// stays loaded (cudarc loads it next; where the program links it, this finds that copy).
fn driver_library_loads() -> bool {
    #[cfg(unix)]
    {
        use std::ffi::{c_char, c_int, c_void};
        extern "C" {
            fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        }
        const RTLD_LAZY: c_int = 1;
        [c"libcuda.so.1", c"libcuda.so"]
            .iter()
            // SAFETY: dlopen with a NUL-terminated name.
            .any(|name| !unsafe { dlopen(name.as_ptr(), RTLD_LAZY) }.is_null())
    }
    #[cfg(windows)]
    {
        use std::ffi::{c_char, c_void};
        #[link(name = "kernel32")]
        extern "system" {
            fn LoadLibraryA(name: *const c_char) -> *mut c_void;
        }
        // SAFETY: LoadLibraryA with a NUL-terminated name.
        !unsafe { LoadLibraryA(c"nvcuda.dll".as_ptr()) }.is_null()
    }
    #[cfg(not(any(unix, windows)))]
    {
        false
    }
}

/// The properties of a GPU that the schedule and the benches care about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// (major, minor): (12, 0) for sm_120, (9, 0) for sm_90.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: i32,
    /// Most dynamic shared memory one block may opt into, in bytes.
    pub max_shared_memory_per_block_optin: i32,
    /// Shared memory per SM, in bytes.
    pub shared_memory_per_sm: i32,
    /// L2 cache size, in bytes.
    pub l2_cache_bytes: i32,
}

impl DeviceInfo {
    /// Reads the properties of `ctx`'s device.
    pub fn query(ctx: &CudaContext) -> Result<DeviceInfo> {
        Ok(DeviceInfo {
            ordinal: ctx.ordinal(),
            name: ctx.name()?,
            compute_capability: ctx.compute_capability()?,
            sm_count: ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            max_shared_memory_per_block_optin: ctx
                .attribute(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            shared_memory_per_sm: ctx
                .attribute(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
            l2_cache_bytes: ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
        })
    }

    /// The `sm_XY` name of the compute capability, e.g. `"sm_120"`.
    pub fn sm_name(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!("sm_{major}{minor}")
    }
}
