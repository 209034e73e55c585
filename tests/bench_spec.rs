//! CPU tests of the bench's own logic (`benches/common/`, included here as the bench
//! includes it): the case grammar (lengths `lens=` / `klen=`, the older `long=`, the append
//! case, canonical names that parse back), the bound on rotated cache copies, the byte and FLOP accounting.

#[path = "../benches/common/mod.rs"]
mod common;

use common::cases::dense::visible_rows;
use common::cases::lens_label;
use common::cases::sparse::used_entries;
use common::cases::CacheBytes;
use common::gpu::{copies_for, ROTATE_MAX_COPIES};
use common::spec::{
    default_cases, AppendSpec, CacheKind, CaseSpec, DenseSpec, Lens, SparseSpec,
    DEFAULT_BLOCK_SIZE, DEFAULT_GRID, DEFAULT_POOL,
};
use mla_decode::{DType, KvFormat, ScaleRule, BLOCK_SIZES};

fn parse(text: &str) -> CaseSpec {
    CaseSpec::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn dense(text: &str) -> DenseSpec {
    match parse(text) {
        CaseSpec::Dense(d) => d,
        other => panic!("{text}: not dense: {other:?}"),
    }
}

fn name_of(d: &DenseSpec) -> String {
    CaseSpec::Dense(d.clone()).name()
}

fn sparse(text: &str) -> SparseSpec {
    match parse(text) {
        CaseSpec::Sparse(s) => s,
        other => panic!("{text}: not sparse: {other:?}"),
    }
}

fn append(text: &str) -> AppendSpec {
    match parse(text) {
        CaseSpec::Append(a) => a,
        other => panic!("{text}: not an append: {other:?}"),
    }
}

#[track_caller]
fn refused(text: &str, needle: &str) {
    match CaseSpec::parse(text) {
        Ok(spec) => panic!("{text}: accepted as {spec:?}"),
        Err(e) => assert!(e.contains(needle), "{text}: error `{e}` lacks `{needle}`"),
    }
}

/// Every default case parses, and its name parses back to the same case (names are what
/// `--case` and `--filter` take).
#[test]
fn default_grid_names_round_trip() {
    let cases = default_cases();
    assert_eq!(cases.len(), DEFAULT_GRID.len());
    for spec in cases {
        let name = spec.name();
        assert_eq!(parse(&name), spec, "{name}");
        assert_eq!(parse(&name).name(), name);
    }
    for (text, name) in [
        (
            "dense:b=64,h=8,l=4096",
            "dense:b=64,q=1,h=8,l=4096,bs=64,dtype=bf16",
        ),
        ("sparse:t=1,h=8", "sparse:t=1,h=8,k=2048,dtype=bf16"),
        ("gather:t=128,k=2048", "gather:t=128,k=2048"),
        (
            "dense:h=8,lens=512*15+8192*1",
            "dense:b=16,q=1,h=8,lens=512*15+8192*1,bs=64,dtype=bf16",
        ),
        (
            "sparse:t=64,h=8,klen=uniform:1-2048",
            "sparse:t=64,h=8,k=2048,dtype=bf16,klen=uniform:1-2048",
        ),
    ] {
        assert_eq!(parse(text).name(), name, "{text}");
    }
    for text in [
        "dense:b=1,h=8,l=1",
        "dense:h=8,lens=uniform:1-8192,b=64",
        "dense:h=8,lens=512*15+8192*1",
        "dense:h=16,lens=1024*127+65536*1",
        "dense:b=16,h=8,l=4096",
        "sparse:t=64,h=8,klen=uniform:1-2048",
        "sparse:t=1,h=8,k=1",
        // issue #15's compute-bound rows
        "dense:b=64,h=64,l=4096",
        "dense:b=128,h=128,l=4096",
        "dense:b=32,q=4,h=16,l=4096",
        "sparse:t=64,h=64",
        "sparse:t=128,h=128",
        "sparse:t=128,h=32",
    ] {
        let spec = parse(text);
        assert!(
            default_cases().contains(&spec),
            "{text} is not in the default grid"
        );
    }
}

/// `uniform:LO-HI`: b lengths in LO..=HI, the same for the same seed, other ones for
/// another; the seed is part of the name when it is not 0.
#[test]
fn uniform_lengths() {
    let d = dense("dense:h=8,lens=uniform:1-8192,b=64");
    assert_eq!(d.lens, Some(Lens::Uniform { lo: 1, hi: 8192 }));
    let lens = d.seq_lens();
    assert_eq!(lens.len(), 64);
    assert!(lens.iter().all(|&l| (1..=8192).contains(&l)), "{lens:?}");
    assert!(lens.iter().any(|&l| l != lens[0]), "{lens:?}");
    assert_eq!(d.seq_lens(), lens, "deterministic");
    assert_eq!(d.table_len(), *lens.iter().max().unwrap());
    assert_eq!(d.lens_label(), "uniform:1-8192");

    let d7 = dense("dense:h=8,lens=uniform:1-8192,b=64,seed=7");
    assert_ne!(d7.seq_lens(), lens);
    assert!(name_of(&d7).ends_with(",seed=7"), "{}", name_of(&d7));
    assert_eq!(parse(&name_of(&d7)), CaseSpec::Dense(d7.clone()));
    // inclusive at both ends
    let edge = dense("dense:h=1,lens=uniform:3-4,b=200");
    let l = edge.seq_lens();
    assert!(l.contains(&3) && l.contains(&4) && l.iter().all(|&x| x == 3 || x == 4));
    assert_eq!(
        dense("dense:h=1,lens=uniform:5-5,b=3").seq_lens(),
        [5, 5, 5]
    );

    refused("dense:h=8,lens=uniform:1-8192", "`b` is required");
    refused("dense:h=8,lens=uniform:9-8,b=2", "LO > HI");
    refused("dense:h=8,lens=uniform:8,b=2", "uniform:LO-HI");
    refused("dense:h=8,lens=uniform:0-8,b=2", "shorter than q=1");
    refused("dense:h=8,q=4,lens=uniform:3-8,b=2", "shorter than q=4");
    refused("dense:h=8,l=64,b=2,seed=3", "seed= is only used");
    refused("dense:h=8,lens=4*2,seed=3", "seed= is only used");
}

/// `A*N+B*M`: N of A then M of B; b optional but must agree; l optional, at least the
/// longest, sizes the table.
#[test]
fn run_lengths() {
    let d = dense("dense:h=8,lens=512*15+8192*1");
    assert_eq!(d.batch, 16);
    let mut want = vec![512; 15];
    want.push(8192);
    assert_eq!(d.seq_lens(), want);
    assert_eq!(d.table_len(), 8192);
    assert_eq!(d.lens_label(), "512*15+8192*1");
    assert_eq!(dense("dense:h=8,lens=512*15+8192*1,b=16"), d);

    let three = dense("dense:h=2,lens=7*1+1*2+9*1");
    assert_eq!(three.seq_lens(), [7, 1, 1, 9]);
    let wide = dense("dense:h=8,lens=512*15+8192*1,l=10000");
    assert_eq!(wide.table_len(), 10000);
    assert_eq!(parse(&name_of(&wide)), CaseSpec::Dense(wide.clone()));
    assert!(name_of(&wide).contains(",l=10000,lens=512*15+8192*1,"));

    refused(
        "dense:h=8,lens=512*15+8192*1,b=15",
        "b=15 but the lengths give 16",
    );
    refused(
        "dense:h=8,lens=512*15+8192*1,l=8000",
        "l=8000 is shorter than",
    );
    refused("dense:h=8,lens=512*0", "a count of 0");
    refused("dense:h=8,lens=512*2+", "expected LEN*COUNT");
    refused("dense:h=8,lens=512", "expected LEN*COUNT");
    refused("dense:h=8,lens=x*2", "`x` is not a count");
    refused(
        "dense:h=8,q=2,lens=1*3+5*1",
        "a length of 1 is shorter than q=2",
    );
    refused("dense:h=8", "`b` is required");
    refused("dense:b=2,h=8", "`l` (or `lens`) is required");
}

/// The plain spelling is unchanged: b lengths of l; `long=N` is `lens=N*1+l*(b-1)`.
#[test]
fn plain_and_long_lengths() {
    let d = dense("dense:b=4,h=8,l=100");
    assert_eq!(d.seq_lens(), [100; 4]);
    assert_eq!(d.table_len(), 100);
    assert_eq!(d.lens_label(), "100*4");
    refused("dense:b=4,h=8,q=2,l=1", "l of 1 is shorter than q=2");
    refused("dense:h=8,l=100", "`b` is required");

    let long = dense("dense:b=32,h=8,l=1024,long=131072");
    assert_eq!(long, dense("dense:h=8,lens=131072*1+1024*31"));
    assert_eq!(long.table_len(), 131072);
    assert_eq!(dense("dense:b=1,h=8,l=5,long=77").seq_lens(), [77]);
    refused("dense:b=32,h=8,long=131072", "long=N needs l=");
    refused(
        "dense:h=8,l=5,lens=4*2,long=9",
        "long=N needs l= and no lens=",
    );
}

/// `klen`: per-row topk_len; k defaults to the longest and may not be shorter; t optional
/// with runs.
#[test]
fn sparse_topk_lengths() {
    let s = sparse("sparse:t=64,h=8,klen=uniform:1-2048");
    assert_eq!(s.topk, 2048);
    let lens = s.topk_lens().unwrap();
    assert_eq!(lens.len(), 64);
    assert!(lens.iter().all(|&l| (1..=2048).contains(&l)));
    assert_eq!(s.lens_label(), "uniform:1-2048");
    assert_eq!(sparse("sparse:t=64,h=8,klen=uniform:1-100").topk, 100);
    assert_eq!(
        sparse("sparse:t=64,h=8,klen=uniform:1-100,k=4096").topk,
        4096
    );
    assert_eq!(sparse("sparse:t=1,h=8,k=1").topk_lens(), None);
    assert_eq!(sparse("sparse:t=3,h=8").lens_label(), "2048*3");
    let runs = sparse("sparse:h=8,klen=0*1+5*2");
    assert_eq!((runs.tokens, runs.topk), (3, 5));
    assert_eq!(runs.topk_lens().unwrap(), [0, 5, 5]);

    refused(
        "sparse:t=64,h=8,klen=uniform:1-2048,k=1000",
        "more than k=1000",
    );
    refused("sparse:t=64,h=8,klen=uniform:1-5000", "more than 4096");
    refused("sparse:t=4,h=8,klen=5*2", "t=4 but the lengths give 2");
    refused("sparse:h=8,klen=uniform:1-5", "`t` is required");
    refused("sparse:t=2,h=8,seed=1", "seed= is only used");
}

/// Rotation: enough copies to read 4 x L2 between two runs of the same copy, but never more
/// than the cap (a one-token call would need ~200,000) nor 8 GiB of them.
#[test]
fn rotation_is_bounded() {
    let l2 = 60 << 20; // an H200
    let row = 1152;
    let bytes = |rows: usize| CacheBytes {
        size: rows * row,
        read: rows * row,
    };
    // dense b=1 l=1: one row read per step
    let one = CacheBytes {
        size: 64 * row,
        read: row,
    };
    let err = copies_for(l2, one).unwrap_err();
    assert!(err.contains("cap"), "{err}");
    // dense b=1 l=4096: 4.7 MB a step
    assert_eq!(copies_for(l2, bytes(4096)), Ok(55));
    // sparse t=1 k=2048 over a 65,536-slot pool
    let sparse_t1 = CacheBytes {
        size: 65_536 * row,
        read: 2048 * row,
    };
    assert_eq!(copies_for(l2, sparse_t1), Ok(108));
    // a step that reads 4 x L2 itself needs no copy
    assert_eq!(copies_for(l2, bytes(4 * l2 / row + 1)), Ok(1));
    // every accepted count is within the cap, and just past it is refused
    for rows in 1..2000 {
        if let Ok(c) = copies_for(l2, bytes(rows * 64)) {
            assert!((1..=ROTATE_MAX_COPIES).contains(&c));
        }
    }
    let small = (4 * l2).div_ceil(ROTATE_MAX_COPIES);
    assert!(copies_for(
        l2,
        CacheBytes {
            size: small,
            read: small
        }
    )
    .is_err());
    // too many bytes of copies
    let big = CacheBytes {
        size: 4 << 30,
        read: 16 << 20,
    };
    assert!(copies_for(l2, big).unwrap_err().contains("GiB"));
    assert!(copies_for(0, bytes(10)).is_err());
}

/// Bytes and FLOP count what a step reads and computes: the sum of the lengths, causal
/// rows for q_len > 1, the ids up to each row's topk_len.
#[test]
fn accounting_uses_the_real_lengths() {
    assert_eq!(visible_rows(&[4096], 1), 4096.0);
    assert_eq!(visible_rows(&[512, 8192], 1), 8704.0);
    // q_len 2: rows see L-1 and L
    assert_eq!(visible_rows(&[10], 2), 19.0);
    assert_eq!(visible_rows(&[1], 2), 1.0);
    assert_eq!(visible_rows(&[0, -3], 3), 0.0);

    let ids = [1, 2, 3, 4, 5, 6, -1, 8];
    assert_eq!(used_entries(&ids, 4, None), ids);
    assert_eq!(used_entries(&ids, 4, Some(&[2, 3])), [1, 2, 5, 6, -1]);
    assert_eq!(used_entries(&ids, 4, Some(&[-1, 99])), [5, 6, -1, 8]);

    assert_eq!(lens_label(&[4096; 64]), "4096*64");
    assert_eq!(lens_label(&[512, 512, 8192]), "512*2+8192*1");
    assert_eq!(lens_label(&[1, 2, 3, 4, 5, 6]), "6 lengths 1-6");
    assert_eq!(DType::Bf16.name(), "bf16");
}

/// `kv=`: the fp8 formats and scale rules, the query's dtype by default (and when named, which
/// the canonical name leaves out), names that parse back, and the JSON's names.
#[test]
fn cache_kinds() {
    let d = dense("dense:b=64,h=8,l=4096");
    assert_eq!(d.kv, CacheKind::Query);
    assert_eq!(dense("dense:b=64,h=8,l=4096,kv=bf16"), d);
    assert_eq!(
        dense("dense:b=64,h=8,l=4096,dtype=f16,kv=f16").kv,
        CacheKind::Query
    );
    for (text, kind, format, json, rule) in [
        (
            "fp8_ds_mla",
            CacheKind::Fp8DsMla(ScaleRule::Raw),
            KvFormat::Fp8DsMla,
            "fp8_ds_mla",
            Some("raw"),
        ),
        (
            "fp8_ds_mla_pow2",
            CacheKind::Fp8DsMla(ScaleRule::Pow2),
            KvFormat::Fp8DsMla,
            "fp8_ds_mla",
            Some("pow2"),
        ),
        (
            "fp8",
            CacheKind::Fp8,
            KvFormat::Fp8PerTensor,
            "fp8",
            Some("tensor"),
        ),
    ] {
        for dtype in ["bf16", "f16"] {
            let d = dense(&format!("dense:b=64,h=8,l=4096,dtype={dtype},kv={text}"));
            assert_eq!(d.kv, kind, "{text}");
            assert_eq!(kind.format(d.dtype), format);
            assert_eq!(kind.json_format(d.dtype), json);
            assert_eq!(kind.scale_rule(), rule);
            let name = name_of(&d);
            assert!(name.ends_with(&format!(",kv={text}")), "{name}");
            assert_eq!(dense(&name), d);
            let s = sparse(&format!(
                "sparse:t=8,h=8,pool=131072,dtype={dtype},kv={text}"
            ));
            assert_eq!(s.kv, kind);
            assert_eq!(sparse(&CaseSpec::Sparse(s.clone()).name()), s);
        }
    }
    assert_eq!(CacheKind::Query.json_format(DType::Bf16), "bf16");
    assert_eq!(CacheKind::Query.scale_rule(), None);
    refused("dense:b=1,h=8,l=64,kv=f16", "kv=`f16`");
    refused("sparse:t=1,h=8,kv=fp4", "kv=`fp4`");
}

/// Defaults, the canonical name (`dtype` always, other keys when not the default), and
/// the grid's rows.
#[test]
fn append_defaults_and_names() {
    let a = append("append:t=128");
    let want = AppendSpec {
        tokens: 128,
        dtype: DType::Bf16,
        kv: CacheKind::Query,
        block_size: DEFAULT_BLOCK_SIZE,
        pool: DEFAULT_POOL,
    };
    assert_eq!(a, want);
    let spec = CaseSpec::Append(a);
    assert_eq!(spec.name(), "append:t=128,dtype=bf16");
    assert_eq!((spec.kind(), spec.uses_plan()), ("append", false));
    assert_eq!(
        append("append:t=128,kv=bf16,dtype=bf16,bs=64,pool=65536"),
        a
    );
    for (text, name) in [
        (
            "append:t=128,kv=fp8_ds_mla",
            "append:t=128,dtype=bf16,kv=fp8_ds_mla",
        ),
        (
            "append:t=4096,kv=fp8_ds_mla",
            "append:t=4096,dtype=bf16,kv=fp8_ds_mla",
        ),
        ("append:t=8,dtype=f16,kv=f16", "append:t=8,dtype=f16"),
        (
            "append:t=8,kv=fp8,bs=128,pool=1000",
            "append:t=8,dtype=bf16,pool=1000,bs=128,kv=fp8",
        ),
        // the default pool grows with t
        ("append:t=100000", "append:t=100000,dtype=bf16"),
        ("append:t=100000,pool=100000", "append:t=100000,dtype=bf16"),
        (
            "append:t=100000,pool=100001",
            "append:t=100000,dtype=bf16,pool=100001",
        ),
    ] {
        assert_eq!(CaseSpec::parse(text).map(|s| s.name()), Ok(name.into()));
    }
    for row in ["append:t=128,kv=fp8_ds_mla", "append:t=4096,kv=fp8_ds_mla"] {
        assert!(
            DEFAULT_GRID.contains(&row),
            "{row} is not in the default grid"
        );
    }
    assert_eq!(append("append:t=100000").pool, 100_000);
    assert_eq!(append("append:t=5,pool=5").pool, 5);
}

/// Every format, dtype and block size: the name parses back to the same case.
#[test]
fn append_names_round_trip() {
    let kinds = [
        CacheKind::Query,
        CacheKind::Fp8DsMla(ScaleRule::Raw),
        CacheKind::Fp8DsMla(ScaleRule::Pow2),
        CacheKind::Fp8,
    ];
    for dtype in [DType::Bf16, DType::F16] {
        for kv in kinds {
            for block_size in BLOCK_SIZES {
                for (tokens, pool) in [(1, DEFAULT_POOL), (4096, 4096), (70_000, 70_000)] {
                    let a = AppendSpec {
                        tokens,
                        dtype,
                        kv,
                        block_size,
                        pool,
                    };
                    let name = CaseSpec::Append(a).name();
                    assert_eq!(append(&name), a, "{name}");
                    assert_eq!(CaseSpec::parse(&name).map(|s| s.name()), Ok(name));
                }
            }
        }
    }
}

#[test]
fn append_refusals() {
    refused("append:kv=fp8", "`t` is required");
    refused("append:t=0", "t=0 must be at least 1");
    refused("append:t=8,pool=7", "pool=7 has fewer slots than t=8");
    refused("append:t=100000,pool=65536", "fewer slots than t=100000");
    refused("append:t=8,pool=3000000000", "does not fit int32");
    // a 16-bit cache holds the rows' own dtype
    refused("append:t=8,dtype=f16,kv=bf16", "kv=`bf16` (expected f16");
    refused("append:t=8,kv=f16", "kv=`f16` (expected bf16");
    refused("append:t=8,dtype=fp8", "dtype=`fp8`");
    refused("append:t=8,bs=7", "bs=7 is not one of");
    refused("append:t=8,h=8", "unknown key `h`");
    refused("append:t=8,k=2048", "unknown key `k`");
    refused("appnd:t=8", "dense, sparse, gather or append");
}
