//! The split plan: a schedule made once per shape, plus its device plan and workspace.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, SyncOnDrop};

use crate::device::{bind_flag, ErrorFlag};
use crate::error::{check, Result};
use crate::ffi;
use crate::tensor::bind;
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

/// A schedule with the device buffers it sized: made once per shape, updated once per
/// decode step, used by every layer of the step.
///
/// Updating and decoding allocate nothing and never synchronize the host, so a whole step
/// can be captured in a CUDA graph. To capture on a context with several streams, disable
/// cudarc's event tracking first (`CudaContext::disable_event_tracking`, as cudarc's own graph
/// tests do): its per-buffer events would make the capture wait on work recorded outside it.
///
/// The workspace is scratch for one call at a time: use a plan on one stream (or order the
/// streams yourself).
#[derive(Debug)]
pub struct DecodePlan {
    kind: PlanKind,
    schedule: ffi::mla_schedule_t,
    plan: CudaSlice<i32>,
    workspace: CudaSlice<f32>,
    updated: bool,
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
        let (plan_bytes, ws_bytes) = unsafe {
            (
                ffi::mla_plan_bytes(&schedule),
                ffi::mla_workspace_bytes(&schedule),
            )
        };
        Ok(DecodePlan {
            kind,
            schedule,
            plan: stream.alloc_zeros::<i32>(plan_bytes.div_ceil(4).max(1))?,
            workspace: stream.alloc_zeros::<f32>(ws_bytes.div_ceil(4).max(1))?,
            updated: false,
        })
    }

    /// Computes this step's split from `seq_lens[batch]` on the device (dense plans).
    ///
    /// A negative or too-large length is clamped and, with `error_flag`, recorded there.
    pub fn update_dense(
        &mut self,
        stream: &CudaStream,
        seq_lens: &CudaView<i32>,
        error_flag: Option<&ErrorFlag>,
    ) -> Result<()> {
        let (lens, lens_buf, _g_lens) = bind(seq_lens, stream);
        let (flag, flag_buf, _g_flag) = bind_flag(error_flag, stream);
        validate::dense_update(&self.desc(), &lens_buf, flag_buf.as_ref(), ordinal(stream))?;
        self.run_plan(stream, lens, 1, flag)
    }

    /// Computes this step's split from the optional `topk_len[num_tokens]` (sparse plans;
    /// `None`: every row has `topk` entries). Lengths are clamped to `0..=topk` silently.
    pub fn update_sparse(
        &mut self,
        stream: &CudaStream,
        topk_len: Option<&CudaView<i32>>,
    ) -> Result<()> {
        let bound = topk_len.map(|v| bind(v, stream));
        validate::sparse_update(&self.desc(), bound.as_ref().map(|b| &b.1), ordinal(stream))?;
        let lens = bound.as_ref().map_or(0, |b| b.0);
        self.run_plan(stream, lens, 0, 0)
    }

    fn run_plan(
        &mut self,
        stream: &CudaStream,
        lens: u64,
        check_lens: i32,
        flag: u64,
    ) -> Result<()> {
        stream.context().bind_to_thread()?;
        let (plan, _g_plan) = self.plan.device_ptr_mut(stream);
        // SAFETY: pointers were validated to lie on this device and to be large enough;
        // the plan buffer was sized by this schedule. The guards outlive the launch.
        let status = unsafe {
            ffi::mla_plan(
                &self.schedule,
                lens as *const i32,
                check_lens,
                plan as *mut i32,
                flag as *mut u32,
                stream.cu_stream() as *mut c_void,
            )
        };
        check("mla_plan", status)?;
        self.updated = true;
        Ok(())
    }

    /// The launch decisions the C layer made for this shape and device.
    pub fn schedule(&self) -> &ffi::mla_schedule_t {
        &self.schedule
    }

    /// Dense or sparse, and the shape.
    pub fn kind(&self) -> PlanKind {
        self.kind
    }

    /// Whether `update_*` ran at least once.
    pub fn is_updated(&self) -> bool {
        self.updated
    }

    /// What validation needs to know about this plan.
    pub fn desc(&self) -> PlanDesc {
        PlanDesc {
            kind: self.kind,
            device: self.schedule.device.max(0) as usize,
            updated: self.updated,
        }
    }

    /// Device addresses of the plan buffer and the workspace, with their cudarc guards.
    ///
    /// The workspace is written through a shared reference (see the type's docs).
    pub(crate) fn bind<'s>(
        &'s self,
        stream: &'s CudaStream,
    ) -> (u64, u64, SyncOnDrop<'s>, SyncOnDrop<'s>) {
        let (plan, g_plan) = self.plan.device_ptr(stream);
        let (ws, g_ws) = self.workspace.device_ptr(stream);
        (plan, ws, g_plan, g_ws)
    }

    /// The plan buffer and workspace, for passing to the C ABI yourself.
    pub fn buffers(&self) -> (&CudaSlice<i32>, &CudaSlice<f32>) {
        (&self.plan, &self.workspace)
    }
}

/// The ordinal of `stream`'s device.
pub(crate) fn ordinal(stream: &CudaStream) -> usize {
    stream.context().ordinal()
}
