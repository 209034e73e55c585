//! CPU property tests of the f64 reference (`mla_decode::reference`): its semantics are checked
//! against each other (sparse vs dense, split + merge vs whole, causal rows vs shorter requests)
//! and against direct formulas, on fresh random data.

use mla_decode::reference::fp8::{self, ScaleRule};
use mla_decode::reference::{
    attend, dense_decode, fault_code, gather_slots, merge, sparse_decode, Attention, DenseProblem,
    Fault, GatherProblem, PagedCache, SparseProblem, HEAD_DIM, LATENT_DIM,
};
use proptest::prelude::*;

/// SplitMix64: the data of a case is drawn from a seed proptest picks.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    fn values(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.unit()).collect()
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    /// A length in 0..=cap, often one of the edges.
    fn len(&mut self, cap: usize, block_size: usize) -> usize {
        match self.below(8) {
            0 => 0,
            1 => 1,
            2 => cap,
            3 => (1 + self.below(cap / block_size)) * block_size,
            _ => self.below(cap + 1),
        }
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
            cache: rng.values(num_blocks * block_size * HEAD_DIM),
            q: rng.values(batch * q_len * heads * HEAD_DIM),
            table: blocks[..batch * mbps].to_vec(),
            seq_lens: (0..batch)
                .map(|_| rng.len(cap, block_size) as i32)
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
        let mut rng = Rng(seed);
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
        let mut rng = Rng(seed);
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
        let mut rng = Rng(seed);
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
        let mut rng = Rng(seed);
        let mut keys = rng.values(n * HEAD_DIM);
        for k in keys.chunks_exact_mut(HEAD_DIM) {
            k[HEAD_DIM - 1] = 1.0;
        }
        let mut q = rng.values(HEAD_DIM);
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
        let mut rng = Rng(seed);
        let keys = rng.values(n * HEAD_DIM);
        let q = rng.values(HEAD_DIM);
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
        let mut rng = Rng(seed);
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
        let mut rng = Rng(seed);
        let mut s = Setup::random(&mut rng, 2, 2, heads, mbps);
        let cap = s.cap() as i32;
        s.seq_lens = vec![cap, (cap / 2).max(1)];
        let want = dense_decode(&s.dense());
        let big = if excess > 99_990 { i32::MAX } else { cap + excess };
        s.seq_lens[0] = big;
        let got = dense_decode(&s.dense());
        assert_eq!(got.faults, vec![Fault { code: fault_code::SEQ_LEN_TOO_LARGE, row: 0, value: big }]);
        assert_eq!((got.out, got.lse), (want.out, want.lse));
    }

    /// Bad block-table entries: their rows are skipped (same as attending over the remaining rows
    /// only, and as sparse over the gathered slots) and each one below L faults once.
    #[test]
    fn dense_bad_block_ids_are_skipped(seed in any::<u64>(), batch in 1usize..4,
                                       heads in 1usize..4, mbps in 1usize..6) {
        let mut rng = Rng(seed);
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
                    want_faults.push(Fault { code: fault_code::BAD_BLOCK_ID, row: b as u32, value: e });
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
                    want_gather_faults.push(Fault { code: fault_code::BAD_BLOCK_ID, row: b as u32, value: e });
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
        let mut rng = Rng(seed);
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
                let n = limit.map_or(topk, |l| l[t].clamp(0, topk as i32) as usize);
                let row = &indices[t * topk..][..n];
                let good: Vec<usize> = row.iter().filter(|&&i| (0..slots).contains(&i)).map(|&i| i as usize).collect();
                for &id in row.iter().filter(|&&i| i != -1 && !(0..slots).contains(&i)) {
                    want_faults.push(Fault { code: fault_code::BAD_SLOT_ID, row: t as u32, value: id });
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
        let mut rng = Rng(seed);
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

    /// fp8_ds_mla with FlashMLA's power-of-two scales: error within e4m3's bound, scales as ruled.
    #[test]
    fn fp8_round_trip_power_of_two(seed in any::<u64>(), exps in prop::array::uniform4(-24i32..12)) {
        check_fp8_round_trip(seed, exps, ScaleRule::PowerOfTwo);
    }

    /// fp8_ds_mla with vLLM's exact amax/448 scales: error within e4m3's bound.
    #[test]
    fn fp8_round_trip_exact(seed in any::<u64>(), exps in prop::array::uniform4(-24i32..12)) {
        check_fp8_round_trip(seed, exps, ScaleRule::Exact);
    }

    /// bf16 rounding equals half's (correct for f32 inputs) and never double-rounds f64 inputs.
    #[test]
    fn bf16_rounding(x in any::<f32>().prop_filter("finite", |x| x.is_finite())) {
        let want = half::bf16::from_f32(x);
        prop_assert_eq!(fp8::bf16_encode(x as f64), want.to_bits());
        prop_assert_eq!(fp8::bf16_decode(want.to_bits()), want.to_f64());
        // Just above a tie between two bf16 values (only bits below f32's reach): rounds up.
        let (lo, hi) = (want.to_f64(), f32::from_bits((want.to_bits() as u32 + 1) << 16) as f64);
        if want.to_f64() > 0.0 && hi.is_finite() {
            let above_tie = (lo + hi) / 2.0 + (hi - lo) * 2f64.powi(-40);
            prop_assert_eq!(fp8::bf16_decode(fp8::bf16_encode(above_tie)), hi);
        }
    }
}

/// Rows whose four tiles have magnitudes around 2^exps[i] (some elements 0 or tiny).
fn check_fp8_round_trip(seed: u64, exps: [i32; 4], rule: ScaleRule) {
    let mut rng = Rng(seed);
    for _ in 0..8 {
        let mut row = rng.values(HEAD_DIM);
        for x in row[LATENT_DIM..].iter_mut() {
            *x = *x as f32 as f64; // so that half's f32 -> bf16 is an exact reference
        }
        for (tile, &e) in row[..LATENT_DIM].chunks_exact_mut(fp8::TILE).zip(&exps) {
            for x in tile.iter_mut() {
                *x *= 2f64.powi(e);
                match rng.below(16) {
                    0 => *x = 0.0,
                    1 => *x *= 2f64.powi(-12),
                    _ => {}
                }
            }
        }
        let bytes = fp8::quantize_row(&row, rule);
        assert_eq!(bytes.len(), fp8::ROW_BYTES);
        assert!(
            bytes[..LATENT_DIM].iter().all(|&b| b & 0x7f != 0x7f),
            "NaN code written"
        );
        let back = fp8::dequantize_row(&bytes);
        let scales = fp8::row_scales(&bytes);
        for (i, tile) in row[..LATENT_DIM].chunks_exact(fp8::TILE).enumerate() {
            let amax = tile.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let scale = scales[i] as f64;
            match rule {
                ScaleRule::PowerOfTwo => {
                    assert!(scale >= 1e-4 && scale == 2f64.powi(scale.log2().round() as i32));
                    let r = amax / scale; // in (224, 448] up to f32 rounding, unless floored
                    assert!(r <= 448.0 * (1.0 + 1e-6), "tile {i}: amax/scale {r}");
                    assert!(
                        amax / 448.0 <= 1e-4 || r >= 224.0 * (1.0 - 1e-6),
                        "tile {i}: {r}"
                    );
                }
                ScaleRule::Exact => {
                    assert_eq!(scales[i], (amax as f32 / 448.0).max(f32::MIN_POSITIVE))
                }
            }
            for (j, &x) in tile.iter().enumerate() {
                let d = back[i * fp8::TILE + j];
                let bound = 0.0625 * x.abs() + scale * 2f64.powi(-9) + x.abs() * 1e-7;
                assert!(
                    (d - x).abs() <= bound,
                    "tile {i} [{j}]: {x} -> {d} (scale {scale})"
                );
            }
        }
        for (&x, &d) in row[LATENT_DIM..].iter().zip(&back[LATENT_DIM..]) {
            assert_eq!(d, half::bf16::from_f32(x as f32).to_f64(), "rope {x}");
        }
        assert_eq!(
            fp8::dequantize_cache(&fp8::quantize_cache(&row, rule)),
            back.to_vec()
        );
    }
}

/// Every e4m3 code decodes to its value and (but for NaN) encodes back to itself.
#[test]
fn e4m3_all_codes() {
    let mut values = Vec::new();
    for code in 0..=255u8 {
        let v = fp8::e4m3_decode(code);
        if code & 0x7f == 0x7f {
            assert!(v.is_nan());
            continue;
        }
        assert!(v.abs() <= 448.0);
        assert_eq!(fp8::e4m3_encode(v), code, "code {code:#x} value {v}");
        values.push(v);
    }
    assert_eq!(fp8::e4m3_decode(0x7e), 448.0);
    assert_eq!(fp8::e4m3_decode(0x01), 2f64.powi(-9));
    assert_eq!(fp8::e4m3_decode(0x08), 2f64.powi(-6));
    assert_eq!(fp8::e4m3_decode(0x38), 1.0);
    assert_eq!(fp8::e4m3_decode(0xb8), -1.0);
    values.sort_by(f64::total_cmp);
    values.dedup(); // +0 and -0
    assert_eq!(values.len(), 253);
}

/// Round to nearest even, saturation to ±448, NaN never produced.
#[test]
fn e4m3_rounding_and_saturation() {
    let cases = [
        (1.0625, 0x38), // tie between 1 and 1.125: even mantissa
        (1.0625 + 1e-12, 0x39),
        (1.1875, 0x3a), // tie between 1.125 and 1.25: even mantissa
        (448.0, 0x7e),
        (464.0, 0x7e), // tie between 448 and (the NaN code's) 480
        (470.0, 0x7e), // saturates
        (1e30, 0x7e),
        (f64::INFINITY, 0x7e),
        (-1e30, 0xfe),
        (f64::NEG_INFINITY, 0xfe),
        (2f64.powi(-10), 0x00), // tie between 0 and the smallest subnormal
        (1.5 * 2f64.powi(-10), 0x01),
        (2.5 * 2f64.powi(-9), 0x02),
        (7.5 * 2f64.powi(-9), 0x08), // rounds up into the smallest normal
        (1e-30, 0x00),
        (f64::NAN, 0x00),
    ];
    for (x, code) in cases {
        assert_eq!(fp8::e4m3_encode(x), code, "{x}");
    }
    // Every value within the range rounds to a nearest code.
    let mut rng = Rng(7);
    for _ in 0..10_000 {
        let x = rng.unit() * 2f64.powi(rng.below(20) as i32 - 10);
        let d = fp8::e4m3_decode(fp8::e4m3_encode(x));
        let err = (d - x).abs();
        for code in 0..=255u8 {
            let v = fp8::e4m3_decode(code);
            assert!(
                v.is_nan() || (v - x).abs() >= err,
                "{x} -> {d}, but {v} is nearer"
            );
        }
    }
}

/// A single key gives out = V and lse = its score exactly; huge scores stay finite.
#[test]
fn attend_single_key_and_huge_scores() {
    let mut rng = Rng(11);
    let q = rng.values(HEAD_DIM);
    let keys = rng.values(5 * HEAD_DIM);
    let k0 = &keys[..HEAD_DIM];
    let (out, lse) = attend(&q, [k0], 0.25);
    assert_eq!(out, &k0[..LATENT_DIM]);
    let score: f64 = 0.25 * q.iter().zip(k0).map(|(a, b)| a * b).sum::<f64>();
    assert!(close(lse, score, 1e-14));
    // Scale 1e4: scores around ±1e5, far beyond exp's range; the arg-max key's V wins.
    let (out, lse) = attend(&q, keys.chunks_exact(HEAD_DIM), 1e4);
    assert!(lse.is_finite() && out.iter().all(|x| x.is_finite()));
    let best = keys
        .chunks_exact(HEAD_DIM)
        .max_by(|a, b| {
            let (sa, sb): (f64, f64) = (
                q.iter().zip(*a).map(|(x, y)| x * y).sum(),
                q.iter().zip(*b).map(|(x, y)| x * y).sum(),
            );
            sa.total_cmp(&sb)
        })
        .unwrap();
    for (&x, &y) in out.iter().zip(best) {
        assert!(close(x, y, 1e-9), "{x} vs {y}");
    }
    let none: [&[f64]; 0] = [];
    let (out, lse) = attend(&q, none, 1.0);
    assert!(out.iter().all(|&x| x == 0.0) && out.len() == LATENT_DIM);
    assert_eq!(lse, f64::NEG_INFINITY);
}

/// Merging with an empty result is the identity (bitwise); two empties stay empty.
#[test]
fn merge_with_empty_is_identity() {
    let mut rng = Rng(3);
    let mut s = Setup::random(&mut rng, 3, 2, 4, 3);
    s.seq_lens = vec![0, 5, s.cap() as i32];
    let r = dense_decode(&s.dense());
    let empty = Attention::empty(r.rows(), r.num_heads);
    assert_eq!(merge(&r, &empty), r);
    assert_eq!(merge(&empty, &r), r);
    let both = merge(&empty, &empty);
    assert_eq!(both, empty);
    for row in 0..r.rows() {
        for h in 0..4 {
            assert_empty(&both, row, h);
        }
    }
    assert_empty(&r, 0, 0); // seq_len 0
    assert_empty(&r, 1, 3); // seq_len 0, second query row
}

/// Dense empty cases: seq_len 0, every block id invalid, early rows of q_len > seq_len.
#[test]
fn dense_empty_cases() {
    let mut rng = Rng(5);
    let mut s = Setup::random(&mut rng, 4, 4, 2, 3);
    let nb = s.num_blocks as i32;
    s.seq_lens = vec![0, 2, 40, 1];
    s.table[6..9].copy_from_slice(&[-1, nb, i32::MIN]); // request 2: all invalid
    let r = dense_decode(&s.dense());
    let bad = |e| Fault {
        code: fault_code::BAD_BLOCK_ID,
        row: 2,
        value: e,
    };
    let want_faults: Vec<Fault> = match s.block_size {
        16 => vec![bad(-1), bad(nb), bad(i32::MIN)], // 40 rows span 3 blocks of 16
        _ => vec![bad(-1), bad(nb)],                 // 2 blocks of 32
    };
    assert_eq!(r.faults, want_faults);
    for h in 0..2 {
        for i in 0..4 {
            assert_empty(&r, i, h); // seq_len 0
            assert_empty(&r, 8 + i, h); // all blocks invalid
        }
        // seq_len 2, q_len 4: rows 0 and 1 see nothing, rows 2 and 3 see 1 and 2 slots.
        assert_empty(&r, 4, h);
        assert_empty(&r, 5, h);
        assert_non_empty(&r, 6, h);
        assert_non_empty(&r, 7, h);
        // seq_len 1: only the last row sees slot 0.
        for i in 0..3 {
            assert_empty(&r, 12 + i, h);
        }
        assert_non_empty(&r, 15, h);
    }
    assert!(r.out.iter().chain(&r.lse).all(|x| !x.is_nan()));
}

/// Negative seq_len: empty, fault with the value; the other requests are unaffected.
#[test]
fn dense_negative_seq_len() {
    let mut rng = Rng(9);
    let mut s = Setup::random(&mut rng, 2, 1, 3, 2);
    s.seq_lens = vec![-5, 10];
    let got = dense_decode(&s.dense());
    assert_eq!(
        got.faults,
        vec![Fault {
            code: fault_code::NEGATIVE_SEQ_LEN,
            row: 0,
            value: -5
        }]
    );
    s.seq_lens[0] = 0;
    let zero = dense_decode(&s.dense());
    assert!(zero.faults.is_empty());
    assert_eq!((&got.out, &got.lse), (&zero.out, &zero.lse));
    for h in 0..3 {
        assert_empty(&got, 0, h);
        assert_non_empty(&got, 1, h);
    }
}

/// Sparse empty cases: all -1, topk_len 0 (even over bad ids), all bad ids (faults recorded).
#[test]
fn sparse_empty_cases() {
    let mut rng = Rng(13);
    let s = Setup::random(&mut rng, 3, 1, 2, 2);
    let slots = (s.num_blocks * s.block_size) as i32;
    let topk = 5;
    let mut indices = vec![-1; 3 * topk];
    indices[topk..2 * topk].copy_from_slice(&[slots, -3, 0, 1, 2]);
    indices[2 * topk..].copy_from_slice(&[i32::MAX, i32::MIN, slots, -2, -1]);
    let r = sparse_decode(&s.sparse(&indices, Some(&[4, 0, 9])));
    let bad = |v| Fault {
        code: fault_code::BAD_SLOT_ID,
        row: 2,
        value: v,
    };
    assert_eq!(
        r.faults,
        vec![bad(i32::MAX), bad(i32::MIN), bad(slots), bad(-2)]
    );
    for t in 0..3 {
        for h in 0..2 {
            assert_empty(&r, t, h);
        }
    }
}

/// Gather: out-of-range req_id, positions, seq_lens and block ids give -1; faults as ruled.
#[test]
fn gather_out_of_range() {
    let mut rng = Rng(17);
    let mut s = Setup::random(&mut rng, 3, 1, 1, 2);
    let (bs, cap, nb) = (s.block_size as i32, s.cap() as i32, s.num_blocks as i32);
    s.seq_lens = vec![cap + 1000, -4, bs + 3];
    s.table[4] = nb + 2; // request 2, block 0 (positions 0..bs); block 1 stays valid
    let positions = [
        0,
        cap - 1,
        cap,
        -1,
        i32::MIN,
        i32::MAX,
        bs,
        bs + 2,
        bs + 3,
        1,
    ];
    let req = [0, 1, 2, 3, -1, i32::MAX];
    let (slots, faults) = s.gather(&req, &positions);
    let topk = positions.len();
    let row = |t: usize| &slots[t * topk..][..topk];
    let slot = |r: usize, p: i32| s.table[r * 2 + (p / bs) as usize] * bs + p % bs;
    // Request 0: seq_len clamped to cap silently.
    assert_eq!(
        row(0),
        &[
            slot(0, 0),
            slot(0, cap - 1),
            -1,
            -1,
            -1,
            -1,
            slot(0, bs),
            slot(0, bs + 2),
            slot(0, bs + 3),
            slot(0, 1)
        ]
    );
    // Request 1: negative seq_len, everything -1, silently.
    assert!(row(1).iter().all(|&x| x == -1));
    // Request 2: block 0 bad (positions 0 and 1 fault), positions up to bs + 2 valid.
    assert_eq!(
        row(2),
        &[-1, -1, -1, -1, -1, -1, slot(2, bs), slot(2, bs + 2), -1, -1]
    );
    for t in 3..6 {
        assert!(row(t).iter().all(|&x| x == -1));
    }
    let f = |code, row, value| Fault { code, row, value };
    assert_eq!(
        faults,
        vec![
            f(fault_code::BAD_BLOCK_ID, 2, nb + 2),
            f(fault_code::BAD_BLOCK_ID, 2, nb + 2),
            f(fault_code::BAD_REQ_ID, 3, 3),
            f(fault_code::BAD_REQ_ID, 4, -1),
            f(fault_code::BAD_REQ_ID, 5, i32::MAX),
        ]
    );
}

/// A duplicated sparse id counts once per entry: the key is in the softmax twice.
#[test]
fn sparse_duplicate_ids_count_twice() {
    let mut rng = Rng(19);
    let s = Setup::random(&mut rng, 1, 1, 3, 2);
    let (a, b, c) = (3usize, 17usize, 30usize);
    let indices = [a as i32, b as i32, a as i32, c as i32, -1];
    let got = sparse_decode(&s.sparse(&indices, None));
    assert!(got.faults.is_empty());
    for h in 0..3 {
        let twice = attend(s.q_head(0, h), rows_of(&s.cache, &[a, b, a, c]), s.scale);
        same_attend(&got, 0, h, &twice, 0.0);
        let once = attend(s.q_head(0, h), rows_of(&s.cache, &[a, b, c]), s.scale);
        assert!((once.1 - twice.1).abs() > 1e-6, "lse should differ");
        let diff = once
            .0
            .iter()
            .zip(&twice.0)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(diff > 1e-6, "out should differ");
    }
}
