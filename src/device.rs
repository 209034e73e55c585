//! Device discovery and the device-side error flag.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DevicePtr, SyncOnDrop};

use crate::error::{Error, Result};
use crate::tensor::buf_of;
use crate::validate::Buf;

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

/// What a kernel found wrong in a value the host could not check (word 0 of the flag).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultCode {
    /// A block-table entry outside `[0, num_blocks)`; row = request (decode) or token (gather),
    /// value = entry.
    BadBlockId,
    /// A negative seq_len, treated as 0; row = request, value = seq_len.
    NegativeSeqLen,
    /// seq_len > max_blocks_per_seq·block_size, clamped; row = request, value = seq_len.
    SeqLenTooLarge,
    /// A sparse id (not -1) outside `[0, num_blocks·block_size)`; row = token, value = id.
    BadSlotId,
    /// Gather: req_id outside `[0, batch)`; row = token, value = req_id.
    BadReqId,
    /// Append: a slot (not -1) outside the cache; row = token, value = low 32 bits.
    BadAppendSlot,
    /// A code this version does not know.
    Unknown(u32),
}

impl FaultCode {
    /// The code of a non-zero word 0.
    pub fn from_u32(code: u32) -> FaultCode {
        match code {
            1 => FaultCode::BadBlockId,
            2 => FaultCode::NegativeSeqLen,
            3 => FaultCode::SeqLenTooLarge,
            4 => FaultCode::BadSlotId,
            5 => FaultCode::BadReqId,
            6 => FaultCode::BadAppendSlot,
            c => FaultCode::Unknown(c),
        }
    }

    /// The numeric code (`mla_fault_code_t`).
    pub fn as_u32(self) -> u32 {
        match self {
            FaultCode::BadBlockId => 1,
            FaultCode::NegativeSeqLen => 2,
            FaultCode::SeqLenTooLarge => 3,
            FaultCode::BadSlotId => 4,
            FaultCode::BadReqId => 5,
            FaultCode::BadAppendSlot => 6,
            FaultCode::Unknown(c) => c,
        }
    }
}

impl std::fmt::Display for FaultCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FaultCode::BadBlockId => f.write_str("block-table entry outside [0, num_blocks)"),
            FaultCode::NegativeSeqLen => f.write_str("negative seq_len (treated as 0)"),
            FaultCode::SeqLenTooLarge => {
                f.write_str("seq_len > max_blocks_per_seq*block_size (clamped)")
            }
            FaultCode::BadSlotId => f.write_str("sparse slot id outside the cache"),
            FaultCode::BadReqId => f.write_str("req_id outside [0, batch)"),
            FaultCode::BadAppendSlot => f.write_str("append slot outside the cache"),
            FaultCode::Unknown(c) => write!(f, "unknown fault code {c}"),
        }
    }
}

/// A caller-owned device flag of 4 u32 words `{code, row, value, 0}` where kernels record
/// the first fault they find in values the host cannot see (first fault wins).
///
/// Kernels write it through a shared reference: use one flag on one stream at a time, and
/// [`check`](ErrorFlag::check) it on the stream whose calls wrote it.
#[derive(Debug)]
pub struct ErrorFlag {
    words: CudaSlice<u32>,
}

impl ErrorFlag {
    /// Allocates a cleared flag on `stream`'s device.
    pub fn new(stream: &Arc<CudaStream>) -> Result<ErrorFlag> {
        Ok(ErrorFlag {
            words: stream.alloc_zeros::<u32>(4)?,
        })
    }

    /// Clears the flag with an asynchronous 16-byte memset on `stream` (graph-capturable).
    pub fn reset(&self, stream: &CudaStream) -> Result<()> {
        stream.context().bind_to_thread()?;
        let (ptr, _guard) = self.words.device_ptr(stream);
        // SAFETY: the flag owns 16 bytes at `ptr`; the memset is ordered on `stream`.
        unsafe { result::memset_d8_async(ptr, 0, 16, stream.cu_stream()) }?;
        Ok(())
    }

    /// Synchronizes `stream` and reads the 4 words.
    pub fn read(&self, stream: &CudaStream) -> Result<[u32; 4]> {
        stream.context().bind_to_thread()?;
        let mut words = [0u32; 4];
        {
            let (ptr, _guard) = self.words.device_ptr(stream);
            // SAFETY: 16 bytes to a host array that outlives the synchronize below.
            unsafe { result::memcpy_dtoh_async(&mut words[..], ptr, stream.cu_stream()) }?;
        }
        stream.synchronize()?;
        Ok(words)
    }

    /// Synchronizes `stream`; `Err(DeviceFault)` if a kernel recorded a fault.
    pub fn check(&self, stream: &CudaStream) -> Result<()> {
        ErrorFlag::interpret(self.read(stream)?)
    }

    /// What the 4 words of a flag mean: `Ok` when word 0 is 0.
    pub fn interpret(words: [u32; 4]) -> Result<()> {
        match words[0] {
            0 => Ok(()),
            code => Err(Error::DeviceFault {
                code: FaultCode::from_u32(code),
                row: words[1],
                value: words[2] as i32,
            }),
        }
    }

    /// The 4 device words, e.g. to pass to the C ABI yourself.
    pub fn raw(&self) -> &CudaSlice<u32> {
        &self.words
    }
}

/// Device address (0 = NULL), description and cudarc guard of an optional error flag.
pub(crate) fn bind_flag<'s>(
    flag: Option<&'s ErrorFlag>,
    stream: &'s CudaStream,
) -> (u64, Option<Buf>, Option<SyncOnDrop<'s>>) {
    match flag {
        Some(f) => {
            let (ptr, guard) = f.words.device_ptr(stream);
            (ptr, Some(buf_of(&f.words, ptr)), Some(guard))
        }
        None => (0, None, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::mla_fault_code_t as F;

    #[test]
    fn fault_codes_match_the_header() {
        for (c, f) in [
            (F::MLA_FAULT_BAD_BLOCK_ID, FaultCode::BadBlockId),
            (F::MLA_FAULT_NEGATIVE_SEQ_LEN, FaultCode::NegativeSeqLen),
            (F::MLA_FAULT_SEQ_LEN_TOO_LARGE, FaultCode::SeqLenTooLarge),
            (F::MLA_FAULT_BAD_SLOT_ID, FaultCode::BadSlotId),
            (F::MLA_FAULT_BAD_REQ_ID, FaultCode::BadReqId),
            (F::MLA_FAULT_BAD_APPEND_SLOT, FaultCode::BadAppendSlot),
        ] {
            assert_eq!(FaultCode::from_u32(c as u32), f);
            assert_eq!(f.as_u32(), c as u32);
        }
        assert_eq!(FaultCode::from_u32(99), FaultCode::Unknown(99));
    }

    #[test]
    fn interpret_words() {
        assert_eq!(ErrorFlag::interpret([0, 5, 7, 0]), Ok(()));
        assert_eq!(
            ErrorFlag::interpret([2, 3, (-5i32) as u32, 0]),
            Err(Error::DeviceFault {
                code: FaultCode::NegativeSeqLen,
                row: 3,
                value: -5
            })
        );
    }
}
