//! `kv_ops`: byte programs of pool operations.

use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId, ScrubPolicy};

/// The row every append of `owner` writes: its id in base 256, two digits
/// exact in bf16 (8 significant bits), so no two owners below 65,536 (more
/// than one input can reserve) write the same row. Writing the id itself
/// made owners above 256 round to a neighbour's value in bf16.
fn row_of(owner: RequestId) -> [f32; 2] {
    [(owner.0 % 256) as f32, ((owner.0 / 256) % 256) as f32]
}

/// Interprets bytes as a program of pool operations over up to 8 live
/// sequences and checks, after every step, balanced accounting, that every
/// read returns what its owner wrote, and, at the end, a full pool.
pub fn kv_ops(data: &[u8]) {
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 2,
        dtype: KvDtype::BF16,
    };
    let Ok(pool) = KvPool::new(
        PoolConfig::new(g, 2, 8)
            .scrub(ScrubPolicy::Poison)
            .audit(true),
    ) else {
        return;
    };
    let mut live: Vec<handoff::KvSeq<handoff::kv::Filling>> = Vec::new();
    let mut next = 0u64;
    for chunk in data.chunks(2) {
        let (op, arg) = (chunk[0], chunk.get(1).copied().unwrap_or(0) as usize);
        match op % 5 {
            0 => {
                next += 1;
                if let Ok(s) = pool.reserve(RequestId(next), arg % 24)
                    && live.len() < 8
                {
                    live.push(s);
                }
            }
            1 if !live.is_empty() => {
                let i = arg % live.len();
                let s = &mut live[i];
                let n = 1 + arg % 3;
                let rows: Vec<f32> = (0..n).flat_map(|_| row_of(s.owner())).collect();
                for layer in 0..2 {
                    let _ = s.append(layer, &rows, &rows);
                }
            }
            2 if !live.is_empty() => {
                let s = &live[arg % live.len()];
                let reader = pool.reader();
                let sv = reader.seq(s).expect("own pages readable");
                for layer in 0..2 {
                    let lv = sv.layer(layer).expect("no isolation violation");
                    let mut buf = [0f32; 2];
                    for pos in 0..lv.len() {
                        lv.key(pos).expect("written").to_f32_into(&mut buf);
                        assert_eq!(buf, row_of(s.owner()), "foreign or stale bytes");
                    }
                }
            }
            3 if !live.is_empty() => {
                let i = arg % live.len();
                drop(live.swap_remove(i));
            }
            4 if !live.is_empty() => {
                let i = arg % live.len();
                let _ = live[i].grow(arg % 5);
            }
            _ => {}
        }
        let st = pool.stats();
        assert!(st.balanced(), "{st:?}");
        assert_eq!(st.isolation_violations, 0);
    }
    drop(live);
    assert!(pool.stats().is_full());
}
