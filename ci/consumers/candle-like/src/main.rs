//! A candle-style application: its own cudarc (candle's features) is the cudarc mla-decode
//! uses, so device objects pass between the two. Asks whether CUDA is usable and, when it is,
//! opens device 0. `--expect-no-gpu` makes it fail unless the answer is `false`.

use cudarc::driver::CudaContext;
use mla_decode::{cuda_available, DeviceInfo, MlaConfig, HEAD_DIM};

fn main() {
    let expect_no_gpu = std::env::args().any(|a| a == "--expect-no-gpu");
    let available = cuda_available();
    println!("cuda_available() = {available}");
    // The application's cudarc and mla-decode's are one crate (one set of features).
    let query: fn(&CudaContext) -> mla_decode::Result<DeviceInfo> = DeviceInfo::query;
    let cfg = MlaConfig::glm5().tensor_parallel(8).expect("GLM-5 at TP8");
    println!(
        "GLM-5 at TP8: {} heads per GPU, rows of {HEAD_DIM}",
        cfg.num_heads
    );
    if available {
        let ctx = CudaContext::new(0).expect("a context on device 0");
        let info = query(&ctx).expect("device 0's properties");
        println!("device 0: {} ({})", info.name, info.sm_name());
    }
    assert!(
        !(expect_no_gpu && available),
        "cuda_available() says true on a machine expected to have no GPU"
    );
}
