//! What a long run watches besides the results: a watchdog against hangs, the device's free
//! memory, and the GPU time of each replay.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mla_decode::cudarc::driver::sys::CUevent_flags;
use mla_decode::cudarc::driver::{CudaEvent, CudaStream};
use mla_decode::Result;

/// A thread that aborts the process when the main thread has not reported progress for
/// `limit`: a replay, a copy or a synchronize that never returns (a kernel that hangs or
/// livelocks) ends the run with a message instead of blocking it forever.
pub struct Watchdog {
    state: Arc<State>,
    thread: Option<JoinHandle<()>>,
}

struct State {
    start: Instant,
    /// Milliseconds since `start` of the last beat.
    last_ms: AtomicU64,
    /// What the main thread was at (the step).
    step: AtomicU64,
    done: AtomicBool,
}

impl Watchdog {
    /// Starts watching.
    pub fn start(limit: Duration) -> Watchdog {
        let state = Arc::new(State {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            step: AtomicU64::new(0),
            done: AtomicBool::new(false),
        });
        let watched = state.clone();
        let thread = std::thread::spawn(move || {
            while !watched.done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let now = watched.start.elapsed().as_millis() as u64;
                let quiet = now.saturating_sub(watched.last_ms.load(Ordering::Relaxed));
                if quiet > limit.as_millis() as u64 && !watched.done.load(Ordering::Relaxed) {
                    eprintln!(
                        "engine_step: WATCHDOG: no progress for {:.1} s at step {} (a replay, copy \
                         or synchronize did not return: a hang); aborting",
                        quiet as f64 / 1e3,
                        watched.step.load(Ordering::Relaxed)
                    );
                    // Not `exit`: its handlers would wait for the hung device work.
                    std::process::abort();
                }
            }
        });
        Watchdog {
            state,
            thread: Some(thread),
        }
    }

    /// Reports progress: `step` is done (or the host work before it).
    pub fn beat(&self, step: usize) {
        self.state.step.store(step as u64, Ordering::Relaxed);
        let now = self.state.start.elapsed().as_millis() as u64;
        self.state.last_ms.store(now, Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.state.done.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Free device memory of the stream's device, in bytes.
pub fn free_memory(stream: &Arc<CudaStream>) -> Result<usize> {
    Ok(stream.context().mem_get_info()?.0)
}

/// GPU time of each replay, from a ring of CUDA event pairs: a pair is read back only when
/// it comes round again, so timing never stalls the pipeline.
pub struct ReplayTimer {
    pairs: Vec<(CudaEvent, CudaEvent)>,
    /// Which pair slots hold a recorded, unread replay.
    pending: Vec<bool>,
    next: usize,
    /// Milliseconds of every replay read so far.
    pub times_ms: Vec<f32>,
}

impl ReplayTimer {
    /// A ring of `depth` event pairs (made before any capture: events are not allocated
    /// per replay).
    pub fn new(stream: &Arc<CudaStream>, depth: usize) -> Result<ReplayTimer> {
        let ctx = stream.context();
        let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let pairs = (0..depth)
            .map(|_| Ok((ctx.new_event(timed)?, ctx.new_event(timed)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(ReplayTimer {
            pairs,
            pending: vec![false; depth],
            next: 0,
            times_ms: Vec::new(),
        })
    }

    /// Times `launch` (one replay) on `stream`.
    pub fn time(
        &mut self,
        stream: &Arc<CudaStream>,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let i = self.next;
        self.next = (i + 1) % self.pairs.len();
        self.collect(i)?;
        self.pairs[i].0.record(stream)?;
        launch()?;
        self.pairs[i].1.record(stream)?;
        self.pending[i] = true;
        Ok(())
    }

    /// Reads every replay still pending (waits for them).
    pub fn finish(&mut self) -> Result<()> {
        for k in 0..self.pairs.len() {
            self.collect((self.next + k) % self.pairs.len())?;
        }
        Ok(())
    }

    fn collect(&mut self, i: usize) -> Result<()> {
        if std::mem::take(&mut self.pending[i]) {
            let (start, end) = &self.pairs[i];
            self.times_ms.push(start.elapsed_ms(end)?);
        }
        Ok(())
    }

    /// Median, mean and largest replay time in µs (`None` before any replay).
    pub fn summary_us(&self) -> Option<(f64, f64, f64)> {
        let mut t = self.times_ms.clone();
        t.sort_by(f32::total_cmp);
        let median = *t.get(t.len() / 2)? as f64 * 1e3;
        let mean = t.iter().map(|&x| x as f64).sum::<f64>() / t.len() as f64 * 1e3;
        Some((median, mean, *t.last()? as f64 * 1e3))
    }
}
