//! Device discovery and the device-side error flag.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DevicePtr, SyncOnDrop};

use crate::error::{Error, Result};
use crate::ffi;
use crate::tensor::buf_of;
use crate::validate::Buf;

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
    // The codes are the C header's `mla_fault_code_t` (through bindgen): defined once.
    const BAD_BLOCK_ID: u32 = ffi::mla_fault_code_t::MLA_FAULT_BAD_BLOCK_ID as u32;
    const NEGATIVE_SEQ_LEN: u32 = ffi::mla_fault_code_t::MLA_FAULT_NEGATIVE_SEQ_LEN as u32;
    const SEQ_LEN_TOO_LARGE: u32 = ffi::mla_fault_code_t::MLA_FAULT_SEQ_LEN_TOO_LARGE as u32;
    const BAD_SLOT_ID: u32 = ffi::mla_fault_code_t::MLA_FAULT_BAD_SLOT_ID as u32;
    const BAD_REQ_ID: u32 = ffi::mla_fault_code_t::MLA_FAULT_BAD_REQ_ID as u32;
    const BAD_APPEND_SLOT: u32 = ffi::mla_fault_code_t::MLA_FAULT_BAD_APPEND_SLOT as u32;

    /// The code of a non-zero word 0.
    pub fn from_u32(code: u32) -> FaultCode {
        match code {
            Self::BAD_BLOCK_ID => FaultCode::BadBlockId,
            Self::NEGATIVE_SEQ_LEN => FaultCode::NegativeSeqLen,
            Self::SEQ_LEN_TOO_LARGE => FaultCode::SeqLenTooLarge,
            Self::BAD_SLOT_ID => FaultCode::BadSlotId,
            Self::BAD_REQ_ID => FaultCode::BadReqId,
            Self::BAD_APPEND_SLOT => FaultCode::BadAppendSlot,
            c => FaultCode::Unknown(c),
        }
    }

    /// The numeric code (`mla_fault_code_t`).
    pub fn as_u32(self) -> u32 {
        match self {
            FaultCode::BadBlockId => Self::BAD_BLOCK_ID,
            FaultCode::NegativeSeqLen => Self::NEGATIVE_SEQ_LEN,
            FaultCode::SeqLenTooLarge => Self::SEQ_LEN_TOO_LARGE,
            FaultCode::BadSlotId => Self::BAD_SLOT_ID,
            FaultCode::BadReqId => Self::BAD_REQ_ID,
            FaultCode::BadAppendSlot => Self::BAD_APPEND_SLOT,
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

    #[cfg(test)]
    pub(crate) fn words_mut(&mut self) -> &mut CudaSlice<u32> {
        &mut self.words
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
