//! The split plan: a schedule made once per shape, plus the workspace it sizes.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, SyncOnDrop};

use crate::error::{check, Result};
use crate::ffi;
use crate::validate::{self, PlanDesc};

/// The shape a dense plan is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DenseShape {
    /// Requests.
    pub batch: usize,
    /// Query rows per request, 1..=8.
    pub q_len: usize,
    /// Query heads, 1..=128.
    pub num_heads: usize,
    /// Cache rows per block: 16, 32, 64 or 128.
    pub block_size: usize,
    /// Columns of the block table: the longest sequence is `max_blocks_per_seq · block_size`.
    pub max_blocks_per_seq: usize,
}

/// The shape a sparse plan is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SparseShape {
    /// Query rows `T` (MTP tokens are more rows).
    pub num_tokens: usize,
    /// Query heads, 1..=128.
    pub num_heads: usize,
    /// Indices per row, 1..=4096.
    pub topk: usize,
}

/// Dense or sparse, with its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlanKind {
    /// For [`dense_decode`](crate::dense_decode).
    Dense(DenseShape),
    /// For [`sparse_decode`](crate::sparse_decode).
    Sparse(SparseShape),
}

/// Options of a schedule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PlanOptions {
    /// Pad the shared-memory request so that an sm_90 SM holds as few blocks as an sm_120
    /// SM: measure on an H200 what ships for sm_120.
    pub sm120_occupancy: bool,
}

/// A schedule (the grid and split-KV parts for one shape on one device) with the split
/// workspace it sizes: made once per shape, used by every decode call of that shape.
///
/// There is nothing to update per step: every decode call derives the split of its work
/// from the lengths it is given (`seq_lens` / `topk_len`), in each CTA, on the device.
/// Decoding allocates nothing and never synchronizes the host, so a whole step can be
/// captured in a CUDA graph and replayed with new lengths and tables written into the same
/// buffers. To capture on a context with several streams, disable
/// cudarc's event tracking first (`CudaContext::disable_event_tracking`, as cudarc's own graph
/// tests do): its per-buffer events would make the capture wait on work recorded outside it.
///
/// The workspace is scratch for one call at a time: use a plan on one stream (or order the
/// streams yourself).
#[derive(Debug)]
pub struct DecodePlan {
    kind: PlanKind,
    schedule: ffi::mla_schedule_t,
    workspace: CudaSlice<f32>,
}

impl DecodePlan {
    /// A plan for dense paged decode of `shape` on `stream`'s device.
    pub fn dense(
        stream: &Arc<CudaStream>,
        shape: DenseShape,
        options: PlanOptions,
    ) -> Result<Self> {
        validate::dense_shape(&shape)?;
        let max_len = shape.max_blocks_per_seq * shape.block_size;
        Self::new(
            stream,
            PlanKind::Dense(shape),
            [shape.batch, shape.q_len, shape.num_heads, max_len],
            options,
        )
    }

    /// A plan for sparse decode of `shape` on `stream`'s device.
    pub fn sparse(
        stream: &Arc<CudaStream>,
        shape: SparseShape,
        options: PlanOptions,
    ) -> Result<Self> {
        validate::sparse_shape(&shape)?;
        Self::new(
            stream,
            PlanKind::Sparse(shape),
            [shape.num_tokens, 1, shape.num_heads, shape.topk],
            options,
        )
    }

    fn new(
        stream: &Arc<CudaStream>,
        kind: PlanKind,
        dims: [usize; 4],
        options: PlanOptions,
    ) -> Result<Self> {
        let [batch, q_len, heads, max_len] = dims.map(|d| d as i32); // validated to fit
        let mut schedule = ffi::mla_schedule_t::default();
        stream.context().bind_to_thread()?;
        // SAFETY: `schedule` is a valid, writable struct; the call only fills it.
        let status = unsafe {
            ffi::mla_schedule_init(
                &mut schedule,
                batch,
                q_len,
                heads,
                max_len,
                options.sm120_occupancy as i32,
            )
        };
        check("mla_schedule_init", status)?;
        // SAFETY: `schedule` was filled by mla_schedule_init.
        let ws_bytes = unsafe { ffi::mla_workspace_bytes(&schedule) };
        Ok(DecodePlan {
            kind,
            schedule,
            workspace: stream.alloc_zeros::<f32>(ws_bytes.div_ceil(4).max(1))?,
        })
    }

    /// The launch decisions the C layer made for this shape and device.
    pub fn schedule(&self) -> &ffi::mla_schedule_t {
        &self.schedule
    }

    /// Dense or sparse, and the shape.
    pub fn kind(&self) -> PlanKind {
        self.kind
    }

    /// What validation needs to know about this plan.
    pub fn desc(&self) -> PlanDesc {
        PlanDesc {
            kind: self.kind,
            device: self.schedule.device.max(0) as usize,
        }
    }

    /// Device address of the workspace, with its cudarc guard.
    ///
    /// The workspace is written through a shared reference (see the type's docs).
    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        self.workspace.device_ptr(stream)
    }

    /// The split workspace, for passing to the C ABI yourself.
    pub fn workspace(&self) -> &CudaSlice<f32> {
        &self.workspace
    }
}

/// The ordinal of `stream`'s device.
pub(crate) fn ordinal(stream: &CudaStream) -> usize {
    stream.context().ordinal()
}
