//! The split plan: a schedule made once per shape, plus the workspace it sizes.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtrMut, SyncOnDrop};

use crate::error::{check, Error, Result};
use crate::ffi;
use crate::types::KvFormat;
use crate::validate::{self, PlanDesc};

/// The most requests (sparse: tokens) `MLA_PATH_ROWS` takes: its grid has a CTA row per
/// request (`mla_tuning_t.path` in the header).
const ROWS_MAX_BATCH: i32 = 65_535;

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

    /// Query rows per request: `q_len` (dense) or 1 (sparse).
    pub fn q_len(&self) -> usize {
        match self {
            PlanKind::Dense(s) => s.q_len,
            PlanKind::Sparse(_) => 1,
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
    /// Overrides of the launch configuration, for experiments and tests; the default (all
    /// `None`) is what the schedule picks from the shape, and what production should use.
    pub tuning: Tuning,
}

/// Experiment overrides of what the schedule picks from the shape (`None` = the shape's
/// choice). Each is the field of the same name in the C ABI's `mla_tuning_t`
/// (`csrc/mla_decode.h` documents the defaults), with one difference: the C ABI's 0 means
/// "the schedule's choice" in every field, while here that is `None`, and `pdl: Some(0)`
/// turns programmatic dependent launch off (the C ABI's `MLA_PDL_OFF`). A value outside the
/// listed ones makes [`DecodePlan::dense`] / [`DecodePlan::sparse`] fail with
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument). The bench translates its
/// `MLA_WARPS`, `MLA_BLOCK_M`, `MLA_PDL`, `MLA_COMBINE_SLICES`, `MLA_MIN_CHUNK`, `MLA_SPLIT`, `MLA_PATH`
/// and `MLA_FORM` environment variables into this; the library itself reads no environment variable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Tuning {
    /// Warps per decode CTA: 4 or 8.
    pub warps: Option<u32>,
    /// Query rows per decode CTA: 8, 16 or 32 (8: the MMA's unused rows 8-15 skipped, the
    /// default with at most 8 query rows per request; 32 runs 8 warps).
    pub block_m: Option<u32>,
    /// Programmatic dependent launch: `0` off, else an OR of `ffi::MLA_PDL_ATTRIBUTE`,
    /// `ffi::MLA_PDL_TRIGGER_AT_START` and `ffi::MLA_PDL_TRIGGER_AT_LAST_TILE` (default
    /// `ffi::MLA_PDL_DEFAULT`, plus `ffi::MLA_PDL_TRIGGER_AT_START` where the schedule picks 32
    /// query rows per CTA, or 16 for more than 16 query rows of a long sparse fp8_ds_mla step,
    /// on a step that is not small; no effect before sm_90).
    pub pdl: Option<u32>,
    /// Combine CTAs per merged row's 512 dims: 1, 4 or 16.
    pub combine_slices: Option<u32>,
    /// The fewest 32-row tiles a split-KV part streams, >= 1.
    pub min_chunk: Option<u32>,
    /// How the tiles are cut into split-KV parts: `ffi::MLA_SPLIT_FLAT` (equal parts laid
    /// over all requests end to end) or `ffi::MLA_SPLIT_WITHIN_REQUESTS` (no part spans two
    /// requests where that fits; the default for 16-bit caches with 16 or 32 query rows per
    /// CTA, at most 128 requests and as many parts, except on small steps; elsewhere flat).
    pub split: Option<u32>,
    /// Which kernel runs: `ffi::MLA_PATH_TILES` (the split-KV tile kernels) or
    /// `ffi::MLA_PATH_ROWS` (the row kernel: a CTA per query row on the CUDA cores, no split;
    /// the default on one-part steps, `batch * ceil(max_len / 32) <= 2`, of at most one query
    /// row per SM; at most 65,535 requests).
    pub path: Option<u32>,
    /// How the 16-bit 8-row 4-warp tile kernel runs its products: `ffi::MLA_FORM_DIRECT` (the
    /// query's 8 rows as a 16-row MMA operand, rows 8-15 zero) or `ffi::MLA_FORM_TRANSPOSED`
    /// (Sᵀ = K Qᵀ, Oᵀ += Vᵀ Pᵀ: half the MMAs; the default on sparse steps and where one such
    /// CTA has an SM to itself, as on sm_120). Ignored where the schedule picks another
    /// configuration.
    pub form: Option<u32>,
}

impl Tuning {
    /// Checks each override against the values the C layer takes (it checks them again).
    pub fn check(&self) -> Result<()> {
        let bad = |arg: &'static str, ok: bool, expected: &str| -> Result<()> {
            if ok {
                Ok(())
            } else {
                Err(Error::invalid(arg, expected))
            }
        };
        bad(
            "tuning.warps",
            matches!(self.warps, None | Some(4 | 8)),
            "expected 4 or 8 warps",
        )?;
        bad(
            "tuning.block_m",
            matches!(self.block_m, None | Some(8 | 16 | 32)),
            "expected 8, 16 or 32 query rows",
        )?;
        bad(
            "tuning.block_m",
            !(self.block_m == Some(32) && self.warps == Some(4)),
            "32 query rows per CTA run 8 warps, not 4",
        )?;
        bad(
            "tuning.pdl",
            self.pdl.is_none_or(|p| p & !ffi::MLA_PDL_ALL == 0),
            "expected 0 (off) or an OR of the MLA_PDL_* bits (1, 2, 4)",
        )?;
        bad(
            "tuning.combine_slices",
            matches!(self.combine_slices, None | Some(1 | 4 | 16)),
            "expected 1, 4 or 16 slices",
        )?;
        bad(
            "tuning.min_chunk",
            self.min_chunk.is_none_or(|c| (1..=1 << 20).contains(&c)),
            "expected 1..=1048576 tiles",
        )?;
        bad(
            "tuning.split",
            self.split
                .is_none_or(|v| v == ffi::MLA_SPLIT_FLAT || v == ffi::MLA_SPLIT_WITHIN_REQUESTS),
            "expected MLA_SPLIT_FLAT (1) or MLA_SPLIT_WITHIN_REQUESTS (2)",
        )?;
        bad(
            "tuning.path",
            self.path
                .is_none_or(|v| v == ffi::MLA_PATH_TILES || v == ffi::MLA_PATH_ROWS),
            "expected MLA_PATH_TILES (1) or MLA_PATH_ROWS (2)",
        )?;
        bad(
            "tuning.form",
            self.form
                .is_none_or(|v| v == ffi::MLA_FORM_DIRECT || v == ffi::MLA_FORM_TRANSPOSED),
            "expected MLA_FORM_DIRECT (1) or MLA_FORM_TRANSPOSED (2)",
        )
    }

    /// The C ABI's struct (0 = default; a value C cannot take becomes one it rejects).
    fn to_ffi(self, sm120_occupancy: bool) -> ffi::mla_tuning_t {
        const REJECTED: i32 = -2;
        let field = |v: Option<u32>| match v {
            None => 0,
            Some(0) => REJECTED,
            Some(v) => i32::try_from(v).unwrap_or(REJECTED),
        };
        ffi::mla_tuning_t {
            sm120_occupancy: sm120_occupancy as i32,
            warps: field(self.warps),
            block_m: field(self.block_m),
            pdl: match self.pdl {
                Some(0) => ffi::MLA_PDL_OFF,
                v => field(v),
            },
            combine_slices: field(self.combine_slices),
            min_chunk: field(self.min_chunk),
            split: field(self.split),
            path: field(self.path),
            form: field(self.form),
        }
    }
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
    /// of `shape`, or of `options.tuning` (`"tuning.warps"`, ...).
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
    /// `shape`, or of `options.tuning`.
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
        let [batch, q_len, num_heads, max_len] = dims.map(|d| d as i32); // validated to fit
        let shape = ffi::mla_shape_t {
            batch,
            q_len,
            num_heads,
            max_len,
            kv_format: kind.kv_format().to_ffi(),
            kind: match kind {
                PlanKind::Dense(_) => ffi::mla_kind_t::MLA_KIND_DENSE,
                PlanKind::Sparse(_) => ffi::mla_kind_t::MLA_KIND_SPARSE,
            },
        };
        options.tuning.check()?;
        if options.tuning.path == Some(ffi::MLA_PATH_ROWS) && batch > ROWS_MAX_BATCH {
            return Err(Error::invalid(
                "tuning.path",
                format!(
                    "MLA_PATH_ROWS takes at most {ROWS_MAX_BATCH} requests (sparse: tokens), \
                     the shape has {batch}"
                ),
            ));
        }
        let mut schedule = ffi::mla_schedule_t::default();
        let tuning = options.tuning.to_ffi(options.sm120_occupancy);
        stream.context().bind_to_thread()?;
        // SAFETY: `schedule` is a valid, writable struct and `tuning` a valid struct that
        // outlives the call; the call only fills `schedule`.
        let status = unsafe { ffi::mla_schedule_init(&mut schedule, &shape, &tuning) };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_defaults_are_zeros() {
        let t = Tuning::default().to_ffi(false);
        assert_eq!(
            [
                t.sm120_occupancy,
                t.warps,
                t.block_m,
                t.pdl,
                t.combine_slices,
                t.min_chunk,
                t.split,
                t.path,
                t.form
            ],
            [0; 9]
        );
        assert_eq!(Tuning::default().to_ffi(true).sm120_occupancy, 1);
        assert_eq!(Tuning::default().check(), Ok(()));
    }

    #[test]
    fn tuning_overrides() {
        let t = Tuning {
            warps: Some(8),
            block_m: Some(32),
            pdl: Some(0),
            combine_slices: Some(4),
            min_chunk: Some(3),
            split: Some(ffi::MLA_SPLIT_FLAT),
            path: Some(ffi::MLA_PATH_ROWS),
            form: Some(ffi::MLA_FORM_TRANSPOSED),
        };
        assert_eq!(t.check(), Ok(()));
        let f = t.to_ffi(false);
        assert_eq!(
            [
                f.warps,
                f.block_m,
                f.pdl,
                f.combine_slices,
                f.min_chunk,
                f.split,
                f.path,
                f.form
            ],
            [
                8,
                32,
                ffi::MLA_PDL_OFF,
                4,
                3,
                ffi::MLA_SPLIT_FLAT as i32,
                ffi::MLA_PATH_ROWS as i32,
                ffi::MLA_FORM_TRANSPOSED as i32
            ]
        );
        let pdl = Tuning {
            pdl: Some(ffi::MLA_PDL_DEFAULT),
            ..Tuning::default()
        };
        assert_eq!(pdl.check(), Ok(()));
        assert_eq!(pdl.to_ffi(false).pdl, ffi::MLA_PDL_DEFAULT as i32);
    }

    #[test]
    fn tuning_rejects() {
        let bad = [
            Tuning {
                warps: Some(6),
                ..Tuning::default()
            },
            Tuning {
                block_m: Some(32),
                warps: Some(4),
                ..Tuning::default()
            },
            Tuning {
                pdl: Some(8),
                ..Tuning::default()
            },
            Tuning {
                combine_slices: Some(2),
                ..Tuning::default()
            },
            Tuning {
                min_chunk: Some(0),
                ..Tuning::default()
            },
            Tuning {
                split: Some(3),
                ..Tuning::default()
            },
            Tuning {
                path: Some(3),
                ..Tuning::default()
            },
            Tuning {
                form: Some(3),
                ..Tuning::default()
            },
        ];
        for t in bad {
            assert!(
                matches!(t.check(), Err(Error::InvalidArgument { .. })),
                "{t:?}"
            );
        }
        // what C would see had the check been skipped: values it rejects
        assert!(
            Tuning {
                warps: Some(0),
                ..Tuning::default()
            }
            .to_ffi(false)
            .warps
                < 0
        );
    }
}
