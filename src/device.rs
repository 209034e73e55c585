//! Device discovery.

use std::sync::OnceLock;

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::CudaContext;

use crate::error::Result;

/// Whether the CUDA driver library (libcuda) can be loaded.
///
/// cudarc panics when it is asked to create a context without libcuda: check this first.
/// `true` does not promise a usable GPU (creating a context may still fail).
pub fn cuda_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the driver library.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
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
