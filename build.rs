//! Build script: compiles the `.cu` files under `csrc/` with nvcc (optimized, `-lineinfo`, never `-G`) for
//! the architectures in `MLA_CUDA_ARCHS`, links the CUDA runtime statically and runs
//! bindgen over `csrc/mla_decode.h`.
//!
//! Without nvcc (or under docs.rs) the kernels are skipped, the crate still compiles
//! with `cfg(mla_no_kernels)`, and every call returns `Error::KernelsNotBuilt`; with
//! `MLA_REQUIRE_KERNELS=1` a missing nvcc fails the build instead.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const HEADER: &str = "csrc/mla_decode.h";
const DEFAULT_ARCHS: &str = "120,90";

fn main() {
    println!("cargo:rustc-check-cfg=cfg(mla_no_kernels)");
    println!("cargo:rerun-if-changed=csrc");
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "PATH",
        "MLA_CUDA_ARCHS",
        "MLA_NVCC_FLAGS",
        "DOCS_RS",
        "MLA_NO_KERNELS",
        "MLA_REQUIRE_KERNELS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    generate_bindings(&out_dir);

    if env::var_os("DOCS_RS").is_some() || env::var_os("MLA_NO_KERNELS").is_some_and(|v| v != "0") {
        build_stubs();
        return;
    }
    let Some(nvcc) = find_nvcc() else {
        const NOT_FOUND: &str = "mla-decode: nvcc not found (tried $NVCC, $CUDA_HOME/bin, \
                                 $CUDA_PATH/bin, PATH, /usr/local/cuda/bin)";
        const INSTALL: &str = "Install a CUDA toolkit >= 12.8 (or `pip install \
             nvidia-cuda-nvcc==13.0.* nvidia-cuda-runtime==13.0.* nvidia-cuda-crt==13.0.* \
             nvidia-nvvm==13.0.* nvidia-cuda-cccl==13.0.*`) and set NVCC=/path/to/nvcc.";
        if env::var_os("MLA_REQUIRE_KERNELS").is_some_and(|v| v != "0") {
            panic!("{NOT_FOUND} and MLA_REQUIRE_KERNELS is set. {INSTALL}");
        }
        println!(
            "cargo:warning={NOT_FOUND}; building WITHOUT kernels: every call returns \
             Error::KernelsNotBuilt. {INSTALL}"
        );
        build_stubs();
        return;
    };
    compile_kernels(&nvcc);
}

/// No kernels: the C ABI is provided by `csrc/no_kernels.c`, whose every function
/// returns `MLA_STATUS_NOT_BUILT`, so that the crate links and reports it clearly.
fn build_stubs() {
    println!("cargo:rustc-cfg=mla_no_kernels");
    cc::Build::new()
        .file("csrc/no_kernels.c")
        .include("csrc")
        .warnings(false)
        .compile("mla_decode_kernels");
}

fn generate_bindings(out_dir: &Path) {
    let bindings = bindgen::Builder::default()
        .header(HEADER)
        .allowlist_function("mla_.*")
        .allowlist_type("mla_.*")
        .allowlist_var("MLA_.*")
        .default_enum_style(bindgen::EnumVariation::Rust {
            non_exhaustive: false,
        })
        // a status comes back from C: a library newer than these bindings may return a value
        // they do not know, which a Rust enum could not hold without undefined behaviour
        .newtype_enum("mla_status_t")
        .derive_default(true)
        .derive_debug(true)
        .derive_copy(true)
        .layout_tests(false)
        .generate()
        .expect("bindgen failed on csrc/mla_decode.h (is libclang installed? apt-get install libclang-dev)");
    bindings
        .write_to_file(out_dir.join("bindings.rs"))
        .expect("writing bindings.rs");
}

/// `NVCC`, then `CUDA_HOME`/`CUDA_PATH`, then `PATH`, then `/usr/local/cuda`.
fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        println!(
            "cargo:warning=mla-decode: NVCC={} is not a file; searching elsewhere",
            p.display()
        );
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env::var_os(var) {
            let p = PathBuf::from(root).join("bin").join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let p = PathBuf::from("/usr/local/cuda/bin/nvcc");
    p.is_file().then_some(p)
}

fn archs() -> Vec<u32> {
    let spec = env::var("MLA_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());
    let mut archs: Vec<u32> = spec
        .split([',', ';', ' '])
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.trim()
                .trim_start_matches("sm_")
                .parse()
                .unwrap_or_else(|_| {
                    panic!("MLA_CUDA_ARCHS: bad architecture {s:?} (want e.g. 120,90)")
                })
        })
        .collect();
    archs.sort_unstable();
    archs.dedup();
    assert!(!archs.is_empty(), "MLA_CUDA_ARCHS is empty");
    for &a in &archs {
        assert!(
            a >= 80,
            "MLA_CUDA_ARCHS: sm_{a} lacks mma.sync bf16 / cp.async (need >= 80)"
        );
    }
    archs
}

/// Every `.cu` file under `dir`, recursively (the kernels live in subfolders of csrc/).
fn collect_cu(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("reading csrc/").path();
        if path.is_dir() {
            collect_cu(&path, out);
        } else if path.extension().is_some_and(|e| e == "cu") {
            out.push(path);
        }
    }
}

fn compile_kernels(nvcc: &Path) {
    let archs = archs();
    let newest = *archs.last().unwrap();
    let version = Command::new(nvcc)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let release = version
        .lines()
        .find_map(|l| l.split("release ").nth(1))
        .and_then(|r| r.split(',').next())
        .unwrap_or("?")
        .to_string();
    println!(
        "cargo:warning=mla-decode: nvcc {} (release {release}), archs {archs:?}",
        nvcc.display()
    );

    // cc looks nvcc up through $NVCC; setting it (rather than .compiler()) keeps cc's
    // wrapping of host flags in -Xcompiler.
    env::set_var("NVCC", nvcc);
    let mut build = cc::Build::new();
    build
        .cuda(true)
        .cudart("none") // linked below, from wherever this toolkit keeps it
        .debug(false) // never -G: device debug makes kernels 10-100x slower
        .opt_level(3)
        .include("csrc")
        .flag("-std=c++17")
        .flag("-lineinfo")
        .flag("--expt-relaxed-constexpr")
        .flag("-Xptxas=-warn-spills,-warn-lmem-usage")
        .warnings(false);
    for &a in &archs {
        build.flag(format!("-gencode=arch=compute_{a},code=sm_{a}"));
    }
    build.flag(format!(
        "-gencode=arch=compute_{newest},code=compute_{newest}"
    ));
    if let Ok(extra) = env::var("MLA_NVCC_FLAGS") {
        for f in extra.split_whitespace() {
            build.flag(f);
        }
    }
    // One translation unit including every .cu file under csrc/ (csrc/cache_ops.cu,
    // csrc/decode/*.cu, ...): with several .cu files cc compiles relocatable device code
    // (--device-c + device link), which changes register allocation (it spilled on sm_120);
    // whole-program compilation does not.
    let mut sources = Vec::new();
    collect_cu(Path::new("csrc"), &mut sources);
    sources.sort();
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let unity: String = sources
        .iter()
        .map(|p| format!("#include \"{}\"\n", manifest.join(p).display()))
        .collect();
    let unity_path = PathBuf::from(env::var("OUT_DIR").unwrap()).join("mla_decode_all.cu");
    std::fs::write(&unity_path, unity).expect("writing the unity .cu");
    build.file(&unity_path);
    build.compile("mla_decode_kernels");

    // Static CUDA runtime: the PyPI wheels keep it in lib/, toolkits in lib64/ or
    // targets/<arch>-linux/lib.
    let root = nvcc
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("/"));
    for sub in [
        "lib",
        "lib64",
        "targets/x86_64-linux/lib",
        "targets/sbsa-linux/lib",
    ] {
        let dir = root.join(sub);
        if dir.join("libcudart_static.a").is_file() {
            println!("cargo:rustc-link-search=native={}", dir.display());
        }
    }
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}
