//! The device, the L2 flush, CUDA-event timing, the copy bandwidth and CUDA-graph replay.
//!
//! Two ways keep a case's inputs out of L2 between its runs ([`FlushMode`]): `rotate` (the
//! default) gives the case identical copies of its KV cache and has run `i` read copy
//! `i % copies`, enough copies that the cache rows read between two runs of the same copy
//! are at least [`ROTATE_L2_FACTOR`] times the L2 (or one copy when a run reads that much),
//! at most [`ROTATE_MAX_COPIES`] of them and [`ROTATE_MAX_BYTES`] together (a case that
//! would need more gets the memset); `memset` writes a buffer of
//! max(2 × L2, 256 MiB) before each run, as Triton's do_bench does. The memset leaves the
//! L2 full of dirty lines, which the timed run then writes back (6-8 µs of a 90 µs case on
//! an H200), so `rotate` times the kernels as they run in a model, where the cache is cold
//! and L2 is not dirty with unrelated writes.
//!
//! Everything runs on one stream. cudarc's per-buffer event tracking is switched off when
//! the context is made (before any buffer exists): with a single stream it orders nothing,
//! and its events would make a graph capture wait on work recorded outside the capture.

use std::sync::Arc;

use mla_decode::cudarc::driver::sys::{
    CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use mla_decode::cudarc::driver::{CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream};
use mla_decode::{cuda_available, DeviceInfo, PlanOptions, Tuning};

use super::cases::{CacheBytes, Workload};
use super::Res;

/// The L2 flush writes at least this much (Triton's do_bench flushes 256 MB), and at least
/// twice the L2.
pub const MIN_FLUSH_BYTES: usize = 256 << 20;
/// Cases that move fewer bytes than this also report CUDA-graph replay time.
pub const GRAPH_MAX_BYTES: f64 = 64e6;
/// Size of the device-to-device copy that defines the copy bandwidth.
pub const COPY_BYTES: usize = 1 << 30;
/// `rotate` reads at least this many times the L2 in cache rows between two runs that
/// read the same copy.
pub const ROTATE_L2_FACTOR: usize = 4;
/// `rotate` uses at most this many bytes for all the copies of a cache together (the
/// original included); a case that would need more is flushed by the memset instead.
pub const ROTATE_MAX_BYTES: usize = 8 << 30;
/// `rotate` makes at most this many copies of a cache (the original included); a case that
/// reads so little per step that it would need more (a one-token call would need some
/// 200,000) is flushed by the memset instead. Each copy costs an allocation and, for the
/// graph replay, a captured graph: the cap keeps a case's setup under a second or so, and
/// still rotates every step that reads more than 4 × L2 / 255 (about 1 MB on an H200).
pub const ROTATE_MAX_COPIES: usize = 256;

/// How the timed runs keep a case's inputs out of L2 (`--flush`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlushMode {
    /// Rotate the KV cache over identical copies ([`copies_for`]); no flush. Cases
    /// without a cache to rotate (the gather, the append) and those whose copies would
    /// pass [`ROTATE_MAX_COPIES`] or [`ROTATE_MAX_BYTES`] fall back to the memset.
    #[default]
    Rotate,
    /// A memset of max(2 × L2, 256 MiB) before every run (Triton's do_bench).
    Memset,
}

impl FlushMode {
    pub fn parse(value: &str) -> Result<FlushMode, String> {
        match value {
            "rotate" => Ok(FlushMode::Rotate),
            "memset" => Ok(FlushMode::Memset),
            other => Err(format!("--flush: expected rotate or memset, got `{other}`")),
        }
    }

    /// `rotate` or `memset`, as `--flush` and the JSON spell it.
    pub fn name(self) -> &'static str {
        match self {
            FlushMode::Rotate => "rotate",
            FlushMode::Memset => "memset",
        }
    }
}

/// Device 0, its stream and the L2 flush buffer.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
    /// How [`measure`] keeps the inputs out of L2 ([`FlushMode::Rotate`] unless set).
    pub flush_mode: FlushMode,
    flush: CudaSlice<u8>,
}

/// Plan options of a bench or profile run: `sm120_occupancy` and the environment's
/// overrides (`kit::tuning_from_env`).
pub fn plan_options(sm120_occupancy: bool) -> Result<PlanOptions, String> {
    Ok(PlanOptions {
        sm120_occupancy,
        tuning: super::kit::tuning_from_env()?,
    })
}

/// How [`Gpu::time`] runs.
#[derive(Clone, Copy, Debug)]
pub struct TimeOpts {
    /// Untimed runs first.
    pub warmup: usize,
    /// Timed runs.
    pub iters: usize,
    /// Flush L2 before every run (outside the timed events).
    pub flush: bool,
}

impl Gpu {
    /// Device 0, or `Ok(Err(why))` when there is no CUDA driver or device.
    pub fn open() -> Res<Result<Gpu, String>> {
        if !cuda_available() {
            return Ok(Err("no CUDA driver (libcuda) found".into()));
        }
        let ctx = match CudaContext::new(0) {
            Ok(ctx) => ctx,
            Err(e) => return Ok(Err(format!("no usable CUDA device ({e})"))),
        };
        // SAFETY: every buffer of these tools is made after this call and used on the one
        // stream made below, so no cross-stream ordering is needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let info = DeviceInfo::query(&ctx)?;
        let flush_bytes = (2 * info.l2_cache_bytes.max(0) as usize).max(MIN_FLUSH_BYTES);
        let flush = stream.alloc_zeros::<u8>(flush_bytes)?;
        Ok(Ok(Gpu {
            ctx,
            stream,
            info,
            flush_mode: FlushMode::default(),
            flush,
        }))
    }

    /// `NVIDIA H200 sm_90, 132 SMs`.
    pub fn describe(&self) -> String {
        format!(
            "{} {}, {} SMs",
            self.info.name,
            self.info.sm_name(),
            self.info.sm_count
        )
    }

    /// Bytes the L2 flush writes.
    pub fn flush_bytes(&self) -> usize {
        self.flush.len()
    }

    /// Evicts the inputs from L2: a memset of at least twice its size.
    pub fn flush_l2(&mut self) -> Res<()> {
        self.stream.memset_zeros(&mut self.flush)?;
        Ok(())
    }

    /// Runs `run(stream, i)` for `i` in `0..warmup + iters`, timing the last `iters` with
    /// CUDA events; returns the times in µs, sorted. Nothing synchronizes the host until
    /// the end.
    pub fn time(
        &mut self,
        opts: TimeOpts,
        mut run: impl FnMut(&Arc<CudaStream>, usize) -> Res<()>,
    ) -> Res<Vec<f64>> {
        let stream = self.stream.clone();
        let events = (0..opts.iters)
            .map(|_| Ok((self.timing_event()?, self.timing_event()?)))
            .collect::<Res<Vec<_>>>()?;
        for i in 0..opts.warmup + opts.iters {
            if opts.flush {
                self.flush_l2()?;
            }
            let pair = i.checked_sub(opts.warmup).map(|j| &events[j]);
            if let Some((start, _)) = pair {
                start.record(&stream)?;
            }
            run(&stream, i)?;
            if let Some((_, end)) = pair {
                end.record(&stream)?;
            }
        }
        stream.synchronize()?;
        let mut us = events
            .iter()
            .map(|(start, end)| Ok(f64::from(start.elapsed_ms(end)?) * 1e3))
            .collect::<Res<Vec<f64>>>()?;
        us.sort_by(f64::total_cmp);
        Ok(us)
    }

    fn timing_event(&self) -> Res<CudaEvent> {
        Ok(self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// The copy bandwidth in GB/s: bytes read plus written by a 1 GiB device-to-device copy
    /// (cuMemcpyDtoDAsync) over its median time.
    pub fn copy_bandwidth_gbps(&mut self) -> Res<f64> {
        let src = self.stream.alloc_zeros::<u8>(COPY_BYTES)?;
        let mut dst = self.stream.alloc_zeros::<u8>(COPY_BYTES)?;
        let opts = TimeOpts {
            warmup: 3,
            iters: 25,
            flush: false, // 1 GiB is far beyond any L2
        };
        let us = self.time(opts, |s, _| Ok(s.memcpy_dtod(&src, &mut dst)?))?;
        Ok(2.0 * COPY_BYTES as f64 / median(&us) / 1e3)
    }

    /// Captures what `run` enqueues into a CUDA graph (relaxed capture mode) and uploads it.
    pub fn capture(&self, run: impl FnOnce(&Arc<CudaStream>) -> Res<()>) -> Res<CudaGraph> {
        self.stream.synchronize()?;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let ran = run(&self.stream);
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        ran?;
        let graph = graph?.ok_or("the capture recorded nothing")?;
        graph.upload()?;
        Ok(graph)
    }
}

/// The median of sorted samples (0 for none).
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    }
}

/// How [`measure`] runs.
#[derive(Clone, Copy, Debug)]
pub struct MeasureOpts {
    pub warmup: usize,
    pub iters: usize,
    /// Also time CUDA-graph replay, for cases under [`GRAPH_MAX_BYTES`].
    pub graph: bool,
}

/// What [`measure`] found.
#[derive(Clone, Debug)]
pub struct Timing {
    /// Median µs of one step launched from the host.
    pub us: f64,
    /// Median µs of one replay of the step captured in a CUDA graph.
    pub graph_us: Option<f64>,
    /// Why there is no graph time although one was asked for.
    pub graph_error: Option<String>,
}

/// The copies of a cache that `rotate` needs: enough that the rows read between two runs
/// of the same copy (the other copies' steps) add up to [`ROTATE_L2_FACTOR`] × L2; 1 when a
/// step reads that much by itself (its own reads evict its earlier lines). `Err(why)` (use
/// the memset) when they would be more than [`ROTATE_MAX_COPIES`] or take more than
/// [`ROTATE_MAX_BYTES`], or when the device reports no L2 size.
pub fn copies_for(l2_bytes: usize, cache: CacheBytes) -> Result<usize, String> {
    if l2_bytes == 0 {
        return Err("the device reports no L2 size".into());
    }
    let need = ROTATE_L2_FACTOR * l2_bytes;
    let read = cache.read.max(1);
    let copies = if read >= need {
        1
    } else {
        need.div_ceil(read) + 1
    };
    if copies > ROTATE_MAX_COPIES {
        Err(format!(
            "{copies} copies would pass the cap of {ROTATE_MAX_COPIES}"
        ))
    } else if copies > 1 && copies.saturating_mul(cache.size) > ROTATE_MAX_BYTES {
        Err(format!(
            "{copies} copies would pass {} GiB",
            ROTATE_MAX_BYTES >> 30
        ))
    } else {
        Ok(copies)
    }
}

/// How `gpu.flush_mode` keeps `w`'s inputs out of L2: `Ok(copies)` of its cache to rotate
/// over, or `Err(why)` the memset (`memset` mode, the gather and the append, [`copies_for`]'s
/// limits).
pub fn cold_l2_for(gpu: &Gpu, w: &dyn Workload) -> Result<usize, String> {
    match (gpu.flush_mode, w.cache_bytes()) {
        (FlushMode::Memset, _) => Err("--flush memset".into()),
        (FlushMode::Rotate, None) => Err("no KV cache to rotate".into()),
        (FlushMode::Rotate, Some(cache)) => {
            copies_for(gpu.info.l2_cache_bytes.max(0) as usize, cache)
        }
    }
}

/// Sets `w` up for `gpu.flush_mode`: in `rotate` mode gives it the copies of its cache
/// that [`copies_for`] asks for; returns whether every run needs the memset flush instead
/// (`memset` mode, the gather and the append, a cache too small or too large to rotate). Run
/// `i` must then `w.select_copy(i)` first.
pub fn set_up_cold_l2(gpu: &Gpu, w: &mut dyn Workload) -> Res<bool> {
    let copies = cold_l2_for(gpu, w).ok();
    w.set_copies(&gpu.stream, copies)?;
    Ok(copies.is_none())
}

/// Times one step of `w` (its plan must be set): the median over `opts.iters` runs after
/// warm-up, inputs out of L2 as `gpu.flush_mode` says; then, for small cases, the same for
/// graph replay. Checks the workload's error flag afterwards.
pub fn measure(gpu: &mut Gpu, w: &mut dyn Workload, opts: &MeasureOpts) -> Res<Timing> {
    let time_opts = TimeOpts {
        warmup: opts.warmup,
        iters: opts.iters,
        flush: set_up_cold_l2(gpu, w)?,
    };
    let us = median(&gpu.time(time_opts, |s, i| {
        w.select_copy(i);
        Ok(w.step(s)?)
    })?);
    w.check_flag(&gpu.stream)?;
    let mut timing = Timing {
        us,
        graph_us: None,
        graph_error: None,
    };
    if opts.graph && w.meta().bytes < GRAPH_MAX_BYTES {
        match graph_time(gpu, w, time_opts) {
            Ok(us) => timing.graph_us = Some(us),
            Err(e) => timing.graph_error = Some(e.to_string()),
        }
    }
    Ok(timing)
}

/// Replays graph `i % copies` in run `i`: one graph per copy of the cache, since a graph
/// bakes in the cache's address.
fn graph_time(gpu: &mut Gpu, w: &mut dyn Workload, opts: TimeOpts) -> Res<f64> {
    let graphs = (0..w.meta().copies.unwrap_or(1))
        .map(|c| {
            w.select_copy(c);
            gpu.capture(|s| Ok(w.step(s)?))
        })
        .collect::<Res<Vec<_>>>()?;
    let us = median(&gpu.time(opts, |_, i| Ok(graphs[i % graphs.len()].launch()?))?);
    w.check_flag(&gpu.stream)?;
    Ok(us)
}
