//! CPU checks of the test kit (`tests/kit/`), which the GPU tests and the bench trust: its
//! reference runners (one request or token at a time, over compact repacks, any subset of
//! heads) equal the reference over the whole problem, and its strided layouts and query
//! buffers hold what they claim.

use mla_decode::half::{bf16, f16};
use mla_decode::reference::{self, DenseProblem, PagedCache, SparseProblem};
use mla_decode::HEAD_DIM;

use crate::kit::*;

/// `dense_reference` (one request at a time over a compact repack, any head subset) equals
/// `reference::dense_decode` over the whole cache with the table repacked to stride
/// max_blocks_per_seq: padded blocks, strided tables, bad entries and bad seq_lens included.
#[test]
fn host_dense_reference_repack_matches_full_reference() {
    let mut rng = rng_for("host_dense_reference_repack_matches_full_reference");
    for _ in 0..24 {
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let mbps = rng.range(1, 5);
        let cap = (mbps * bs) as i32;
        let batch = rng.range(1, 5);
        let lens: Vec<i32> = (0..batch)
            .map(|_| match rng.below(6) {
                0 => -(rng.range(1, 3) as i32),
                1 => cap + rng.range(1, 9) as i32,
                _ => rng.range(0, cap as usize) as i32,
            })
            .collect();
        let spec = DenseSpec {
            q_len: rng.range(1, 4),
            heads: rng.range(1, 3),
            block_size: bs,
            max_blocks_per_seq: mbps,
            table_pad: rng.below(3),
            block_pad: 8 * rng.below(3),
            spare_blocks: rng.below(3),
            junk_unused: rng.chance(0.5),
            seq_lens: lens,
            scale: rng.softmax_scale(),
        };
        let mut s = DenseSetup::<bf16>::build(&mut rng, &spec);
        for b in 0..batch {
            if rng.chance(0.3) {
                let j = rng.below(mbps);
                s.table[b * s.table_stride + j] = junk_block(&mut rng, s.cache.num_blocks);
            }
        }
        let q = HostQuery::<bf16>::random(&mut rng, QKind::Contiguous, s.tokens(), s.heads);
        let full_cache: Vec<f64> = (0..s.cache.num_slots())
            .flat_map(|slot| s.cache.row(slot).iter().map(|v| v.to_f64()))
            .collect();
        let table = repack(&s.table, batch, s.table_stride, mbps);
        let full = reference::dense_decode(&DenseProblem {
            q: &q.values,
            batch,
            q_len: s.q_len,
            num_heads: s.heads,
            cache: PagedCache {
                data: &full_cache,
                num_blocks: s.cache.num_blocks,
                block_size: bs,
            },
            block_table: &table,
            max_blocks_per_seq: mbps,
            seq_lens: &s.seq_lens,
            softmax_scale: s.scale as f64,
        });
        assert_eq!(s.reference(&q, &all_heads(s.heads)), full, "{spec:?}");
        let h = s.heads - 1;
        let sub = s.reference(&q, &[h]);
        assert_eq!(sub.faults, full.faults);
        for r in 0..s.tokens() {
            assert_eq!(sub.out_row(r, 0), full.out_row(r, h));
            assert_eq!(sub.lse_at(r, 0), full.lse_at(r, h));
        }
    }
}

/// Random layouts cover `tokens·heads·width` distinct elements inside the buffer, aligned as
/// asked; a random query's buffers hold its values where the layout says and NaN elsewhere.
#[test]
fn host_layouts_and_query_buffers() {
    let mut rng = rng_for("host_layouts_and_query_buffers");
    for _ in 0..200 {
        let (tokens, heads) = (rng.range(1, 9), rng.range(1, 9));
        let width = rng.pick(&[1usize, 64, 512, 576]);
        let align = if width == 1 { 1 } else { 8 };
        let kind = Strided::random_kind(&mut rng);
        let l = Strided::new(&mut rng, kind, tokens, heads, width, align);
        let covered = l.covered();
        assert_eq!(covered.len(), l.len);
        let n = covered.iter().filter(|&&c| c).count();
        assert_eq!(n, tokens * heads * width, "{l:?}: rows overlap");
        assert_eq!(l.offset % align, 0);
        assert_eq!(l.token_stride % align, 0);
        assert_eq!(l.head_stride % align, 0);

        let qkind = QKind::random(&mut rng);
        let q = HostQuery::<f16>::random(&mut rng, qkind, tokens, heads);
        let mut seen = vec![vec![false; q.bufs[0].len()]];
        if q.bufs.len() == 2 {
            seen.push(vec![false; q.bufs[1].len()]);
        }
        let rb = q.bufs.len() - 1;
        for t in 0..tokens {
            for h in 0..heads {
                for d in 0..HEAD_DIM {
                    let (b, i) = if d < 512 {
                        (0, q.nope.at(t, h) + d)
                    } else {
                        (rb, q.rope.at(t, h) + d - 512)
                    };
                    assert_eq!(
                        q.bufs[b][i].to_f64(),
                        q.values[(t * heads + h) * HEAD_DIM + d]
                    );
                    seen[b][i] = true;
                }
            }
        }
        for (buf, seen) in q.bufs.iter().zip(&seen) {
            for (v, s) in buf.iter().zip(seen) {
                assert!(*s || v.to_f64().is_nan(), "{qkind:?}: a gap holds a number");
            }
        }
    }
}

/// `sparse_reference` (one token at a time over a compact cache, any head subset) equals
/// `reference::sparse_decode` over the whole cache with the indices repacked to stride topk:
/// padded blocks, holes, duplicates, bad ids, topk_len and row padding included.
#[test]
fn host_sparse_reference_repack_matches_full_reference() {
    let mut rng = rng_for("host_sparse_reference_repack_matches_full_reference");
    for _ in 0..24 {
        let style = RowStyle {
            hole: rng.pick(&[0.0, 0.3]),
            bad: 0.3,
        };
        let (tokens, heads, topk) = (rng.range(1, 6), rng.range(1, 3), rng.range(1, 300));
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let with_len = rng.chance(0.5);
        let num_blocks = rng.range(1, 6);
        let s = random_sparse::<f16>(
            &mut rng, tokens, heads, topk, num_blocks, bs, style, with_len,
        );
        let q = HostQuery::<f16>::random(&mut rng, QKind::Contiguous, tokens, heads);
        let full_cache: Vec<f64> = (0..s.cache.num_slots())
            .flat_map(|slot| s.cache.row(slot).iter().map(|v| v.to_f64()))
            .collect();
        let indices = repack(&s.indices, tokens, s.stride, topk);
        let full = reference::sparse_decode(&SparseProblem {
            q: &q.values,
            num_tokens: tokens,
            num_heads: heads,
            cache: PagedCache {
                data: &full_cache,
                num_blocks: s.cache.num_blocks,
                block_size: bs,
            },
            indices: &indices,
            topk,
            topk_len: s.topk_len.as_deref(),
            softmax_scale: s.scale as f64,
        });
        assert_eq!(s.reference(&q, &all_heads(heads)), full);
        let h = heads - 1;
        let sub = s.reference(&q, &[h]);
        assert_eq!(sub.faults, full.faults);
        for t in 0..tokens {
            assert_eq!(sub.out_row(t, 0), full.out_row(t, h));
            assert_eq!(sub.lse_at(t, 0), full.lse_at(t, h));
        }
    }
}
