//! The rest of the host side: config presets, fault codes and flag words, the status
//! mapping, formats and dims.

use mla_decode::{
    status_to_result, DType, Error, ErrorFlag, FaultCode, KvFormat, MlaConfig, HEAD_DIM,
    LATENT_DIM, ROPE_DIM,
};

use super::expect;

#[test]
fn config_presets() {
    let glm = MlaConfig::glm5();
    assert_eq!(
        (
            glm.num_heads,
            glm.qk_nope_head_dim,
            glm.qk_rope_head_dim,
            glm.kv_lora_rank
        ),
        (64, 192, 64, 512)
    );
    assert_eq!(glm.softmax_scale(), 0.0625);
    assert_eq!(glm.tensor_parallel(8).unwrap().num_heads, 8);
    assert_eq!(glm.tensor_parallel(8).unwrap().softmax_scale(), 0.0625);

    let ds = MlaConfig::deepseek_v3();
    assert_eq!((ds.num_heads, ds.qk_nope_head_dim), (128, 128));
    let yarn = ds.yarn.unwrap();
    assert!((yarn.mscale() - 1.368_88).abs() < 1e-4, "{}", yarn.mscale());
    let expected = 1.873_854 / 192f32.sqrt();
    assert!((ds.softmax_scale() - expected).abs() < 1e-6);
    assert_eq!(ds.heads_per_gpu(8), Ok(16));
    assert_eq!(ds.tensor_parallel(128).unwrap().num_heads, 1);
    expect(ds.tensor_parallel(3).map(|_| ()), "tp", "does not divide");
    expect(ds.tensor_parallel(256).map(|_| ()), "tp", "");
    assert_eq!(ds.with_softmax_scale(0.2).softmax_scale(), 0.2);

    let bad_rank = MlaConfig {
        kv_lora_rank: 256,
        ..glm
    };
    expect(bad_rank.check(), "kv_lora_rank", "512");
}

#[test]
fn fault_codes_and_flag_words() {
    let codes = [
        (1, FaultCode::BadBlockId),
        (2, FaultCode::NegativeSeqLen),
        (3, FaultCode::SeqLenTooLarge),
        (4, FaultCode::BadSlotId),
        (5, FaultCode::BadReqId),
        (6, FaultCode::BadAppendSlot),
        (7, FaultCode::BadTopkLen),
        (8, FaultCode::BadKvScale),
        (42, FaultCode::Unknown(42)),
    ];
    for (n, code) in codes {
        assert_eq!(FaultCode::from_u32(n), code);
        assert_eq!(code.as_u32(), n);
    }
    assert_eq!(ErrorFlag::interpret([0, 0, 0, 0]), Ok(()));
    let fault = ErrorFlag::interpret([1, 7, 123_456, 0]).unwrap_err();
    assert_eq!(
        fault,
        Error::DeviceFault {
            code: FaultCode::BadBlockId,
            row: 7,
            value: 123_456
        }
    );
    assert!(fault.to_string().contains("block-table entry"));
    // Words 2 and 3 are the value's low and high halves.
    assert_eq!(
        ErrorFlag::interpret([6, 2, 5, 2]),
        Err(Error::DeviceFault {
            code: FaultCode::BadAppendSlot,
            row: 2,
            value: (1 << 33) + 5
        })
    );
    assert_eq!(
        ErrorFlag::interpret([2, 0, (-3i32) as u32, u32::MAX]),
        Err(Error::DeviceFault {
            code: FaultCode::NegativeSeqLen,
            row: 0,
            value: -3
        })
    );
}

#[test]
fn status_mapping() {
    assert_eq!(status_to_result("mla_dense_decode", 0), Ok(()));
    assert_eq!(
        status_to_result("mla_dense_decode", 4),
        Err(Error::KernelsNotBuilt)
    );
    assert_eq!(
        status_to_result("mla_dense_decode", 3),
        Err(Error::NoDevice)
    );
    assert!(matches!(
        status_to_result("mla_dense_decode", 6),
        Err(Error::Cuda {
            call: "mla_dense_decode",
            ..
        })
    ));
    assert!(matches!(
        status_to_result("mla_dense_decode", 5),
        Err(Error::InvalidArgument { arg: "plan", .. })
    ));
    assert!(matches!(
        status_to_result("mla_sparse_decode", 1),
        Err(Error::Rejected {
            call: "mla_sparse_decode",
            ..
        })
    ));
    assert!(matches!(
        status_to_result("mla_sparse_decode", 2),
        Err(Error::Unsupported(_))
    ));
    let msg = Error::KernelsNotBuilt.to_string();
    assert!(msg.contains("nvcc") && msg.contains("NVCC"), "{msg}");
}

#[test]
fn formats_and_dims() {
    assert_eq!(KvFormat::F16.row_bytes(), 1152);
    assert_eq!(KvFormat::Bf16.row_bytes(), 1152);
    assert_eq!(KvFormat::Fp8DsMla.row_bytes(), 656);
    assert_eq!(KvFormat::Fp8DsMla.name(), "fp8_ds_mla");
    assert_eq!(KvFormat::Fp8PerTensor.row_bytes(), 576);
    assert!(KvFormat::Fp8PerTensor.needs_tensor_scale());
    assert_eq!(KvFormat::Bf16.dtype(), Some(DType::Bf16));
    assert_eq!(HEAD_DIM, LATENT_DIM + ROPE_DIM);
    assert_eq!(DType::F16.kv_format(), KvFormat::F16);
}

/// The argument structs, views, plans and flags can be made on one thread and used on
/// another (an engine's scheduler thread builds a step, a worker enqueues it).
#[test]
fn api_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    use mla_decode::half::bf16;
    send_sync::<mla_decode::DenseArgs<'static, bf16>>();
    send_sync::<mla_decode::SparseArgs<'static, bf16>>();
    send_sync::<mla_decode::AppendArgs<'static, bf16>>();
    send_sync::<mla_decode::AppendSplitArgs<'static, bf16>>();
    send_sync::<mla_decode::GatherArgs<'static>>();
    send_sync::<mla_decode::Query<'static, bf16>>();
    send_sync::<mla_decode::Output<'static, bf16>>();
    send_sync::<mla_decode::KvCache<'static>>();
    send_sync::<mla_decode::KvCacheMut<'static>>();
    send_sync::<mla_decode::DecodePlan>();
    send_sync::<ErrorFlag>();
}

/// The C entry points run inside engines' CUDA-graph captures, where a synchronizing call, a
/// stream query or an allocation invalidates the capture (session 49's `cudaStreamGetDevice`
/// did, on every decode). No source file under `csrc/` makes such a call, except on a failure
/// path marked `capture: failure path` on its line or the line before (after a launch has
/// failed, there is nothing left to capture). The GPU's `graph::` tests are the real check;
/// this one catches the call on a CPU run.
#[test]
fn c_sources_make_no_capture_breaking_calls() {
    const BREAKING: [&str; 12] = [
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaStreamQuery",
        "cudaStreamGetDevice",
        "cudaEventSynchronize",
        "cudaEventQuery",
        "cudaMalloc(",
        "cudaMallocHost",
        "cudaFree(",
        "cudaMemcpy(",
        "cudaMemset(",
        "cudaDeviceReset",
    ];
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("csrc");
    let mut files = vec![root.clone()];
    let mut found = Vec::new();
    let mut scanned = 0;
    while let Some(path) = files.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                files.push(entry.unwrap().path());
            }
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        scanned += 1;
        let mut previous = "";
        for (i, line) in text.lines().enumerate() {
            // code only: no comment lines, nothing after `//`
            let code = line.split("//").next().unwrap_or("");
            let trimmed = code.trim_start();
            let comment = trimmed.starts_with('*') || trimmed.starts_with("/*");
            let marked = [line, previous]
                .iter()
                .any(|l| l.contains("capture: failure path"));
            if !comment && !marked {
                for call in BREAKING.iter().filter(|c| code.contains(*c)) {
                    found.push(format!("{}:{}: {call}", path.display(), i + 1));
                }
            }
            previous = line;
        }
    }
    assert!(scanned >= 10, "read only {scanned} files under {root:?}");
    assert!(
        found.is_empty(),
        "calls that break a graph capture: {found:#?}"
    );
}
