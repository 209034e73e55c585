//! The soak's cache operations: `append_kv` into one persistent cache per format (checked
//! byte for byte against a host mirror after every call) and `gather_slots` (every slot id
//! against the reference).

use mla_decode::cudarc::driver::CudaSlice;
use mla_decode::reference::{fault_code, fp8, Fault};
use mla_decode::validate::{APPEND_ARGS, GATHER_ARGS};
use mla_decode::*;

use super::{check_refused, random_dtype, Kind, Refusal, Soak};
use crate::kit::*;

/// A cache that appends write into, with the bytes it must hold.
pub(crate) struct AppendCache {
    layout: CacheLayout,
    dev: CudaSlice<u8>,
    host: Vec<u8>,
    /// The per-tensor fp8 scale (value, device copy).
    scale: Option<(f32, CudaSlice<f32>)>,
}

impl AppendCache {
    /// One cache of each format, random block size, padded blocks, random bytes.
    pub(crate) fn all(s: &mut Soak) -> Vec<AppendCache> {
        KvFormat::ALL
            .into_iter()
            .map(|format| {
                let block_size = s.rng.pick(&BLOCK_SIZES);
                let num_blocks = 2048 / block_size;
                let stride = block_size * format.row_bytes() + 16 * s.rng.below(3);
                let host: Vec<u8> = (0..num_blocks * stride)
                    .map(|_| s.rng.below(256) as u8)
                    .collect();
                let scale = format.needs_tensor_scale().then(|| {
                    let v = s.rng.pick(&[1.0f32 / 448.0, 1.0 / 64.0, 0.25]);
                    (v, s.stream.clone_htod(&[v]).unwrap())
                });
                AppendCache {
                    layout: CacheLayout {
                        format,
                        block_size,
                        num_blocks,
                        block_stride_bytes: stride,
                    },
                    dev: s.stream.clone_htod(&host).unwrap(),
                    host,
                    scale,
                }
            })
            .collect()
    }

    /// The writable view (with the scale when the format has one), in `layout`.
    fn view(&mut self, layout: CacheLayout) -> KvCacheMut<'_> {
        let c = KvCacheMut::new(&mut self.dev, layout);
        match &self.scale {
            Some((_, d)) => c.with_scale(d),
            None => c,
        }
    }

    /// The device bytes equal the mirror's.
    #[track_caller]
    fn check(&self, label: &str, s: &Soak) {
        let got = s.stream.clone_dtoh(&self.dev).unwrap();
        if let Some(i) = (0..got.len()).find(|&i| got[i] != self.host[i]) {
            let l = &self.layout;
            panic!(
                "{label}: {} cache byte {i} (block {}, byte {} of it) is {}, want {}",
                l.format,
                i / l.block_stride_bytes,
                i % l.block_stride_bytes,
                got[i],
                self.host[i]
            );
        }
    }
}

/// The bytes a `format` cache stores for `row`.
fn stored<T: Half>(format: KvFormat, rule: Option<ScaleRule>, scale: f32, row: &[T]) -> Vec<u8> {
    let values: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
    match format {
        KvFormat::F16 | KvFormat::Bf16 => row.iter().flat_map(|v| v.bits().to_le_bytes()).collect(),
        KvFormat::Fp8DsMla => fp8::quantize_row(&values, rule.unwrap()).to_vec(),
        KvFormat::Fp8PerTensor => fp8::quantize_row_per_tensor(&values, scale).to_vec(),
    }
}

/// One `append_kv` call of `kind` into a random one of the caches.
pub(crate) fn append(s: &mut Soak, label: &str, kind: Kind) {
    let i = s.rng.below(s.append_caches.len());
    let mut cache = s.append_caches.swap_remove(i);
    let dtype = cache
        .layout
        .format
        .dtype()
        .unwrap_or_else(|| random_dtype(&mut s.rng));
    with_dtype!(dtype, T => append_rows::<T>(s, label, kind, &mut cache));
    s.append_caches.push(cache);
}

fn append_rows<T: Half>(s: &mut Soak, label: &str, kind: Kind, cache: &mut AppendCache) {
    let layout = cache.layout;
    let (format, slots_total) = (layout.format, layout.num_slots());
    let rng = &mut s.rng;
    let n = rng.range(1, 64);
    // Buffers `tail` rows longer than the call's count, the extra rows aimed at valid slots:
    // appending them would show in the cache.
    let tail = rng.below(3);
    let stride = HEAD_DIM + 8 * rng.below(3);
    let mut kv = vec![T::nan(); (n + tail - 1) * stride + HEAD_DIM];
    for r in 0..n + tail {
        let mag = 2f64.powi(rng.range(0, 8) as i32 - 6);
        for v in &mut kv[r * stride..r * stride + HEAD_DIM] {
            *v = T::from_f64(rng.unit() * mag);
        }
    }
    let mut slots: Vec<i64> = rng
        .sample(slots_total, n + tail)
        .into_iter()
        .map(|x| if rng.chance(0.15) { -1 } else { x as i64 })
        .collect();
    let rule = (format == KvFormat::Fp8DsMla).then(|| rng.pick(&[ScaleRule::Raw, ScaleRule::Pow2]));
    // Device-visible faults: bad slots (past the end, negative, past 2^32). Host-bad calls
    // carry one too: launched, the kernel would record it and write the good rows.
    let mut faults = Vec::new();
    if kind != Kind::Good {
        for _ in 0..rng.range(1, 3) {
            let r = rng.below(n);
            let far = slots_total as i64 + rng.range(1, 100_000) as i64;
            let bad = rng.pick(&[
                slots_total as i64,
                far,
                -2,
                -(1i64 << 40),
                (1i64 << 35) + 3,
                i64::MAX,
            ]);
            slots[r] = bad;
        }
        for (r, &slot) in slots[..n].iter().enumerate() {
            if slot < -1 || slot >= slots_total as i64 {
                faults.push(Fault {
                    code: fault_code::BAD_APPEND_SLOT,
                    row: r as u32,
                    value: slot,
                });
            }
        }
    }
    let stream = s.stream.clone();
    let kv_dev = stream.clone_htod(&kv).unwrap();
    let slots_dev = stream.clone_htod(&slots).unwrap();
    let with_flag = s.flag_for(kind);
    let base = AppendArgs {
        kv: &kv_dev,
        kv_token_stride: stride,
        slot_mapping: &slots_dev,
        num_tokens: n,
        scale_rule: rule,
    };

    if kind == Kind::HostBad {
        let short_kv = kv_dev.slice(..(n - 1) * stride + HEAD_DIM - 1);
        let misaligned_kv = kv_dev.slice(1..);
        let short_slots = slots_dev.slice(..n - 1);
        let mut view_layout = layout;
        let mut args = base;
        let choice = s.rng.below(7);
        let want = match choice {
            0 if n > 1 => {
                args.kv_token_stride = s.rng.pick(&[HEAD_DIM - 1, HEAD_DIM + 1, HEAD_DIM + 4]);
                "kv_token_stride"
            }
            0 | 1 => {
                args.slot_mapping = &short_slots;
                "slot_mapping"
            }
            2 => {
                args.kv = &short_kv;
                "kv"
            }
            3 => {
                args.kv = &misaligned_kv;
                "kv"
            }
            4 => {
                args.scale_rule = match rule {
                    Some(_) => None,
                    None => Some(ScaleRule::Pow2),
                };
                "scale_rule"
            }
            5 => {
                view_layout.num_blocks += 1;
                "kv_cache"
            }
            _ => {
                args.num_tokens = 1 << 31;
                "num_tokens"
            }
        };
        let res = append_kv(
            &stream,
            &args,
            &mut cache.view(view_layout),
            Some(&mut s.flag),
        );
        check_refused(label, res, Refusal::Arg(want), APPEND_ARGS);
        cache.check(label, s);
        assert_eq!(
            s.flag_words(),
            [0; 4],
            "{label}: refused, but a kernel recorded a fault"
        );
        return;
    }

    let flag = if with_flag { Some(&mut s.flag) } else { None };
    append_kv(&stream, &base, &mut cache.view(layout), flag)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let scale = cache.scale.as_ref().map_or(1.0, |(v, _)| *v);
    let rb = format.row_bytes();
    for (r, &slot) in slots[..n].iter().enumerate() {
        if slot < 0 || slot >= slots_total as i64 {
            continue;
        }
        let slot = slot as usize;
        let at = (slot / layout.block_size) * layout.block_stride_bytes
            + (slot % layout.block_size) * rb;
        let row = &kv[r * stride..r * stride + HEAD_DIM];
        cache.host[at..at + rb].copy_from_slice(&stored(format, rule, scale, row));
    }
    cache.check(label, s);
    if with_flag {
        check_flag(label, s.flag_words(), &faults);
    }
}

/// One `gather_slots` call of `kind`.
pub(crate) fn gather(s: &mut Soak, label: &str, kind: Kind) {
    let rng = &mut s.rng;
    let (batch, tokens) = (rng.range(1, 8), rng.range(1, 64));
    let small = rng.range(1, 64);
    let topk = rng.pick(&[small, 128, 512, 2048, 4096]).min(s.limits.topk);
    let block_size = rng.pick(&BLOCK_SIZES);
    let mut g = random_gather(
        rng,
        batch,
        tokens,
        topk,
        block_size,
        kind == Kind::DeviceBad,
    );
    if kind != Kind::Good && g.reference().1.is_empty() {
        // A bad request id: the device records it (host-bad calls carry it as the marker
        // that nothing was launched).
        g.req_id[rng.below(tokens)] = rng.pick(&[-1, batch as i32, i32::MAX, i32::MIN]);
    }
    let stream = s.stream.clone();
    let positions = stream.clone_htod(&g.positions).unwrap();
    let req = stream.clone_htod(&g.req_id).unwrap();
    let table = stream.clone_htod(&g.table).unwrap();
    let lens = stream.clone_htod(&g.seq_lens).unwrap();
    let cache = cache_bytes(&stream, &g.cache_layout());
    let mut out = stream
        .clone_htod(&vec![GATHER_POISON; g.out_len()])
        .unwrap();
    s.flag.reset(&stream).unwrap();
    let base = GatherArgs {
        positions: &positions,
        positions_stride: g.pos_stride,
        req_id: &req,
        block_table: g.table_view(&table),
        seq_lens: &lens,
        kv_cache: KvCache::new(&cache, g.cache_layout()),
        topk,
        num_tokens: tokens,
        out_stride: g.out_stride,
    };

    if kind == Kind::HostBad {
        let short_req = req.slice(..tokens - 1);
        let short_lens = lens.slice(..batch - 1);
        let short_table = table.slice(..(batch - 1) * g.table_stride + g.mbps - 1);
        let short_positions = positions.slice(..(tokens - 1) * g.pos_stride + topk - 1);
        let odd_layout = CacheLayout {
            block_size: 48,
            ..g.cache_layout()
        };
        let mut args = base.clone();
        let mut out_end = out.len();
        let choice = s.rng.below(10);
        let want = match choice {
            0 => {
                args.topk = s.rng.pick(&[0, MAX_TOPK + 1]);
                "topk"
            }
            1 => {
                args.num_tokens = MAX_GATHER_TOKENS + 1;
                "num_tokens"
            }
            2 => {
                args.req_id = &short_req;
                "req_id"
            }
            3 => {
                args.block_table = BlockTable::new(
                    &short_table,
                    TableShape {
                        batch,
                        max_blocks_per_seq: g.mbps,
                    },
                )
                .with_row_stride(g.table_stride);
                "block_table"
            }
            4 => {
                args.seq_lens = &short_lens;
                "seq_lens"
            }
            5 if tokens > 1 => {
                args.positions_stride = topk - 1;
                "positions_stride"
            }
            5 | 6 => {
                args.positions = &short_positions;
                "positions"
            }
            7 if tokens > 1 => {
                args.out_stride = topk - 1;
                "out_stride"
            }
            7 | 8 => {
                out_end = (tokens - 1) * g.out_stride + topk - 1;
                "out"
            }
            _ => {
                args.kv_cache = KvCache::new(&cache, odd_layout);
                "kv_cache"
            }
        };
        let mut out_view = out.slice_mut(..out_end);
        let res = gather_slots(&stream, &args, &mut out_view, Some(&mut s.flag));
        check_refused(label, res, Refusal::Arg(want), GATHER_ARGS);
        let got = stream.clone_dtoh(&out).unwrap();
        assert!(
            got.iter().all(|&v| v == GATHER_POISON),
            "{label}: refused, but out was written"
        );
        assert_eq!(
            s.flag_words(),
            [0; 4],
            "{label}: refused, but a kernel recorded a fault"
        );
        return;
    }

    gather_slots(&stream, &base, &mut out, Some(&mut s.flag))
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let got = stream.clone_dtoh(&out).unwrap();
    let faults = check_gather(label, &g, &got, s.flag_words());
    if kind == Kind::DeviceBad {
        assert!(!faults.is_empty(), "{label}: no fault was injected");
    }
}
