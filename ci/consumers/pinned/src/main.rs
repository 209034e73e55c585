//! An application that picks cudarc's linking mode (a feature of this crate) and pins CUDA 12.8
//! through its own cudarc: the cudarc mla-decode uses. Asks whether CUDA is usable and, when it
//! is, opens device 0. With `--expect=false` or `--expect=true` it only checks the answer (and
//! fails unless it is that one).

use cudarc::driver::CudaContext;
use mla_decode::{cuda_available, DeviceInfo, MlaConfig, HEAD_DIM};

fn main() {
    let expect = std::env::args().find_map(|a| a.strip_prefix("--expect=").map(|v| v == "true"));
    let available = cuda_available();
    println!("cuda_available() = {available}");
    // The application's cudarc and mla-decode's are one crate (one set of features).
    let query: fn(&CudaContext) -> mla_decode::Result<DeviceInfo> = DeviceInfo::query;
    let cfg = MlaConfig::glm5().tensor_parallel(8).expect("GLM-5 at TP8");
    println!(
        "GLM-5 at TP8: {} heads per GPU, rows of {HEAD_DIM}",
        cfg.num_heads
    );
    if let Some(want) = expect {
        assert_eq!(available, want, "cuda_available()");
        return;
    }
    if available {
        let ctx = CudaContext::new(0).expect("a context on device 0");
        let info = query(&ctx).expect("device 0's properties");
        println!("device 0: {} ({})", info.name, info.sm_name());
    }
}
