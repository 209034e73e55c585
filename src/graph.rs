//! Capturing decode steps in a CUDA graph.

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaGraph, CudaStream, DriverError};

use crate::error::{Error, Result};

/// Captures what `body` enqueues on `stream` into a CUDA graph, instantiated and ready to
/// [`launch`](CudaGraph::launch).
///
/// Every call of this crate that enqueues work (decode, append, gather,
/// [`ErrorFlag::reset`](crate::ErrorFlag::reset), [`ErrorFlag::copy_to`](crate::ErrorFlag::copy_to))
/// allocates nothing and never synchronizes the host, so it can be captured. A replay runs
/// the same kernels on the same buffers and reads whatever they hold **at replay time**:
/// write the next step's lengths, block table, indices and queries into the captured
/// buffers (with copies on `stream`, before the launch) and launch again.
///
/// # Before capturing
/// - **Turn cudarc's event tracking off** on the context (`unsafe {
///   ctx.disable_event_tracking() }`), and allocate the buffers you capture after that.
///   With tracking on, cudarc makes every use of a buffer wait on, and record, per-buffer
///   events; recorded outside the capture, they break it (or the capture waits on work
///   outside the graph). This function refuses with [`Error::Capture`] while tracking is
///   on. Turning it off is context-wide and `unsafe` because ordering buffers between
///   streams becomes your job: in cudarc 0.19 it also stops that ordering at once for
///   buffers allocated earlier (join streams with events yourself, e.g.
///   [`CudaStream::join`]).
/// - **Make plans and flags first.** [`DecodePlan`](crate::DecodePlan)s and
///   [`ErrorFlag`](crate::ErrorFlag)s allocate; making one on a capturing stream is refused
///   with [`Error::Capture`]. A [`FlagReading`](crate::FlagReading) (pinned host memory)
///   too; [`ErrorFlag::check`](crate::ErrorFlag::check), `read` and `read_async` synchronize
///   or record host-side state, so call them after the launch, not inside `body`.
/// - **Run each call once before capturing** (a warm-up step): with CUDA's lazy module
///   loading a kernel's code is loaded at its first launch, which must not happen inside a
///   capture. (Plans set the decode kernels' attributes when they are made.)
/// - **Keep the buffers alive** as long as the graph: it holds raw device addresses.
///
/// # Safety
/// The returned graph holds the raw device addresses of everything the captured calls use
/// (the plan's workspace, the flag, the queries, cache, tables, lengths, outputs) without
/// borrowing them: until the graph is dropped, none of them may be freed (dropped) or
/// reallocated while a launch of it may still run, or the replay reads and writes memory
/// that may belong to another allocation by then. (cudarc's `CudaGraph::launch` is a safe
/// fn, so this contract sits here, on the capture.)
///
/// The capture uses `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL` (other threads are not
/// affected). It always ends, also when `body` fails; `body`'s error comes first, then a
/// failed capture (e.g. invalidated by a synchronizing call inside `body`) as
/// [`Error::Capture`].
///
/// ```no_run
/// use half::bf16;
/// use mla_decode::cudarc::driver::CudaContext;
/// use mla_decode::*;
///
/// fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
///     let ctx = CudaContext::new(0)?;
///     // SAFETY: this program orders its streams itself (it uses one).
///     unsafe { ctx.disable_event_tracking() };
///     let stream = ctx.new_stream()?;
///     let (batch, heads, block_size, max_blocks) = (1, 8, 64, 64);
///
///     // Everything the graph touches is made before the capture.
///     let shape = DenseShape {
///         batch, q_len: 1, num_heads: heads, block_size, max_blocks_per_seq: max_blocks,
///         kv_format: KvFormat::Bf16,
///     };
///     let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default())?;
///     let mut flag = ErrorFlag::new(&stream)?;
///     let cache = stream.alloc_zeros::<bf16>(max_blocks * block_size * HEAD_DIM)?;
///     let table = stream.clone_htod(&(0..max_blocks as i32).collect::<Vec<_>>())?;
///     let mut seq_lens = stream.clone_htod(&[1i32])?;
///     let q = stream.alloc_zeros::<bf16>(heads * HEAD_DIM)?;
///     let mut out = stream.alloc_zeros::<bf16>(heads * LATENT_DIM)?;
///
///     let graph = {
///         let args = DenseArgs {
///             q: Query::contiguous(&q, heads),
///             kv_cache: KvCache::contiguous(&cache, KvFormat::Bf16, block_size)?,
///             block_table: BlockTable::new(&table, TableShape { batch, max_blocks_per_seq: max_blocks }),
///             seq_lens: &seq_lens,
///             softmax_scale: 0.0625,
///         };
///         let mut step = || -> Result<()> {
///             dense_decode(&stream, &mut plan, &args, &mut Output::contiguous(&mut out, heads), None, Some(&mut flag))
///         };
///         step()?; // warm-up: every kernel launched once outside the capture
///         // SAFETY: plan, flag, cache, table, seq_lens, q and out outlive `graph` (declared
///         // before it, dropped after it) and are not reallocated.
///         unsafe { capture_graph(&stream, step)? }
///     };
///     // The reset is not in the graph, so the flag keeps the first fault of any replay.
///     // (To tell which replay faulted: capture `flag.reset` first and `flag.copy_to` a
///     // per-step slot last, or `read_async_into` a FlagReading after each launch.)
///     flag.reset(&stream)?;
///     for step in 2..100 {
///         stream.memcpy_htod(&[step], &mut seq_lens)?; // the next step's length
///         graph.launch()?;
///     }
///     flag.check(&stream)?; // synchronizes, once: covers every replay since the reset
///     Ok(())
/// }
/// ```
pub unsafe fn capture_graph<F>(stream: &Arc<CudaStream>, body: F) -> Result<CudaGraph>
where
    F: FnOnce() -> Result<()>,
{
    if stream.context().is_event_tracking() {
        return Err(Error::Capture(
            "cudarc's event tracking is on: call `unsafe { ctx.disable_event_tracking() }` \
             before allocating the buffers to capture (see capture_graph's docs)"
                .to_string(),
        ));
    }
    match stream.capture_status()? {
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => {}
        status => {
            return Err(Error::Capture(format!(
                "the stream is already capturing ({status:?})"
            )))
        }
    }
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let body = body();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    body?;
    match graph {
        Ok(Some(graph)) => Ok(graph),
        Ok(None) => Err(Error::Capture("nothing was captured".to_string())),
        Err(e) => Err(capture_failed(e)),
    }
}

fn capture_failed(e: DriverError) -> Error {
    Error::Capture(format!(
        "ending the capture failed with {:?} (a synchronizing or allocating call inside the \
         body invalidates it)",
        e.0
    ))
}
