//! The split plan: a schedule made once per shape, plus the workspace it sizes.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtrMut, SyncOnDrop};

use crate::error::{check, Error, Result};
use crate::ffi;
use crate::types::KvFormat;
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
    /// The format of the cache the plan's calls read.
    pub kv_format: KvFormat,
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
    /// The format of the cache the plan's calls read.
    pub kv_format: KvFormat,
}

/// Dense or sparse, with its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlanKind {
    /// For [`dense_decode`](crate::dense_decode).
    Dense(DenseShape),
    /// For [`sparse_decode`](crate::sparse_decode).
    Sparse(SparseShape),
}

impl PlanKind {
    /// Query rows of every call: `batch · q_len` (dense) or `num_tokens` (sparse). `q`,
    /// `out` and `lse` need this many rows; their buffers may be longer.
    pub fn num_tokens(&self) -> usize {
        match self {
            PlanKind::Dense(s) => s.batch * s.q_len,
            PlanKind::Sparse(s) => s.num_tokens,
        }
    }

    /// Query heads.
    pub fn num_heads(&self) -> usize {
        match self {
            PlanKind::Dense(s) => s.num_heads,
            PlanKind::Sparse(s) => s.num_heads,
        }
    }

    /// The format of the cache the plan's calls read.
    pub fn kv_format(&self) -> KvFormat {
        match self {
            PlanKind::Dense(s) => s.kv_format,
            PlanKind::Sparse(s) => s.kv_format,
        }
    }
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
/// captured in a CUDA graph ([`capture_graph`](crate::capture_graph)) and replayed with new
/// lengths and tables written into the same buffers.
///
/// **One plan per stream.** The workspace is scratch that every call writes, so the decode
/// calls take the plan as `&mut`: one plan cannot serve two calls at once. Streams that
/// decode concurrently need a plan each (or order the streams yourself).
///
/// Plans allocate (the workspace) and query the device: make them before capturing a graph
/// (creating one on a capturing stream is refused with [`Error::Capture`]).
#[derive(Debug)]
pub struct DecodePlan {
    kind: PlanKind,
    device: usize,
    schedule: ffi::mla_schedule_t,
    workspace_bytes: usize,
    workspace: CudaSlice<f32>,
}

impl DecodePlan {
    /// A plan for dense paged decode of `shape` on `stream`'s device. Errors name a field
    /// of `shape`.
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

    /// A plan for sparse decode of `shape` on `stream`'s device. Errors name a field of
    /// `shape`.
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
        refuse_while_capturing(stream, "DecodePlan")?;
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
        let workspace_bytes = unsafe { ffi::mla_workspace_bytes(&schedule) };
        Ok(DecodePlan {
            kind,
            device: stream.context().ordinal(),
            schedule,
            workspace_bytes,
            workspace: stream.alloc_zeros::<f32>(workspace_bytes.div_ceil(4).max(1))?,
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

    /// Query rows of every call (`batch · q_len`, or `num_tokens`): `q`, `out` and `lse`
    /// need this many rows; longer buffers are fine.
    pub fn num_tokens(&self) -> usize {
        self.kind.num_tokens()
    }

    /// Query heads.
    pub fn num_heads(&self) -> usize {
        self.kind.num_heads()
    }

    /// The format of the cache the plan's calls read.
    pub fn kv_format(&self) -> KvFormat {
        self.kind.kv_format()
    }

    /// Ordinal of the device the plan was made for.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Bytes of the split workspace (`mla_workspace_bytes`), allocated by the plan.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace_bytes
    }

    /// What validation needs to know about this plan.
    pub fn desc(&self) -> PlanDesc {
        PlanDesc {
            kind: self.kind,
            device: self.device,
        }
    }

    /// Device address of the workspace for writing on `stream`, with its cudarc guard.
    pub(crate) fn bind<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        self.workspace.device_ptr_mut(stream)
    }

    /// The split workspace, for passing to the C ABI yourself.
    pub fn workspace(&self) -> &CudaSlice<f32> {
        &self.workspace
    }
}

/// Refuses, with [`Error::Capture`], to run `what` (which allocates) on a stream that is
/// capturing a CUDA graph.
pub(crate) fn refuse_while_capturing(stream: &CudaStream, what: &str) -> Result<()> {
    match stream.capture_status()? {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(()),
        status => Err(Error::Capture(format!(
            "{what} allocates: make it before capturing a graph (stream capture status {status:?})"
        ))),
    }
}

/// The ordinal of `stream`'s device.
pub(crate) fn ordinal(stream: &CudaStream) -> usize {
    stream.context().ordinal()
}
