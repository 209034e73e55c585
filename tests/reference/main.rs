//! CPU property tests of the f64 reference (`mla_decode::reference`): its semantics are checked
//! against each other (sparse vs dense, split + merge vs whole, causal rows vs shorter requests)
//! and against direct formulas, on fresh random data; `edge_cases`: hand-made cases; `fp8`: the
//! fp8_ds_mla quantization; `kit_runners`: the test kit against the reference.

use mla_decode::reference::{
    attend, dense_decode, fault_code, gather_slots, merge, sparse_decode, Attention, DenseProblem,
    Fault, GatherProblem, PagedCache, SparseProblem, HEAD_DIM, LATENT_DIM,
};
use proptest::prelude::*;

#[path = "../kit/mod.rs"]
mod kit;

mod edge_cases;
mod fp8;
mod kit_runners;

use kit::Rng;

/// A length in 0..=cap, often one of the edges.
fn random_len(rng: &mut Rng, cap: usize, block_size: usize) -> usize {
    match rng.below(8) {
        0 => 0,
        1 => 1,
        2 => cap,
        3 => (1 + rng.below(cap / block_size)) * block_size,
        _ => rng.below(cap + 1),
    }
}

/// A random dense problem: distinct blocks per request, spare blocks at the end.
struct Setup {
    batch: usize,
    q_len: usize,
    heads: usize,
    block_size: usize,
    mbps: usize,
    num_blocks: usize,
    cache: Vec<f64>,
    q: Vec<f64>,
    table: Vec<i32>,
    seq_lens: Vec<i32>,
    scale: f64,
}

impl Setup {
    fn random(rng: &mut Rng, batch: usize, q_len: usize, heads: usize, mbps: usize) -> Setup {
        let block_size = [16, 32][rng.below(2)];
        let num_blocks = batch * mbps + 3;
        let mut blocks: Vec<i32> = (0..num_blocks as i32).collect();
        rng.shuffle(&mut blocks);
        let cap = mbps * block_size;
        Setup {
            batch,
            q_len,
            heads,
            block_size,
            mbps,
            num_blocks,
            cache: rng.units(num_blocks * block_size * HEAD_DIM),
            q: rng.units(batch * q_len * heads * HEAD_DIM),
            table: blocks[..batch * mbps].to_vec(),
            seq_lens: (0..batch)
                .map(|_| random_len(rng, cap, block_size) as i32)
                .collect(),
            scale: 0.03 + 0.3 * (rng.unit() + 1.0),
        }
    }

    fn cap(&self) -> usize {
        self.mbps * self.block_size
    }

    fn cache(&self) -> PagedCache<'_> {
        PagedCache {
            data: &self.cache,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
        }
    }

    fn dense(&self) -> DenseProblem<'_> {
        DenseProblem {
            q: &self.q,
            batch: self.batch,
            q_len: self.q_len,
            num_heads: self.heads,
            cache: self.cache(),
            block_table: &self.table,
            max_blocks_per_seq: self.mbps,
            seq_lens: &self.seq_lens,
            softmax_scale: self.scale,
        }
    }

    /// Gather for one token per entry of `req_id`, all with the same positions row.
    fn gather(&self, req_id: &[i32], positions_row: &[i32]) -> (Vec<i32>, Vec<Fault>) {
        let positions: Vec<i32> = req_id
            .iter()
            .flat_map(|_| positions_row.iter().copied())
            .collect();
        gather_slots(&GatherProblem {
            positions: &positions,
            num_tokens: req_id.len(),
            topk: positions_row.len(),
            req_id,
            block_table: &self.table,
            max_blocks_per_seq: self.mbps,
            seq_lens: &self.seq_lens,
            batch: self.batch,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
        })
    }

    /// Global slot ids of positions 0..cap of every request (-1 from L on).
    fn all_slots(&self) -> Vec<i32> {
        let req: Vec<i32> = (0..self.batch as i32).collect();
        let (slots, faults) = self.gather(&req, &(0..self.cap() as i32).collect::<Vec<_>>());
        assert!(faults.is_empty());
        slots
    }

    /// Sparse problem with one token per request (q_len must be 1).
    fn sparse<'a>(&'a self, indices: &'a [i32], topk_len: Option<&'a [i32]>) -> SparseProblem<'a> {
        assert_eq!(self.q_len, 1);
        SparseProblem {
            q: &self.q,
            num_tokens: self.batch,
            num_heads: self.heads,
            cache: self.cache(),
            indices,
            topk: indices.len() / self.batch,
            topk_len,
            softmax_scale: self.scale,
        }
    }

    fn q_head(&self, row: usize, head: usize) -> &[f64] {
        &self.q[(row * self.heads + head) * HEAD_DIM..][..HEAD_DIM]
    }
}

fn close(x: f64, y: f64, tol: f64) -> bool {
    x == y || (x - y).abs() <= tol * (1.0 + y.abs())
}

/// Same shape, same faults, out and lse within `tol` (relative, floor 1), no NaN anywhere.
fn assert_close(a: &Attention, b: &Attention, tol: f64) {
    assert_eq!((a.num_heads, a.rows()), (b.num_heads, b.rows()), "shape");
    assert_eq!(a.out.len(), b.out.len());
    for (i, (&x, &y)) in a.lse.iter().zip(&b.lse).enumerate() {
        assert!(!x.is_nan() && !y.is_nan(), "NaN lse at {i}");
        assert!(close(x, y, tol), "lse[{i}]: {x} vs {y}");
    }
    for (i, (&x, &y)) in a.out.iter().zip(&b.out).enumerate() {
        assert!(!x.is_nan() && !y.is_nan(), "NaN out at {i}");
        assert!(
            close(x, y, tol),
            "out[{i}] (row·head {}): {x} vs {y}",
            i / LATENT_DIM
        );
    }
}

/// (row, head) is exactly empty: out all +0/-0 and lse exactly -inf.
fn assert_empty(a: &Attention, row: usize, head: usize) {
    assert!(
        a.out_row(row, head).iter().all(|&x| x == 0.0),
        "row {row} head {head} out not 0"
    );
    assert_eq!(
        a.lse_at(row, head),
        f64::NEG_INFINITY,
        "row {row} head {head} lse"
    );
}

fn assert_non_empty(a: &Attention, row: usize, head: usize) {
    assert!(
        a.lse_at(row, head).is_finite(),
        "row {row} head {head} should see keys"
    );
}

fn rows_of<'c>(cache: &'c [f64], slots: &[usize]) -> Vec<&'c [f64]> {
    slots
        .iter()
        .map(|&s| &cache[s * HEAD_DIM..][..HEAD_DIM])
        .collect()
}

fn same_attend(got: &Attention, row: usize, head: usize, want: &(Vec<f64>, f64), tol: f64) {
    let lse = got.lse_at(row, head);
    assert!(
        close(lse, want.1, tol),
        "row {row} head {head} lse {lse} vs {}",
        want.1
    );
    for (j, (&x, &y)) in got.out_row(row, head).iter().zip(&want.0).enumerate() {
        assert!(
            close(x, y, tol),
            "row {row} head {head} out[{j}] {x} vs {y}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Sparse over a request's slots (gathered from positions 0..L) equals dense with q_len 1,
    /// with -1 padding or with topk_len = L.
    #[test]
    fn sparse_over_all_slots_equals_dense(seed in any::<u64>(), batch in 1usize..4,
                                          heads in 1usize..5, mbps in 1usize..6) {
        let mut rng = Rng::new(seed);
        let s = Setup::random(&mut rng, batch, 1, heads, mbps);
        let dense = dense_decode(&s.dense());
        assert!(dense.faults.is_empty());
        let slots = s.all_slots();
        let padded = sparse_decode(&s.sparse(&slots, None));
        assert_close(&padded, &dense, 1e-12);
        let limited = sparse_decode(&s.sparse(&slots, Some(&s.seq_lens)));
        assert_close(&limited, &dense, 1e-12);
        for b in 0..batch {
            for h in 0..heads {
                if s.seq_lens[b] == 0 { assert_empty(&dense, b, h) } else { assert_non_empty(&dense, b, h) }
            }
        }
    }

    /// Two sparse calls over the two halves of each slot list, merged by lse, equal the whole.
    #[test]
    fn split_and_merge_equals_whole(seed in any::<u64>(), batch in 1usize..4,
                                     heads in 1usize..5, mbps in 1usize..6) {
        let mut rng = Rng::new(seed);
        let s = Setup::random(&mut rng, batch, 1, heads, mbps);
        let slots = s.all_slots();
        let topk = s.cap();
        let (mut first, mut second) = (slots.clone(), slots.clone());
        for b in 0..batch {
            let split = rng.below(topk + 1);
            first[b * topk + split..(b + 1) * topk].fill(-1);
            second[b * topk..b * topk + split].fill(-1);
        }
        let whole = sparse_decode(&s.sparse(&slots, None));
        let a = sparse_decode(&s.sparse(&first, None));
        let b = sparse_decode(&s.sparse(&second, None));
        assert_close(&merge(&a, &b), &whole, 1e-12);
        assert_close(&merge(&b, &a), &whole, 1e-12);
        assert_close(&dense_decode(&s.dense()), &whole, 1e-12);
    }

    /// Permuting a token's sparse indices (random slots, some -1) changes nothing.
    #[test]
    fn sparse_permutation_invariant(seed in any::<u64>(), batch in 1usize..4,
                                    heads in 1usize..5, topk in 1usize..200) {
        let mut rng = Rng::new(seed);
        let s = Setup::random(&mut rng, batch, 1, heads, 4);
        let slots = (s.num_blocks * s.block_size) as i32;
        let indices: Vec<i32> = (0..batch * topk)
            .map(|_| if rng.below(5) == 0 { -1 } else { rng.below(slots as usize) as i32 })
            .collect();
        let mut shuffled = indices.clone();
        for row in shuffled.chunks_exact_mut(topk) {
            rng.shuffle(row);
        }
        let a = sparse_decode(&s.sparse(&indices, None));
        let b = sparse_decode(&s.sparse(&shuffled, None));
        assert!(a.faults.is_empty());
        assert_close(&a, &b, 1e-12);
    }

    /// Adding a constant to every score leaves out unchanged and shifts lse by it: q has c in a
    /// RoPE dim where every key has 1.0.
    #[test]
    fn score_shift_changes_only_lse(seed in any::<u64>(), n in 1usize..300,
                                    c in -50.0f64..50.0, scale in 0.01f64..1.0) {
        let mut rng = Rng::new(seed);
        let mut keys = rng.units(n * HEAD_DIM);
        for k in keys.chunks_exact_mut(HEAD_DIM) {
            k[HEAD_DIM - 1] = 1.0;
        }
        let mut q = rng.units(HEAD_DIM);
        q[HEAD_DIM - 1] = 0.0;
        let base = attend(&q, keys.chunks_exact(HEAD_DIM), scale);
        q[HEAD_DIM - 1] = c;
        let shifted = attend(&q, keys.chunks_exact(HEAD_DIM), scale);
        for (&x, &y) in shifted.0.iter().zip(&base.0) {
            assert!(close(x, y, 1e-12), "{x} vs {y}");
        }
        let want = base.1 + scale * c;
        assert!((shifted.1 - want).abs() <= 1e-12 * (1.0 + want.abs()), "{} vs {want}", shifted.1);
    }

    /// `attend` equals the textbook formula (no max subtraction) where that does not overflow.
    #[test]
    fn attend_matches_naive_formula(seed in any::<u64>(), n in 1usize..200, scale in 0.01f64..0.2) {
        let mut rng = Rng::new(seed);
        let keys = rng.units(n * HEAD_DIM);
        let q = rng.units(HEAD_DIM);
        let (out, lse) = attend(&q, keys.chunks_exact(HEAD_DIM), scale);
        let mut want = vec![0.0; LATENT_DIM];
        let mut sum = 0.0;
        for k in keys.chunks_exact(HEAD_DIM) {
            let w = (scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>()).exp();
            sum += w;
            for (o, v) in want.iter_mut().zip(k) {
                *o += w * v;
            }
        }
        assert!(close(lse, sum.ln(), 1e-12), "{lse} vs {}", sum.ln());
        for (&x, &y) in out.iter().zip(&want) {
            assert!(close(x, y / sum, 1e-12), "{x} vs {}", y / sum);
        }
    }

    /// Query row i of a q_len = 4 request of length L equals q_len = 1 on length L - 4 + i + 1.
    #[test]
    fn dense_causal_rows_match_shorter_requests(seed in any::<u64>(), batch in 1usize..4,
                                                heads in 1usize..4, mbps in 1usize..5) {
        let mut rng = Rng::new(seed);
        let q_len = 4;
        let s = Setup::random(&mut rng, batch, q_len, heads, mbps);
        let full = dense_decode(&s.dense());
        assert!(full.faults.is_empty());
        for b in 0..batch {
            for i in 0..q_len {
                let r = b * q_len + i;
                let visible = (s.seq_lens[b] - q_len as i32 + i as i32 + 1).max(0);
                let mut seq_lens = s.seq_lens.clone();
                seq_lens[b] = visible;
                let mut q = vec![0.5; batch * heads * HEAD_DIM];
                q[b * heads * HEAD_DIM..][..heads * HEAD_DIM]
                    .copy_from_slice(&s.q[r * heads * HEAD_DIM..][..heads * HEAD_DIM]);
                let one = dense_decode(&DenseProblem { q: &q, q_len: 1, seq_lens: &seq_lens, ..s.dense() });
                for h in 0..heads {
                    assert_eq!(full.lse_at(r, h), one.lse_at(b, h), "b {b} i {i} h {h}");
                    assert_eq!(full.out_row(r, h), one.out_row(b, h), "b {b} i {i} h {h}");
                    if visible == 0 { assert_empty(&full, r, h) } else { assert_non_empty(&full, r, h) }
                }
            }
        }
    }

    /// seq_len above max_blocks_per_seq·block_size is clamped (same result as the cap) and faults.
    #[test]
    fn dense_too_large_seq_len_is_clamped(seed in any::<u64>(), heads in 1usize..4,
                                          mbps in 1usize..5, excess in 1i32..100_000) {
        let mut rng = Rng::new(seed);
        let mut s = Setup::random(&mut rng, 2, 2, heads, mbps);
        let cap = s.cap() as i32;
        s.seq_lens = vec![cap, (cap / 2).max(1)];
        let want = dense_decode(&s.dense());
        let big = if excess > 99_990 { i32::MAX } else { cap + excess };
        s.seq_lens[0] = big;
        let got = dense_decode(&s.dense());
        assert_eq!(got.faults, vec![Fault { code: fault_code::SEQ_LEN_TOO_LARGE, row: 0, value: big as i64 }]);
        assert_eq!((got.out, got.lse), (want.out, want.lse));
    }

    /// Bad block-table entries: their rows are skipped (same as attending over the remaining rows
    /// only, and as sparse over the gathered slots) and each one below L faults once.
    #[test]
    fn dense_bad_block_ids_are_skipped(seed in any::<u64>(), batch in 1usize..4,
                                       heads in 1usize..4, mbps in 1usize..6) {
        let mut rng = Rng::new(seed);
        let mut s = Setup::random(&mut rng, batch, 1, heads, mbps);
        let nb = s.num_blocks as i32;
        let bad = [-1, -7, nb, nb + 100, i32::MIN, i32::MAX];
        for e in s.table.iter_mut() {
            if rng.below(3) == 0 {
                *e = bad[rng.below(bad.len())];
            }
        }
        let got = dense_decode(&s.dense());
        let bs = s.block_size;
        let mut want_faults = Vec::new();
        for b in 0..batch {
            let len = s.seq_lens[b] as usize;
            let mut slots = Vec::new();
            for pos in 0..len {
                let e = s.table[b * mbps + pos / bs];
                if (0..nb).contains(&e) {
                    slots.push(e as usize * bs + pos % bs);
                } else if pos % bs == 0 {
                    want_faults.push(Fault { code: fault_code::BAD_BLOCK_ID, row: b as u32, value: e as i64 });
                }
            }
            for h in 0..heads {
                let want = attend(s.q_head(b, h), rows_of(&s.cache, &slots), s.scale);
                same_attend(&got, b, h, &want, 0.0);
                if slots.is_empty() { assert_empty(&got, b, h) }
            }
        }
        assert_eq!(got.faults, want_faults);
        // The gather masks the same rows (one fault per position) and sparse over it agrees.
        let all: Vec<i32> = (0..s.cap() as i32).collect();
        let (slots, gather_faults) = s.gather(&(0..batch as i32).collect::<Vec<_>>(), &all);
        let mut want_gather_faults = Vec::new();
        for b in 0..batch {
            for pos in 0..s.seq_lens[b] as usize {
                let e = s.table[b * mbps + pos / bs];
                if !(0..nb).contains(&e) {
                    want_gather_faults.push(Fault { code: fault_code::BAD_BLOCK_ID, row: b as u32, value: e as i64 });
                }
            }
        }
        assert_eq!(gather_faults, want_gather_faults);
        let sparse = sparse_decode(&s.sparse(&slots, None));
        assert!(sparse.faults.is_empty());
        assert_close(&sparse, &got, 0.0);
    }

    /// Sparse ids other than -1 outside the cache are skipped (same as leaving them out) and
    /// each one faults with its token and value; topk_len hides later entries, bad ones included.
    #[test]
    fn sparse_bad_ids_are_skipped(seed in any::<u64>(), batch in 1usize..4,
                                  heads in 1usize..4, topk in 1usize..100) {
        let mut rng = Rng::new(seed);
        let s = Setup::random(&mut rng, batch, 1, heads, 3);
        let slots = (s.num_blocks * s.block_size) as i32;
        let bad = [-2, -100, slots, slots + 1, i32::MIN, i32::MAX];
        let indices: Vec<i32> = (0..batch * topk)
            .map(|_| match rng.below(4) {
                0 => bad[rng.below(bad.len())],
                1 => -1,
                _ => rng.below(slots as usize) as i32,
            })
            .collect();
        let topk_len: Vec<i32> = (0..batch).map(|_| rng.below(topk + 20) as i32 - 10).collect();
        for limit in [None, Some(&topk_len[..])] {
            let got = sparse_decode(&s.sparse(&indices, limit));
            let mut want_faults = Vec::new();
            for t in 0..batch {
                if let Some(l) = limit.filter(|l| l[t] < 0 || l[t] as usize > topk) {
                    want_faults.push(Fault { code: fault_code::BAD_TOPK_LEN, row: t as u32, value: l[t] as i64 });
                }
                let n = limit.map_or(topk, |l| l[t].clamp(0, topk as i32) as usize);
                let row = &indices[t * topk..][..n];
                let good: Vec<usize> = row.iter().filter(|&&i| (0..slots).contains(&i)).map(|&i| i as usize).collect();
                for &id in row.iter().filter(|&&i| i != -1 && !(0..slots).contains(&i)) {
                    want_faults.push(Fault { code: fault_code::BAD_SLOT_ID, row: t as u32, value: id as i64 });
                }
                for h in 0..heads {
                    let want = attend(s.q_head(t, h), rows_of(&s.cache, &good), s.scale);
                    same_attend(&got, t, h, &want, 0.0);
                    if good.is_empty() { assert_empty(&got, t, h) }
                }
            }
            assert_eq!(got.faults, want_faults);
        }
    }

    /// The gather equals its formula on random positions (in and out of range).
    #[test]
    fn gather_matches_formula(seed in any::<u64>(), batch in 1usize..5, topk in 1usize..64) {
        let mut rng = Rng::new(seed);
        let s = Setup::random(&mut rng, batch, 1, 1, 4);
        let tokens = 1 + rng.below(8);
        let req: Vec<i32> = (0..tokens).map(|_| rng.below(batch) as i32).collect();
        let positions: Vec<i32> =
            (0..tokens * topk).map(|_| rng.below(s.cap() + 20) as i32 - 10).collect();
        let (got, faults) = gather_slots(&GatherProblem {
            positions: &positions, num_tokens: tokens, topk, req_id: &req, block_table: &s.table,
            max_blocks_per_seq: s.mbps, seq_lens: &s.seq_lens, batch, block_size: s.block_size,
            num_blocks: s.num_blocks,
        });
        assert!(faults.is_empty());
        for t in 0..tokens {
            let r = req[t] as usize;
            for k in 0..topk {
                let pos = positions[t * topk + k];
                let want = if pos < 0 || pos >= s.seq_lens[r] {
                    -1
                } else {
                    let pos = pos as usize;
                    s.table[r * s.mbps + pos / s.block_size] * s.block_size as i32 + (pos % s.block_size) as i32
                };
                assert_eq!(got[t * topk + k], want, "token {t} entry {k} pos {pos}");
            }
        }
    }

}
