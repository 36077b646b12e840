//! Isolation, by construction: a sequence reads only positions it wrote, in
//! pages it owns at their current generation. Random interleavings of
//! reserve, write, read, hold and release across many requests never show
//! another request's bytes, never break accounting, and leave released
//! pages scrubbed. The same holds with the page bytes in device memory
//! (staged here: every access a copy), where no row is ever lent in place.

use std::collections::HashMap;

use handoff::kv::{Filling, KvSeq, Ready, Residence, StagedHostPages};
use handoff::{KvDtype, KvError, KvGeometry, KvPool, PoolConfig, RequestId, ScrubPolicy};
use proptest::prelude::*;

fn geometry(dtype: KvDtype) -> KvGeometry {
    KvGeometry {
        n_layers: 3,
        n_kv_heads: 2,
        head_dim: 4,
        dtype,
    }
}

/// The value request `r` writes at (layer, pos, element, k|v): a different
/// f32 for every tuple. The tuple is packed into 20 bits (asserted), mixed
/// by a bijection on 24 bits (so that neighbouring tuples differ in their
/// high bits and stay apart after rounding to f16/bf16), and mapped exactly
/// onto a multiple of 2^-21 in [-4, 4).
fn value(r: u64, layer: usize, pos: usize, e: usize, kv: usize) -> f32 {
    assert!(
        // pos reaches past a reservation: a write refused as beyond it still
        // computes its rows first (up to 48 + 19 positions here).
        r < 128 && layer < 4 && pos < 128 && e < 8 && kv < 2,
        "tuple fits 20 bits"
    );
    let packed =
        (r << 13) | ((layer as u64) << 11) | ((pos as u64) << 4) | ((e as u64) << 1) | kv as u64;
    const MASK: u64 = (1 << 24) - 1;
    // Odd multipliers and right xor-shifts are bijections mod 2^24.
    let mut x = packed.wrapping_mul(0x9e_3779) & MASK;
    x ^= x >> 12;
    x = x.wrapping_mul(0x85_ebcb) & MASK;
    x ^= x >> 11;
    // |x - 2^23| < 2^24: exact in f32, and so is the power-of-two scaling.
    (x as i64 - (1 << 23)) as f32 * (1.0 / (1u64 << 21) as f32)
}

/// A pool of `cfg`, its page bytes in host memory or (`device`) behind
/// staged device pages.
fn pool_of(cfg: PoolConfig, device: bool) -> KvPool {
    if device {
        let bytes = cfg.storage_bytes().unwrap();
        KvPool::with_device_pages(cfg, Box::new(StagedHostPages::new(bytes))).unwrap()
    } else {
        KvPool::new(cfg).unwrap()
    }
}

fn rows(r: u64, layer: usize, start: usize, n: usize, kvd: usize, kv: usize) -> Vec<f32> {
    (start..start + n)
        .flat_map(|p| (0..kvd).map(move |e| value(r, layer, p, e, kv)))
        .collect()
}

/// What a read of `rows(..)` returns from a pool storing `dtype`: the value
/// rounded through the storage type by the conversions the pool uses.
fn stored_rows(
    dtype: KvDtype,
    r: u64,
    layer: usize,
    start: usize,
    n: usize,
    kvd: usize,
    kv: usize,
) -> Vec<f32> {
    rows(r, layer, start, n, kvd, kv)
        .into_iter()
        .map(|x| match dtype {
            KvDtype::F32 => x,
            KvDtype::F16 => half::f16::from_f32(x).to_f32(),
            KvDtype::BF16 => half::bf16::from_f32(x).to_f32(),
            KvDtype::F8E4M3 => handoff::kv::F8E4M3::from_f32(x).to_f32(),
        })
        .collect()
}

fn append_all(seq: &mut KvSeq<Filling>, n: usize, kvd: usize) -> Result<(), KvError> {
    for layer in 0..3 {
        let start = seq.written(layer);
        let r = seq.owner().0;
        seq.append(
            layer,
            &rows(r, layer, start, n, kvd, 0),
            &rows(r, layer, start, n, kvd, 1),
        )?;
    }
    Ok(())
}

fn check_reads<S: handoff::kv::Readable>(pool: &KvPool, seq: &KvSeq<S>) {
    let geometry = pool.config().geometry();
    let (kvd, dtype) = (geometry.kv_dim(), geometry.dtype);
    let reader = pool.reader();
    let sv = reader.seq(seq).expect("own pages are readable");
    for layer in 0..3 {
        let lv = sv.layer(layer).expect("no isolation violation");
        assert_eq!(lv.len(), seq.written(layer));
        let mut buf = vec![0f32; kvd];
        let in_place = pool.residence() == Residence::Host;
        for pos in 0..lv.len() {
            let owner = seq.owner().0;
            lv.copy_key_f32(pos, &mut buf).unwrap();
            assert_eq!(buf, stored_rows(dtype, owner, layer, pos, 1, kvd, 0));
            lv.copy_value_f32(pos, &mut buf).unwrap();
            assert_eq!(buf, stored_rows(dtype, owner, layer, pos, 1, kvd, 1));
            // Rows are lent in place only from host memory, and say the same.
            assert_eq!(lv.key(pos).is_some(), in_place);
            if let Some(k) = lv.key(pos) {
                let mut direct = vec![0f32; kvd];
                k.to_f32_into(&mut direct);
                assert_eq!(direct, stored_rows(dtype, owner, layer, pos, 1, kvd, 0));
            }
        }
        assert!(
            lv.key(lv.len()).is_none(),
            "unwritten positions are never served"
        );
        assert!(
            matches!(
                lv.copy_key_f32(lv.len(), &mut buf),
                Err(KvError::Incomplete { .. })
            ),
            "nor copied"
        );
    }
}

#[derive(Debug, Clone)]
enum Op {
    Reserve { tokens: usize },
    Write { who: usize, tokens: usize },
    Read { who: usize },
    Seal { who: usize },
    Hold { who: usize },
    Release { who: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..40).prop_map(|tokens| Op::Reserve { tokens }),
        (any::<usize>(), 1usize..20).prop_map(|(who, tokens)| Op::Write { who, tokens }),
        any::<usize>().prop_map(|who| Op::Read { who }),
        any::<usize>().prop_map(|who| Op::Seal { who }),
        any::<usize>().prop_map(|who| Op::Hold { who }),
        any::<usize>().prop_map(|who| Op::Release { who }),
    ]
}

enum Live {
    Filling(KvSeq<Filling>),
    Ready(KvSeq<Ready>),
    Held(KvSeq<handoff::kv::Held>),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn random_interleavings_never_leak(
        ops in proptest::collection::vec(op(), 1..120),
        page_size in prop_oneof![Just(1usize), Just(4), Just(16)],
        dtype in prop_oneof![Just(KvDtype::F32), Just(KvDtype::F16), Just(KvDtype::BF16), Just(KvDtype::F8E4M3)],
        policy in prop_oneof![Just(ScrubPolicy::Zero), Just(ScrubPolicy::Poison), Just(ScrubPolicy::AcceptStaleBytes)],
        device in any::<bool>(),
    ) {
        let pool = pool_of(PoolConfig::new(geometry(dtype), page_size, 32).scrub(policy), device);
        let kvd = geometry(dtype).kv_dim();
        let mut live: Vec<Live> = Vec::new();
        let mut next = 0u64;
        let mut reserved: HashMap<u64, usize> = HashMap::new();
        for op in ops {
            match op {
                Op::Reserve { tokens } => {
                    next += 1;
                    let before = pool.stats();
                    match pool.reserve(RequestId(next), tokens) {
                        Ok(seq) => { reserved.insert(next, tokens); live.push(Live::Filling(seq)) }
                        Err(KvError::Exhausted { .. }) | Err(KvError::NeverFits { .. }) => {
                            // A refused reservation allocates nothing.
                            prop_assert_eq!(pool.stats(), before);
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Write { who, tokens } if !live.is_empty() => {
                    let i = who % live.len();
                    if let Live::Filling(seq) = &mut live[i] {
                        let room = seq.reserved_tokens() - seq.written(0);
                        match append_all(seq, tokens, kvd) {
                            Ok(()) => prop_assert!(tokens <= room),
                            Err(KvError::BeyondReservation { .. }) => prop_assert!(tokens > room),
                            Err(e) => prop_assert!(false, "unexpected {e}"),
                        }
                    }
                }
                Op::Read { who } if !live.is_empty() => {
                    match &live[who % live.len()] {
                        Live::Filling(s) => check_reads(&pool, s),
                        Live::Ready(s) => check_reads(&pool, s),
                        Live::Held(s) => check_reads(&pool, s),
                    }
                }
                Op::Seal { who } if !live.is_empty() => {
                    let i = who % live.len();
                    if let Live::Filling(seq) = live.swap_remove(i) {
                        let len = seq.written(0);
                        live.push(match seq.seal(len) {
                            Ok(s) => Live::Ready(s),
                            Err(e) => Live::Filling(e.seq),
                        });
                    } else {
                        // put nothing back: swap_remove of a non-Filling drops it
                    }
                }
                Op::Hold { who } if !live.is_empty() => {
                    let i = who % live.len();
                    let l = live.swap_remove(i);
                    live.push(match l {
                        Live::Filling(s) => Live::Held(s.hold()),
                        Live::Ready(s) => Live::Held(s.hold()),
                        Live::Held(s) => Live::Held(s),
                    });
                }
                Op::Release { who } if !live.is_empty() => {
                    let i = who % live.len();
                    drop(live.swap_remove(i));
                }
                _ => {}
            }
            let st = pool.stats();
            prop_assert!(st.balanced(), "{st:?}");
            prop_assert_eq!(st.isolation_violations, 0);
            let held_pages: usize = live.iter().map(|l| match l { Live::Held(s) => s.pages().len(), _ => 0 }).sum();
            prop_assert_eq!(st.held, held_pages);
        }
        drop(live);
        let st = pool.stats();
        prop_assert!(st.is_full(), "{st:?}");
        // Released pages are scrubbed per the policy.
        for page in 0..pool.capacity() as u32 {
            let scrubbed = pool.audit_page_matches_scrub(page);
            prop_assert!(scrubbed, "page {page} not scrubbed under {policy:?}");
        }
    }
}

#[test]
fn a_new_owner_never_sees_the_previous_owners_bytes() {
    a_new_owner_never_sees_the_previous_owners_bytes_on(false);
    a_new_owner_never_sees_the_previous_owners_bytes_on(true);
}

fn a_new_owner_never_sees_the_previous_owners_bytes_on(device: bool) {
    let pool = pool_of(
        PoolConfig::new(geometry(KvDtype::F32), 4, 2).scrub(ScrubPolicy::AcceptStaleBytes),
        device,
    );
    let kvd = geometry(KvDtype::F32).kv_dim();
    let mut a = pool.reserve(RequestId(1), 8).unwrap();
    append_all(&mut a, 8, kvd).unwrap();
    let old_pages: Vec<_> = a.pages().to_vec();
    a.release();
    // Same physical pages, new generation; even unscrubbed, B sees nothing.
    let b = pool.reserve(RequestId(2), 8).unwrap();
    assert_eq!(
        b.pages()
            .iter()
            .map(|p| p.index())
            .collect::<std::collections::BTreeSet<_>>(),
        old_pages.iter().map(|p| p.index()).collect()
    );
    for (new, old) in b.pages().iter().zip(&old_pages) {
        if new.index() == old.index() {
            assert!(new.generation() > old.generation());
        }
    }
    let reader = pool.reader();
    let sv = reader.seq(&b).unwrap();
    for layer in 0..3 {
        let lv = sv.layer(layer).unwrap();
        assert_eq!(lv.len(), 0);
        assert!(lv.key(0).is_none());
        let mut buf = vec![0f32; kvd];
        assert!(lv.copy_key_f32(0, &mut buf).is_err() && lv.copy_value_f32(0, &mut buf).is_err());
        // Page by page too: a reserved page holds no written row, and a
        // page index past the sequence's pages is empty, not a panic.
        for i in 0..b.pages().len() + 2 {
            assert!(lv.keys(i).is_empty() && lv.values(i).is_empty(), "page {i}");
        }
    }
}

#[test]
fn writes_beyond_the_reservation_are_refused_and_change_nothing() {
    let pool = KvPool::new(PoolConfig::new(geometry(KvDtype::F32), 4, 4)).unwrap();
    let kvd = geometry(KvDtype::F32).kv_dim();
    let mut s = pool.reserve(RequestId(1), 4).unwrap();
    let err = s
        .append(0, &vec![1.0; 5 * kvd], &vec![1.0; 5 * kvd])
        .unwrap_err();
    assert!(matches!(
        err,
        KvError::BeyondReservation {
            reserved: 4,
            adding: 5,
            ..
        }
    ));
    assert_eq!(s.written(0), 0);
    // Growing makes room.
    s.grow(1).unwrap();
    s.append(0, &vec![1.0; 5 * kvd], &vec![1.0; 5 * kvd])
        .unwrap();
    assert_eq!(s.written(0), 5);
}

#[test]
fn a_batched_append_writes_each_sequence_its_own_rows_or_nothing_at_all() {
    let pool = KvPool::new(PoolConfig::new(geometry(KvDtype::F32), 4, 8)).unwrap();
    let kvd = geometry(KvDtype::F32).kv_dim();
    let mut a = pool.reserve(RequestId(1), 4).unwrap();
    let mut b = pool.reserve(RequestId(2), 4).unwrap();
    let (ka, va) = (rows(1, 0, 0, 3, kvd, 0), rows(1, 0, 0, 3, kvd, 1));
    let (kb, vb) = (rows(2, 0, 0, 5, kvd, 0), rows(2, 0, 0, 5, kvd, 1));
    // b asks for 5 tokens with 4 reserved: refused, naming b, and a got nothing.
    let err = KvSeq::append_each(0, &mut [&mut a, &mut b], |i| {
        [(&ka[..], &va[..]), (&kb[..], &vb[..])][i]
    })
    .unwrap_err();
    assert!(
        matches!(err, (1, KvError::BeyondReservation { .. })),
        "{err:?}"
    );
    assert_eq!((a.written(0), b.written(0)), (0, 0));
    // Within the reservations, each sequence reads exactly its own rows.
    KvSeq::append_each(0, &mut [&mut a, &mut b], |i| {
        [(&ka[..], &va[..]), (&kb[..4 * kvd], &vb[..4 * kvd])][i]
    })
    .unwrap();
    let reader = pool.reader();
    for (seq, r, n) in [(&a, 1, 3), (&b, 2, 4)] {
        let view = reader.seq(seq).unwrap().layer(0).unwrap();
        assert_eq!(view.len(), n);
        for pos in 0..n {
            let mut got = vec![0.0; kvd];
            view.key(pos).unwrap().to_f32_into(&mut got);
            assert_eq!(got, rows(r, 0, pos, 1, kvd, 0));
        }
    }
    drop((a, b));
    assert!(pool.stats().is_full());
}

/// A decode pass appends one token a layer for every sequence of the batch
/// at once (fetching sequences ahead of the one it writes): with more
/// sequences than it looks ahead, pages crossed at different steps, and
/// sequences of different lengths, each still reads back exactly its own
/// rows at every position of every layer.
#[test]
fn a_large_batched_append_writes_every_sequence_its_own_rows() {
    let g = geometry(KvDtype::F32);
    let kvd = g.kv_dim();
    let pool = KvPool::new(PoolConfig::new(g, 4, 20 * 4)).unwrap();
    let mut seqs: Vec<KvSeq<_>> = (0..20u64)
        .map(|r| pool.reserve(RequestId(r), 1 + r as usize % 3).unwrap())
        .collect();
    // Sequence r starts with r % 3 tokens written in every layer.
    for (r, s) in seqs.iter_mut().enumerate() {
        let n = r % 3;
        for layer in 0..g.n_layers {
            let (k, v) = (
                rows(r as u64, layer, 0, n, kvd, 0),
                rows(r as u64, layer, 0, n, kvd, 1),
            );
            s.append(layer, &k, &v).unwrap();
        }
    }
    for _step in 0..9 {
        for s in seqs.iter_mut() {
            let w = s.written(0);
            s.ensure_capacity(w + 1).unwrap();
        }
        for layer in 0..g.n_layers {
            let rows_now: Vec<(Vec<f32>, Vec<f32>)> = seqs
                .iter()
                .enumerate()
                .map(|(r, s)| {
                    let p = s.written(layer);
                    (
                        rows(r as u64, layer, p, 1, kvd, 0),
                        rows(r as u64, layer, p, 1, kvd, 1),
                    )
                })
                .collect();
            let mut refs: Vec<&mut KvSeq<_>> = seqs.iter_mut().collect();
            KvSeq::append_each(layer, &mut refs, |i| {
                (&rows_now[i].0[..], &rows_now[i].1[..])
            })
            .unwrap();
        }
    }
    let reader = pool.reader();
    for (r, s) in seqs.iter().enumerate() {
        assert_eq!(s.complete_len(), Some(r % 3 + 9));
        let sv = reader.seq(s).unwrap();
        for layer in 0..g.n_layers {
            let view = sv.layer(layer).unwrap();
            for pos in 0..r % 3 + 9 {
                let (mut k, mut v) = (vec![0.0; kvd], vec![0.0; kvd]);
                view.key(pos).unwrap().to_f32_into(&mut k);
                view.value(pos).unwrap().to_f32_into(&mut v);
                assert_eq!(
                    k,
                    rows(r as u64, layer, pos, 1, kvd, 0),
                    "seq {r} layer {layer} pos {pos}"
                );
                assert_eq!(
                    v,
                    rows(r as u64, layer, pos, 1, kvd, 1),
                    "seq {r} layer {layer} pos {pos}"
                );
            }
        }
    }
    drop(seqs);
    assert!(pool.stats().is_full());
}

#[test]
fn incomplete_kv_cannot_be_sealed_for_decode() {
    let pool = KvPool::new(PoolConfig::new(geometry(KvDtype::F32), 4, 4)).unwrap();
    let kvd = geometry(KvDtype::F32).kv_dim();
    let mut s = pool.reserve(RequestId(1), 4).unwrap();
    // Two of three layers written: the incident's "one layer short".
    for layer in 0..2 {
        s.append(layer, &vec![1.0; 4 * kvd], &vec![1.0; 4 * kvd])
            .unwrap();
    }
    let err = s.seal(4).unwrap_err();
    assert_eq!(
        err.error,
        KvError::Incomplete {
            layer: 2,
            written: 0,
            expected: 4
        }
    );
    let mut s = err.seq;
    s.append(2, &vec![1.0; 4 * kvd], &vec![1.0; 4 * kvd])
        .unwrap();
    let ready = s.seal(4).unwrap();
    assert_eq!(ready.complete_len(), Some(4));
}

#[test]
fn held_pages_are_counted_and_freed_on_drop() {
    let pool = KvPool::new(PoolConfig::new(geometry(KvDtype::BF16), 4, 8)).unwrap();
    let s = pool.reserve(RequestId(1), 10).unwrap();
    assert_eq!(pool.stats().in_use, 3);
    let held = s.hold();
    let st = pool.stats();
    assert_eq!((st.free, st.in_use, st.held), (5, 0, 3));
    drop(held);
    assert!(pool.stats().is_full());
}

#[test]
fn a_sequence_from_another_pool_is_refused() {
    let p1 = KvPool::new(PoolConfig::new(geometry(KvDtype::F32), 4, 4)).unwrap();
    let p2 = KvPool::new(PoolConfig::new(geometry(KvDtype::F32), 4, 4)).unwrap();
    let s = p1.reserve(RequestId(1), 4).unwrap();
    let reader = p2.reader();
    assert!(matches!(reader.seq(&s), Err(KvError::ForeignPage { .. })));
}

#[test]
fn exhaustion_is_typed_and_allocates_nothing() {
    let pool = KvPool::new(PoolConfig::new(geometry(KvDtype::F32), 4, 4)).unwrap();
    let a = pool.reserve(RequestId(1), 12).unwrap();
    let err = pool.reserve(RequestId(2), 8).unwrap_err();
    assert_eq!(
        err,
        KvError::Exhausted {
            requested: 2,
            free: 1,
            capacity: 4
        }
    );
    use handoff::HttpStatus;
    assert_eq!(err.http_status(), 503);
    drop(a);
    assert!(pool.stats().is_full());
}

#[test]
fn many_threads_writing_and_reading_one_pool_at_once_each_see_only_their_own_bytes() {
    // Page bytes have no lock: a sequence's handle is the only way to its
    // pages. Four threads reserve, append, read back, hold and release
    // sequences of one small pool at once, for many rounds; pages change
    // hands between threads all the time (and are scrubbed in between).
    // Real threads only sample interleavings: a race narrower than a time
    // slice (say, a scrub landing after the page went back on the free
    // list) is what tests/loom_pool.rs checks, on every interleaving.
    for dtype in [KvDtype::F32, KvDtype::BF16] {
        let pool = KvPool::new(PoolConfig::new(geometry(dtype), 4, 24)).unwrap();
        let kvd = pool.config().geometry().kv_dim();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let pool = &pool;
                s.spawn(move || {
                    for round in 0..1000u64 {
                        // Distinct among live sequences.
                        let id = RequestId(1 + t + 4 * (round % 3));
                        let tokens = 1 + ((t + round) % 11) as usize;
                        // Six pages per thread at most: never exhausted.
                        let mut seq = pool.reserve(id, tokens).expect("room for each thread");
                        let mut done = 0;
                        while done < tokens {
                            let n = (tokens - done).min(3);
                            append_all(&mut seq, n, kvd).expect("within the reservation");
                            done += n;
                            check_reads(pool, &seq);
                        }
                        if round % 3 == 0 {
                            let held = seq.seal(tokens).expect("complete").hold();
                            check_reads(pool, &held);
                        }
                    }
                });
            }
        });
        let st = pool.stats();
        assert!(st.is_full(), "{st:?}");
        assert_eq!(st.isolation_violations, 0);
        for page in 0..24 {
            assert!(
                pool.audit_page_matches_scrub(page),
                "page {page} not scrubbed"
            );
        }
    }
}

#[test]
fn the_written_values_tell_every_owner_layer_position_element_and_half_apart() {
    // The checks above catch a read of the wrong row only because no two
    // tuples share a value.
    let mut seen = std::collections::HashSet::new();
    for r in 0..128 {
        for layer in 0..4 {
            for pos in 0..64 {
                for e in 0..8 {
                    for kv in 0..2 {
                        let v = value(r, layer, pos, e, kv);
                        assert!(seen.insert(v.to_bits()), "{r} {layer} {pos} {e} {kv}");
                    }
                }
            }
        }
    }
}
