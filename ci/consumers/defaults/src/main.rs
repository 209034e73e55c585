//! An application that depends on mla-decode alone: asks whether CUDA is usable and, when it
//! is, opens device 0. `--expect-no-gpu` makes it fail unless the answer is `false` (CI has
//! no driver).

use mla_decode::cudarc::driver::CudaContext;
use mla_decode::{cuda_available, DeviceInfo, MlaConfig, HEAD_DIM};

fn main() {
    let expect_no_gpu = std::env::args().any(|a| a == "--expect-no-gpu");
    let available = cuda_available();
    println!("cuda_available() = {available}");
    let cfg = MlaConfig::glm5().tensor_parallel(8).expect("GLM-5 at TP8");
    println!(
        "GLM-5 at TP8: {} heads per GPU, rows of {HEAD_DIM}",
        cfg.num_heads
    );
    if available {
        let ctx = CudaContext::new(0).expect("a context on device 0");
        let info = DeviceInfo::query(&ctx).expect("device 0's properties");
        println!("device 0: {} ({})", info.name, info.sm_name());
    }
    assert!(
        !(expect_no_gpu && available),
        "cuda_available() says true on a machine expected to have no GPU"
    );
}
