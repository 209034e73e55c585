//! Hand-made edge cases of the reference: one key and huge scores, merging with nothing,
//! empty requests and rows, negative and out-of-range inputs, duplicate ids.

use mla_decode::reference::{
    attend, dense_decode, fault_code, merge, sparse_decode, Attention, Fault, HEAD_DIM, LATENT_DIM,
};

use super::{assert_empty, assert_non_empty, close, rows_of, same_attend, Setup};
use crate::kit::Rng;

/// A single key gives out = V and lse = its score exactly; huge scores stay finite.
#[test]
fn attend_single_key_and_huge_scores() {
    let mut rng = Rng::new(11);
    let q = rng.units(HEAD_DIM);
    let keys = rng.units(5 * HEAD_DIM);
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
    let mut rng = Rng::new(3);
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
    let mut rng = Rng::new(5);
    let mut s = Setup::random(&mut rng, 4, 4, 2, 3);
    let nb = s.num_blocks as i32;
    s.seq_lens = vec![0, 2, 40, 1];
    s.table[6..9].copy_from_slice(&[-1, nb, i32::MIN]); // request 2: all invalid
    let r = dense_decode(&s.dense());
    let bad = |e: i32| Fault {
        code: fault_code::BAD_BLOCK_ID,
        row: 2,
        value: e as i64,
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
    let mut rng = Rng::new(9);
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
    let mut rng = Rng::new(13);
    let s = Setup::random(&mut rng, 3, 1, 2, 2);
    let slots = (s.num_blocks * s.block_size) as i32;
    let topk = 5;
    let mut indices = vec![-1; 3 * topk];
    indices[topk..2 * topk].copy_from_slice(&[slots, -3, 0, 1, 2]);
    indices[2 * topk..].copy_from_slice(&[i32::MAX, i32::MIN, slots, -2, -1]);
    let r = sparse_decode(&s.sparse(&indices, Some(&[4, 0, 9])));
    let bad = |v: i32| Fault {
        code: fault_code::BAD_SLOT_ID,
        row: 2,
        value: v as i64,
    };
    // topk_len 9 > topk 5 is clamped and recorded before token 2's entries
    let long = Fault {
        code: fault_code::BAD_TOPK_LEN,
        row: 2,
        value: 9,
    };
    assert_eq!(
        r.faults,
        vec![long, bad(i32::MAX), bad(i32::MIN), bad(slots), bad(-2)]
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
    let mut rng = Rng::new(17);
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
    // Request 0: seq_len clamped to cap (and recorded).
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
    // Request 1: negative seq_len, everything -1 (and recorded).
    assert!(row(1).iter().all(|&x| x == -1));
    // Request 2: block 0 bad (positions 0 and 1 fault), positions up to bs + 2 valid.
    assert_eq!(
        row(2),
        &[-1, -1, -1, -1, -1, -1, slot(2, bs), slot(2, bs + 2), -1, -1]
    );
    for t in 3..6 {
        assert!(row(t).iter().all(|&x| x == -1));
    }
    let f = |code, row, value: i32| Fault {
        code,
        row,
        value: value as i64,
    };
    assert_eq!(
        faults,
        vec![
            f(fault_code::SEQ_LEN_TOO_LARGE, 0, cap + 1000),
            f(fault_code::NEGATIVE_SEQ_LEN, 1, -4),
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
    let mut rng = Rng::new(19);
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
