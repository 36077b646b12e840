//! Synthetic KV for exercising transfers without a model: every element is
//! a deterministic function of (request, layer, position, K|V, index), so a
//! byte that lands in the wrong request's pages, layer or position is
//! detected. Values are the 254 finite FP8 E4M3 values (±448 at most),
//! exact in every storage dtype.

use crate::ids::RequestId;
use crate::kv::{KvError, KvPool, KvSeq, Readable, Writable};

/// The element `j` of K (`kv == 0`) or V of `request` at `layer`, `pos`.
pub fn value(request: RequestId, layer: usize, pos: usize, kv: usize, j: usize) -> f32 {
    let h = request
        .0
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((layer as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add((pos as u64).wrapping_mul(0x94D0_49BB_1331_11EB))
        .wrapping_add((kv as u64) << 32)
        .wrapping_add(j as u64);
    let h = (h ^ (h >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let h = h ^ (h >> 32);
    // A finite code: 0x00..=0x7E, 0x80..=0xFE (0x7F and 0xFF are NaN).
    let c = (h % 254) as u8;
    crate::kv::F8E4M3(if c >= 0x7F { c + 1 } else { c }).to_f32()
}

/// Appends positions `[seq.written(l), seq.written(l) + tokens)` of every
/// layer with `request`'s synthetic KV.
pub fn fill<S: Writable>(
    seq: &mut KvSeq<S>,
    request: RequestId,
    tokens: usize,
) -> Result<(), KvError> {
    let g = seq.pool().config().geometry();
    let kvd = g.kv_dim();
    for layer in 0..g.n_layers {
        let from = seq.written(layer);
        let mut k = vec![0.0f32; tokens * kvd];
        let mut v = vec![0.0f32; tokens * kvd];
        for t in 0..tokens {
            for j in 0..kvd {
                k[t * kvd + j] = value(request, layer, from + t, 0, j);
                v[t * kvd + j] = value(request, layer, from + t, 1, j);
            }
        }
        seq.append(layer, &k, &v)?;
    }
    Ok(())
}

/// Checks that every written position of `seq` holds `request`'s synthetic
/// KV; returns the first mismatch as (layer, position).
pub fn check<S: Readable>(
    pool: &KvPool,
    seq: &KvSeq<S>,
    request: RequestId,
) -> Result<Result<(), (usize, usize)>, KvError> {
    let g = pool.config().geometry();
    let kvd = g.kv_dim();
    let reader = pool.reader();
    let view = reader.seq(seq)?;
    let mut row = vec![0.0f32; kvd];
    for layer in 0..g.n_layers {
        let lv = view.layer(layer)?;
        for pos in 0..lv.len() {
            for kv in 0..2 {
                // Copies work wherever the pages live (host or device).
                let r = if kv == 0 {
                    lv.copy_key_f32(pos, &mut row)
                } else {
                    lv.copy_value_f32(pos, &mut row)
                };
                match r {
                    Ok(()) => {}
                    Err(KvError::Device(e)) => return Err(KvError::Device(e)),
                    Err(_) => return Ok(Err((layer, pos))),
                }
                if (0..kvd).any(|j| row[j] != value(request, layer, pos, kv, j)) {
                    return Ok(Err((layer, pos)));
                }
            }
        }
    }
    Ok(Ok(()))
}
