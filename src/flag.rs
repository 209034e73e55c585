//! The device-side error flag: where kernels record the first bad value they meet.

use std::sync::Arc;

use cudarc::driver::{
    result, CudaEvent, CudaSlice, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut,
    PinnedHostSlice, SyncOnDrop,
};

use crate::buffer::{self, DeviceWrite};
use crate::error::{Error, Result};
use crate::ffi::mla_fault_code_t as F;
use crate::plan::refuse_while_capturing;
use crate::validate::Buf;

/// What a kernel found wrong in a value the host could not check (word 0 of the flag).
///
/// Such values are never read out of bounds: they are skipped or clamped as each code says,
/// and the first one is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultCode {
    /// A block-table entry outside `[0, num_blocks)`, skipped; row = request (decode) or
    /// token (gather), value = entry.
    BadBlockId,
    /// A negative seq_len, treated as 0; row = request (dense decode and gather), value =
    /// seq_len.
    NegativeSeqLen,
    /// seq_len > max_blocks_per_seq·block_size, clamped; row = request (dense decode and
    /// gather), value = seq_len.
    SeqLenTooLarge,
    /// A sparse id (not -1) outside `[0, num_blocks·block_size)`, skipped; row = token,
    /// value = id.
    BadSlotId,
    /// Gather: req_id outside `[0, batch)`, the row's slots are -1; row = token, value =
    /// req_id.
    BadReqId,
    /// Append: a slot (not -1) outside the cache, skipped; row = token, value = the slot
    /// (all 64 bits).
    BadAppendSlot,
    /// Sparse: a `topk_len` outside `0..=topk`, clamped; row = token, value = topk_len.
    BadTopkLen,
    /// Per-tensor fp8 (append and decode): the cache's scale is not a finite number > 0
    /// (e.g. a scale buffer never written: 0), used as it is; row = 0, value = its fp32 bits
    /// as a u32, zero-extended (`f32::from_bits(value as u32)`).
    BadKvScale,
    /// A code this version does not know.
    Unknown(u32),
}

impl FaultCode {
    /// Every known code with its `mla_fault_code_t` value (the C header's, through bindgen).
    const CODES: [(FaultCode, u32); 8] = [
        (FaultCode::BadBlockId, F::MLA_FAULT_BAD_BLOCK_ID as u32),
        (
            FaultCode::NegativeSeqLen,
            F::MLA_FAULT_NEGATIVE_SEQ_LEN as u32,
        ),
        (
            FaultCode::SeqLenTooLarge,
            F::MLA_FAULT_SEQ_LEN_TOO_LARGE as u32,
        ),
        (FaultCode::BadSlotId, F::MLA_FAULT_BAD_SLOT_ID as u32),
        (FaultCode::BadReqId, F::MLA_FAULT_BAD_REQ_ID as u32),
        (
            FaultCode::BadAppendSlot,
            F::MLA_FAULT_BAD_APPEND_SLOT as u32,
        ),
        (FaultCode::BadTopkLen, F::MLA_FAULT_BAD_TOPK_LEN as u32),
        (FaultCode::BadKvScale, F::MLA_FAULT_BAD_KV_SCALE as u32),
    ];

    /// The code of a non-zero word 0.
    pub fn from_u32(code: u32) -> FaultCode {
        Self::CODES
            .iter()
            .find(|(_, c)| *c == code)
            .map_or(FaultCode::Unknown(code), |(f, _)| *f)
    }

    /// The numeric code (`mla_fault_code_t`).
    pub fn as_u32(self) -> u32 {
        match self {
            FaultCode::Unknown(c) => c,
            known => Self::CODES
                .iter()
                .find(|(f, _)| *f == known)
                .map_or(0, |(_, c)| *c),
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
            FaultCode::BadTopkLen => f.write_str("topk_len outside [0, topk] (clamped)"),
            FaultCode::BadKvScale => {
                f.write_str("per-tensor fp8 scale not a finite number > 0 (used as it is)")
            }
            FaultCode::Unknown(c) => write!(f, "unknown fault code {c}"),
        }
    }
}

/// A caller-owned device flag of 4 u32 words `{code, row, value low 32 bits, value high 32
/// bits}` where kernels record the first fault they find in values the host cannot see
/// (first fault wins; a 32-bit value is stored sign-extended, so word 3 is `0xffffffff` for
/// a negative one; except [`FaultCode::BadKvScale`]'s, the scale's bits as a u32).
///
/// Every bad value the device meets is both handled (skipped or clamped, docs/DESIGN.md §6)
/// and recorded here when a flag is given.
///
/// Kernels write it, so the calls take it as `&mut`: one flag cannot be handed to two calls
/// at once. Use a flag per stream; nothing resets it but [`reset`](ErrorFlag::reset).
///
/// Reading it:
/// - [`check`](ErrorFlag::check) / [`read`](ErrorFlag::read) synchronize the stream: simple,
///   off the hot path;
/// - [`read_async`](ErrorFlag::read_async) copies the words to pinned host memory behind an
///   event and returns at once; poll the [`FlagReading`] later (a pipelined engine reads
///   step `n`'s flag while step `n + 1` runs);
/// - [`copy_to`](ErrorFlag::copy_to) copies the words to a device buffer of yours, on the
///   stream: it can be captured in a CUDA graph, e.g. to keep one flag snapshot per step.
///
/// Making a flag allocates: make flags before capturing a graph.
#[derive(Debug)]
pub struct ErrorFlag {
    words: CudaSlice<u32>,
}

impl ErrorFlag {
    /// Allocates a cleared flag on `stream`'s device (refused while `stream` is capturing).
    pub fn new(stream: &Arc<CudaStream>) -> Result<ErrorFlag> {
        refuse_while_capturing(stream, "ErrorFlag::new")?;
        Ok(ErrorFlag {
            words: stream.alloc_zeros::<u32>(4)?,
        })
    }

    /// Clears the flag with an asynchronous 16-byte memset on `stream` (graph-capturable).
    pub fn reset(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.on_device_of(stream)?;
        stream.context().bind_to_thread()?;
        let (ptr, _guard) = self.words.device_ptr_mut(stream);
        // SAFETY: the flag owns 16 bytes at `ptr`; the memset is ordered on `stream`.
        unsafe { result::memset_d8_async(ptr, 0, 16, stream.cu_stream()) }?;
        Ok(())
    }

    /// Synchronizes `stream` and reads the 4 words.
    pub fn read(&self, stream: &Arc<CudaStream>) -> Result<[u32; 4]> {
        self.on_device_of(stream)?;
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
    pub fn check(&self, stream: &Arc<CudaStream>) -> Result<()> {
        ErrorFlag::interpret(self.read(stream)?)
    }

    /// Copies the 4 words into `dst[0..4]` on `stream`, device to device: no host sync,
    /// graph-capturable. Errors name `dst` (too short, another device) or `stream`.
    pub fn copy_to(&self, stream: &Arc<CudaStream>, dst: &mut impl DeviceWrite<u32>) -> Result<()> {
        self.on_device_of(stream)?;
        let device = stream.context().ordinal();
        let mut dst_view = buffer::view_mut_of(dst);
        let dst = buffer::write(&mut dst_view, stream);
        if dst.buf.device != device {
            return Err(Error::invalid(
                "dst",
                format!(
                    "lives on device {}, the stream is on device {device}",
                    dst.buf.device
                ),
            ));
        }
        if dst.buf.bytes < 16 {
            return Err(Error::invalid(
                "dst",
                format!("holds {} words, the flag needs 4", dst.buf.bytes / 4),
            ));
        }
        stream.context().bind_to_thread()?;
        let (src, _guard) = self.words.device_ptr(stream);
        // SAFETY: 16 bytes from the flag to a checked device buffer, ordered on `stream`.
        unsafe { result::memcpy_dtod_async(dst.addr, src, 16, stream.cu_stream()) }?;
        Ok(())
    }

    /// Starts a non-blocking read: copies the words into pinned host memory on `stream`
    /// behind an event and returns at once. Allocates the [`FlagReading`] (pinned memory and
    /// an event) each call, and dropping a reading whose copy is still in flight blocks
    /// until it lands: in a step loop, make one reading with [`FlagReading::new`] and use
    /// [`read_async_into`](ErrorFlag::read_async_into).
    pub fn read_async(&self, stream: &Arc<CudaStream>) -> Result<FlagReading> {
        let mut reading = FlagReading::new(stream)?;
        self.read_async_into(stream, &mut reading)?;
        Ok(reading)
    }

    /// Like [`read_async`](ErrorFlag::read_async), into an existing `reading` (no
    /// allocation, no host synchronization). The new copy is ordered after the reading's
    /// previous one. The flag keeps a fault until [`reset`](ErrorFlag::reset), so starting a
    /// new read while the last is still in flight loses nothing: the new one sees it too.
    ///
    /// ```ignore
    /// let mut reading = FlagReading::new(&stream)?;          // once, with the flag
    /// loop {
    ///     // ... the step's launches, with Some(&mut flag) ...
    ///     if let Some(r) = reading.try_get() { r?; }          // the last read, if it landed
    ///     flag.read_async_into(&stream, &mut reading)?;        // this step's, polled next step
    /// }
    /// ```
    pub fn read_async_into(
        &self,
        stream: &Arc<CudaStream>,
        reading: &mut FlagReading,
    ) -> Result<()> {
        self.on_device_of(stream)?;
        if reading.done.context() != stream.context() {
            return Err(Error::invalid(
                "reading",
                "made for another CUDA context than the stream's",
            ));
        }
        stream.context().bind_to_thread()?;
        // A copy still in flight from an earlier read on another stream lands first.
        stream.wait(&reading.done)?;
        {
            let host = reading.host.as_mut_slice()?;
            let (ptr, _guard) = self.words.device_ptr(stream);
            // SAFETY: 16 bytes into pinned memory owned by `reading`, which cannot be read
            // (`try_get`, `wait`) before the event recorded below completes.
            unsafe { result::memcpy_dtoh_async(&mut host[..4], ptr, stream.cu_stream()) }?;
        }
        reading.done.record(stream)?;
        Ok(())
    }

    /// What the 4 words of a flag mean: `Ok` when word 0 is 0, else the fault, with the
    /// value put together from words 2 (low) and 3 (high).
    pub fn interpret(words: [u32; 4]) -> Result<()> {
        match words[0] {
            0 => Ok(()),
            code => Err(Error::DeviceFault {
                code: FaultCode::from_u32(code),
                row: words[1],
                value: ((words[3] as u64) << 32 | words[2] as u64) as i64,
            }),
        }
    }

    /// The 4 device words, e.g. to pass to the C ABI yourself.
    pub fn raw(&self) -> &CudaSlice<u32> {
        &self.words
    }

    /// The 4 device words, writable (e.g. to set a fault by hand in a test). A view, not the
    /// allocation itself: the flag's calls rely on its 16 bytes, which a view cannot replace.
    pub fn raw_mut(&mut self) -> CudaViewMut<'_, u32> {
        self.words.as_view_mut()
    }

    fn on_device_of(&self, stream: &CudaStream) -> Result<()> {
        let (mine, theirs) = (self.words.context().ordinal(), stream.context().ordinal());
        if mine != theirs {
            return Err(Error::invalid(
                "stream",
                format!("on device {theirs}, the flag lives on device {mine}"),
            ));
        }
        Ok(())
    }
}

/// A flag read in flight ([`ErrorFlag::read_async`]): 4 words in pinned host memory and the
/// event that says they arrived.
///
/// A reading that was never filled reads as a clear flag. Dropping a reading whose copy is
/// still in flight blocks until the copy lands (the pinned memory must outlive it): keep one
/// per flag and refill it with [`ErrorFlag::read_async_into`].
#[derive(Debug)]
pub struct FlagReading {
    host: PinnedHostSlice<u32>,
    done: CudaEvent,
}

impl FlagReading {
    /// A cleared reading for flags read on streams of `stream`'s context, to fill with
    /// [`ErrorFlag::read_async_into`]; allocates 16 bytes of pinned host memory (refused
    /// while `stream` is capturing).
    pub fn new(stream: &Arc<CudaStream>) -> Result<FlagReading> {
        refuse_while_capturing(stream, "FlagReading::new")?;
        let ctx = stream.context();
        // SAFETY: the memory is initialized right below, before anything reads it.
        let mut host = unsafe { ctx.alloc_pinned_with_flags::<u32>(4, 0) }?;
        host.as_mut_slice()?.fill(0);
        Ok(FlagReading {
            host,
            done: ctx.new_event(None)?,
        })
    }

    /// The words if the copy has arrived, without blocking; `None` while it is in flight.
    pub fn try_words(&self) -> Option<Result<[u32; 4]>> {
        match self.done.try_is_complete() {
            Ok(true) => Some(self.words_now()),
            Ok(false) => None,
            Err(e) => Some(Err(e.into())),
        }
    }

    /// Without blocking: `None` while the copy is in flight, else what the flag said
    /// (`Ok(())`, or `Err(DeviceFault)`).
    pub fn try_get(&self) -> Option<Result<()>> {
        self.try_words().map(|w| w.and_then(ErrorFlag::interpret))
    }

    /// Blocks until the copy has arrived, then says what the flag said.
    pub fn wait(&self) -> Result<()> {
        ErrorFlag::interpret(self.wait_words()?)
    }

    /// Blocks until the copy has arrived, then returns the 4 words.
    pub fn wait_words(&self) -> Result<[u32; 4]> {
        self.done.synchronize()?;
        self.words_now()
    }

    fn words_now(&self) -> Result<[u32; 4]> {
        let s = self.host.as_slice()?;
        Ok([s[0], s[1], s[2], s[3]])
    }
}

impl Drop for FlagReading {
    /// Waits for a copy still in flight before the pinned memory is freed.
    fn drop(&mut self) {
        let ctx = self.done.context().clone();
        ctx.record_err(self.done.synchronize());
    }
}

/// Device address (0 = NULL), description and cudarc guard of an optional error flag.
pub(crate) fn bind_flag<'s>(
    flag: Option<&'s mut ErrorFlag>,
    stream: &'s CudaStream,
) -> (u64, Option<Buf>, Option<SyncOnDrop<'s>>) {
    match flag {
        Some(f) => {
            let device = f.words.context().ordinal();
            let bytes = f.words.num_bytes();
            let (addr, guard) = f.words.device_ptr_mut(stream);
            let buf = Buf {
                addr,
                bytes,
                device,
            };
            (addr, Some(buf), Some(guard))
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
        assert_eq!(FaultCode::from_u32(7), FaultCode::BadTopkLen);
        assert_eq!(FaultCode::BadTopkLen.as_u32(), 7);
        assert_eq!(
            FaultCode::from_u32(crate::reference::fault_code::BAD_TOPK_LEN),
            FaultCode::BadTopkLen
        );
        assert_eq!(FaultCode::from_u32(99), FaultCode::Unknown(99));
    }

    #[test]
    fn interpret_words() {
        assert_eq!(ErrorFlag::interpret([0, 5, 7, 0]), Ok(()));
        // A negative 32-bit value, sign-extended into word 3.
        assert_eq!(
            ErrorFlag::interpret([2, 3, (-5i32) as u32, u32::MAX]),
            Err(Error::DeviceFault {
                code: FaultCode::NegativeSeqLen,
                row: 3,
                value: -5
            })
        );
        // A 64-bit append slot: 2^33 + 5 is not 5.
        let slot: i64 = (1 << 33) + 5;
        assert_eq!(
            ErrorFlag::interpret([6, 0, slot as u32, (slot >> 32) as u32]),
            Err(Error::DeviceFault {
                code: FaultCode::BadAppendSlot,
                row: 0,
                value: slot
            })
        );
        assert_eq!(
            ErrorFlag::interpret([7, 1, 5000, 0]),
            Err(Error::DeviceFault {
                code: FaultCode::BadTopkLen,
                row: 1,
                value: 5000
            })
        );
    }
}
