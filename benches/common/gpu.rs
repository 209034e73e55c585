//! The device, the L2 flush, CUDA-event timing, the copy bandwidth and CUDA-graph replay.
//!
//! Everything runs on one stream. cudarc's per-buffer event tracking is switched off when
//! the context is made (before any buffer exists): with a single stream it orders nothing,
//! and its events would make a graph capture wait on work recorded outside the capture.

use std::sync::Arc;

use mla_decode::cudarc::driver::sys::{
    CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use mla_decode::cudarc::driver::{CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream};
use mla_decode::{cuda_available, DeviceInfo};

use super::cases::Workload;
use super::Res;

/// The L2 flush writes at least this much (Triton's do_bench flushes 256 MB), and at least
/// twice the L2.
pub const MIN_FLUSH_BYTES: usize = 256 << 20;
/// Cases that move fewer bytes than this also report CUDA-graph replay time.
pub const GRAPH_MAX_BYTES: f64 = 64e6;
/// Size of the device-to-device copy that defines the copy bandwidth.
pub const COPY_BYTES: usize = 1 << 30;

/// Device 0, its stream and the L2 flush buffer.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
    flush: CudaSlice<u8>,
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

    /// Runs `run` `warmup + iters` times, timing the last `iters` with CUDA events;
    /// returns the times in µs, sorted. Nothing synchronizes the host until the end.
    pub fn time(
        &mut self,
        opts: TimeOpts,
        mut run: impl FnMut(&Arc<CudaStream>) -> Res<()>,
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
            run(&stream)?;
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
        let us = self.time(opts, |s| Ok(s.memcpy_dtod(&src, &mut dst)?))?;
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
    /// Median µs of a further layer of the same step (decode + combine, plan reused).
    pub layer_us: f64,
    /// Median µs of one replay of the step captured in a CUDA graph.
    pub graph_us: Option<f64>,
    /// Why there is no graph time although one was asked for.
    pub graph_error: Option<String>,
}

/// Times one step of `w` (its plan must be set): the median over `opts.iters` runs after
/// warm-up, L2 flushed before each; then, for small cases, the same for graph replay.
/// Checks the workload's error flag afterwards.
pub fn measure(gpu: &mut Gpu, w: &mut dyn Workload, opts: &MeasureOpts) -> Res<Timing> {
    let time_opts = TimeOpts {
        warmup: opts.warmup,
        iters: opts.iters,
        flush: true,
    };
    let us = median(&gpu.time(time_opts, |s| Ok(w.step(s)?))?);
    w.check_flag(&gpu.stream)?;
    let layer_us = median(&gpu.time(time_opts, |s| Ok(w.layer(s)?))?);
    w.check_flag(&gpu.stream)?;
    let mut timing = Timing {
        us,
        layer_us,
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

fn graph_time(gpu: &mut Gpu, w: &mut dyn Workload, opts: TimeOpts) -> Res<f64> {
    let graph = gpu.capture(|s| Ok(w.step(s)?))?;
    let us = median(&gpu.time(opts, |_| Ok(graph.launch()?))?);
    w.check_flag(&gpu.stream)?;
    Ok(us)
}
