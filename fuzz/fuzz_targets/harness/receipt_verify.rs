//! `receipt_verify`: the fuzz input plays a broken or hostile prefill
//! worker against a real decode side over the in-process transport. Decode
//! admits two requests (the target and a bystander of another tenant) and
//! sends their plans; the input then chooses which KV bytes land (from the
//! target's own KV, from a neighbour tenant's KV, from a copy with one value
//! changed; at any layer, position and length; under the right or a wrong
//! request and nonce) and how the target's receipt is edited, then sends the
//! bystander's honest transfer before or after.
//!
//! Properties: a request whose transfer is verified holds exactly its own
//! KV (checked value by value through the audited reader) and, for the
//! target, the receipt verified matches the plan (request, nonce, per-layer
//! token counts, pages, checksums of its own KV, writer runs); prefill is
//! acked only for verified transfers; every other end is a typed error; an
//! untouched transfer is verified; no isolation violation; both pools are
//! full again at the end.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::kv::Held;
use handoff::transfer::{
    Abort, AbortReason, CancelOutcome, DecodeOutcome, DecodeSide, InProcess, InProcessDecode,
    InProcessPrefill, Nonce, Plan, PlannedPage, PrefillLink, Receipt, ToDecode, ToPrefill,
    Transfer, TransferConfig, Verdict, WriteBatch, WriterRun, synthetic,
};
use handoff::{
    AdmissionLimits, HttpStatus, KvDtype, KvGeometry, KvPool, KvSeq, PoolConfig, Request,
    RequestId, ScrubPolicy, TenantId,
};
use xxhash_rust::xxh3::xxh3_64;

const TARGET: RequestId = RequestId(1);
const BYSTANDER: RequestId = RequestId(2);
/// Another tenant's KV on the prefill side: the foreign bytes of the incident.
const NEIGHBOUR: RequestId = RequestId(3);
const CORRUPT_OWNER: RequestId = RequestId(4);
/// Longest prompt here; sources hold this many positions plus two.
const MAX_TOKENS: usize = 12;
const MAX_NEW: usize = 2;
/// An abort nobody planned: decode counts it as ignored once every message
/// sent before it has been handled.
const PROBE: Abort = Abort {
    request: RequestId(0xdead),
    nonce: Nonce(0x0bad_5eed),
    reason: AbortReason::ShuttingDown,
};

/// Reads the input a byte at a time; zeros once it runs out, so the empty
/// input is the honest transfer.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }
    fn below(&mut self, n: usize) -> usize {
        self.byte() as usize % n.max(1)
    }
    fn flag(&mut self) -> bool {
        self.byte() & 1 == 1
    }
}

fn encode(dtype: KvDtype, x: f32) -> Vec<u8> {
    match dtype {
        KvDtype::F32 => x.to_le_bytes().to_vec(),
        KvDtype::F16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
        KvDtype::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
        KvDtype::F8E4M3 => vec![handoff::kv::F8E4M3::from_f32(x).0],
    }
}

/// Per-page checksums of `request`'s synthetic KV under `plan`, computed
/// from the documented definition (src/transfer/checksum.rs), independently
/// of the sender's code: xxh3-64 over the little-endian region hashes
/// `[h(l0,K), h(l0,V), h(l1,K), ...]`, each the xxh3-64 of the page's rows.
fn checksums(plan: &Plan, request: RequestId) -> Vec<u64> {
    let g = plan.geometry;
    let (ps, tokens) = (plan.page_size as usize, plan.tokens as usize);
    (0..plan.pages.len())
        .map(|page| {
            let mut regions = Vec::new();
            for layer in 0..g.n_layers {
                for kv in 0..2 {
                    let mut bytes = Vec::new();
                    for pos in page * ps..((page + 1) * ps).min(tokens) {
                        for j in 0..g.kv_dim() {
                            let x = synthetic::value(request, layer, pos, kv, j);
                            bytes.extend(encode(g.dtype, x));
                        }
                    }
                    regions.extend(xxh3_64(&bytes).to_le_bytes());
                }
            }
            xxh3_64(&regions)
        })
        .collect()
}

fn honest_receipt(plan: &Plan) -> Receipt {
    let n_layers = plan.geometry.n_layers;
    Receipt {
        request: plan.request,
        nonce: plan.nonce,
        layer_tokens: vec![plan.tokens; n_layers],
        pages: plan.pages.clone(),
        page_checksums: checksums(plan, plan.request),
        writers: (0..n_layers as u32)
            .map(|layer| WriterRun {
                layer,
                start: 0,
                len: plan.tokens,
                writer: plan.request,
            })
            .collect(),
        first_token: None,
        first_logprobs: None,
    }
}

/// True when the writer runs say `plan.request`, and nobody else, wrote
/// positions `0..tokens` of every layer, in order.
fn writers_cover(r: &Receipt, plan: &Plan) -> bool {
    let mut next = vec![0u64; plan.geometry.n_layers];
    for w in &r.writers {
        match next.get_mut(w.layer as usize) {
            Some(n) if w.writer == plan.request && u64::from(w.start) == *n => {
                *n += u64::from(w.len)
            }
            _ => return false,
        }
    }
    next.iter().all(|&n| n == u64::from(plan.tokens))
}

/// A receipt decode may accept for `plan`: everything it claims is the plan,
/// and its checksums are those of the request's own KV.
fn matches_plan(r: &Receipt, plan: &Plan) -> bool {
    r.request == plan.request
        && r.nonce == plan.nonce
        && r.layer_tokens == vec![plan.tokens; plan.geometry.n_layers]
        && r.pages == plan.pages
        && r.page_checksums == checksums(plan, plan.request)
        && writers_cover(r, plan)
}

/// Edits the receipt as the input says.
fn edit(r: &mut Receipt, inp: &mut Input<'_>, by: &Plan, by_sums: &[u64]) {
    let pick = |inp: &mut Input<'_>, n: usize| inp.below(n);
    match inp.below(12) {
        0 => r.nonce = by.nonce,
        1 => r.nonce = Nonce(r.nonce.0 ^ (1 << inp.below(64))),
        2 => r.request = BYSTANDER,
        3 => r.request = RequestId(u64::from(inp.byte())),
        4 => {
            r.layer_tokens.pop();
        }
        5 => r.layer_tokens.push(u32::from(inp.byte())),
        6 if !r.layer_tokens.is_empty() => {
            let i = pick(inp, r.layer_tokens.len());
            r.layer_tokens[i] = u32::from(inp.byte());
        }
        7 if !r.pages.is_empty() => {
            let i = pick(inp, r.pages.len());
            match inp.below(4) {
                0 => {
                    r.pages.pop();
                }
                1 => r.pages.push(r.pages[i]),
                2 => r.pages.swap(0, i),
                _ => r.pages[i].generation ^= 1,
            }
        }
        8 if !r.pages.is_empty() && !by.pages.is_empty() => {
            let i = pick(inp, r.pages.len());
            r.pages[i] = by.pages[pick(inp, by.pages.len())];
        }
        9 if !r.page_checksums.is_empty() => {
            let i = pick(inp, r.page_checksums.len());
            match inp.below(4) {
                0 => r.page_checksums[i] ^= 1 << inp.below(64),
                1 => {
                    r.page_checksums.pop();
                }
                2 => r.page_checksums.push(r.page_checksums[i]),
                _ => r.page_checksums = by_sums.to_vec(),
            }
        }
        10 if !r.writers.is_empty() => {
            let i = pick(inp, r.writers.len());
            let w = &mut r.writers[i];
            match inp.below(6) {
                0 => w.writer = BYSTANDER,
                1 => w.start += 1,
                2 => w.len = w.len.saturating_sub(1),
                3 => w.layer += 1,
                4 => {
                    // Split a run in two: still the same claim.
                    let w = *w;
                    let cut = (u32::from(inp.byte()) % w.len.max(1)).max(1).min(w.len);
                    r.writers[i].len = cut;
                    r.writers.insert(
                        i + 1,
                        WriterRun {
                            start: w.start + cut,
                            len: w.len - cut,
                            ..w
                        },
                    );
                }
                _ => {
                    r.writers.pop();
                }
            }
        }
        11 => r.first_token = Some(u32::from(inp.byte())),
        _ => {}
    }
}

struct Rig {
    prefill: InProcessPrefill,
    decode: DecodeSide<InProcessDecode>,
    decode_pool: KvPool,
    prefill_pool: KvPool,
}

fn source(
    pool: &KvPool,
    owner: RequestId,
    kv_of: RequestId,
    changed: Option<usize>,
) -> Arc<KvSeq<Held>> {
    let n = MAX_TOKENS + 2;
    let mut s = pool
        .reserve(owner, n)
        .expect("the prefill pool holds every source");
    match changed {
        None => synthetic::fill(&mut s, kv_of, n).expect("fill"),
        Some(at) => {
            synthetic::fill(&mut s, kv_of, at).expect("fill");
            let kvd = pool.config().geometry().kv_dim();
            for layer in 0..pool.config().geometry().n_layers {
                let mut k: Vec<f32> = (0..kvd)
                    .map(|j| synthetic::value(kv_of, layer, at, 0, j))
                    .collect();
                let v: Vec<f32> = (0..kvd)
                    .map(|j| synthetic::value(kv_of, layer, at, 1, j))
                    .collect();
                k[0] += 0.5;
                s.append(layer, &k, &v).expect("append");
            }
            synthetic::fill(&mut s, kv_of, n - at - 1).expect("fill");
        }
    }
    Arc::new(s.hold())
}

fn write_all(p: &mut InProcessPrefill, plan: &Plan, src: &Arc<KvSeq<Held>>, from: &[usize]) {
    for (layer, &start) in from.iter().enumerate() {
        let tokens = plan.tokens as usize;
        if start < tokens {
            let batch = WriteBatch {
                request: plan.request,
                nonce: plan.nonce,
                layer: layer as u32,
                start: start as u32,
                tokens: (tokens - start) as u32,
            };
            p.write_kv(batch, src).expect("in-process link is up");
        }
    }
}

fn typed(o: &DecodeOutcome) {
    if let Err(e) = &o.result {
        assert!(!e.to_string().is_empty());
        assert!((400..600).contains(&e.http_status()), "{e}");
    }
}

pub fn receipt_verify(data: &[u8]) {
    let mut inp = Input(data);
    let dtype = [KvDtype::BF16, KvDtype::F16, KvDtype::F32, KvDtype::F8E4M3][inp.below(4)];
    let g = KvGeometry {
        n_layers: 1 + inp.below(3),
        n_kv_heads: 1 + inp.below(2),
        head_dim: 2 + 2 * inp.below(2),
        dtype,
    };
    let page_size = 1 << inp.below(4);
    let src_page_size = 1 << inp.below(4);
    let tokens = 1 + inp.below(MAX_TOKENS);
    let by_tokens = 1 + inp.below(MAX_TOKENS);
    let bystander_first = inp.flag();

    let pages_for = |t: usize| (t + MAX_NEW).div_ceil(page_size);
    let pages = pages_for(tokens) + pages_for(by_tokens);
    let decode_pool = KvPool::new(
        PoolConfig::new(g, page_size, pages)
            .scrub(ScrubPolicy::Poison)
            .audit(true),
    )
    .expect("decode pool");
    let prefill_pool = KvPool::new(
        PoolConfig::new(
            g,
            src_page_size,
            4 * (MAX_TOKENS + 2).div_ceil(src_page_size),
        )
        .audit(true),
    )
    .expect("prefill pool");
    let cfg = TransferConfig::default().with_receipt_timeout(Duration::from_secs(20));
    let (p, d) = InProcess.connect(&cfg).expect("in-process link");
    let decode = DecodeSide::new(
        d,
        decode_pool.clone(),
        AdmissionLimits::new(64, pages, page_size),
        cfg,
    );
    let mut rig = Rig {
        prefill: p,
        decode,
        decode_pool,
        prefill_pool,
    };
    run(&mut rig, &mut inp, tokens, by_tokens, bystander_first);
    let Rig {
        prefill,
        decode,
        decode_pool,
        prefill_pool,
    } = rig;
    drop(decode);
    drop(prefill);
    for (name, pool) in [("decode", &decode_pool), ("prefill", &prefill_pool)] {
        let st = pool.stats();
        assert!(st.is_full(), "{name} pool not full at the end: {st:?}");
        assert_eq!(st.isolation_violations, 0, "{name} pool");
    }
}

fn run(rig: &mut Rig, inp: &mut Input<'_>, tokens: usize, by_tokens: usize, bystander_first: bool) {
    for (id, tenant, n) in [(TARGET, 1, tokens), (BYSTANDER, 2, by_tokens)] {
        let req = Request::new(id, TenantId(tenant), vec![id.0 as u32; n], MAX_NEW);
        let _ticket = rig.decode.submit(req).expect("both requests fit");
    }
    let mut plans = BTreeMap::new();
    let until = Instant::now() + Duration::from_secs(5);
    while plans.len() < 2 {
        assert!(Instant::now() < until, "decode never sent both plans");
        if let Some(ToPrefill::Plan(plan)) = rig
            .prefill
            .recv(Duration::from_millis(100))
            .expect("link up")
        {
            plans.insert(plan.request, plan);
        }
    }
    let (plan, by) = (plans[&TARGET].clone(), plans[&BYSTANDER].clone());
    let n_layers = plan.geometry.n_layers;

    let pool = rig.prefill_pool.clone();
    let own = source(&pool, TARGET, TARGET, None);
    let by_src = source(&pool, BYSTANDER, BYSTANDER, None);
    let foreign = source(&pool, NEIGHBOUR, NEIGHBOUR, None);
    let changed = source(&pool, CORRUPT_OWNER, TARGET, Some(inp.below(tokens)));
    let by_sums = checksums(&by, BYSTANDER);

    let send_bystander = |p: &mut InProcessPrefill| {
        write_all(p, &by, &by_src, &vec![0; n_layers]);
        p.send(ToDecode::Receipt(honest_receipt(&by)))
            .expect("link up");
    };
    if bystander_first {
        send_bystander(&mut rig.prefill);
    }

    // The target's writes, then the rest of every layer from its own KV.
    let mut landed = vec![0usize; n_layers];
    let mut named_bystander = false;
    let ops = inp.below(6);
    for _ in 0..ops {
        let src = [&own, &foreign, &changed][inp.below(3)];
        let layer = inp.below(n_layers + 1);
        let start = if inp.flag() {
            landed.get(layer).copied().unwrap_or(0)
        } else {
            inp.below(tokens + 2)
        };
        let n = 1 + inp.below(tokens + 1);
        let request = if inp.below(8) == 0 { BYSTANDER } else { TARGET };
        let nonce = match inp.below(8) {
            0 => by.nonce,
            1 => Nonce(plan.nonce.0 ^ 1),
            _ => plan.nonce,
        };
        named_bystander |= request == BYSTANDER || nonce == by.nonce;
        let batch = WriteBatch {
            request,
            nonce,
            layer: layer as u32,
            start: start as u32,
            tokens: n as u32,
        };
        rig.prefill.write_kv(batch, src).expect("link up");
        if request == TARGET
            && nonce == plan.nonce
            && layer < n_layers
            && start == landed[layer]
            && start + n <= tokens
        {
            landed[layer] += n;
        }
    }
    let skip_rest = inp.below(4) == 3;
    if !skip_rest {
        write_all(&mut rig.prefill, &plan, &own, &landed);
    }
    let mut receipt = honest_receipt(&plan);
    let edits = inp.below(4);
    for _ in 0..edits {
        edit(&mut receipt, inp, &by, &by_sums);
    }
    named_bystander |= receipt.request == BYSTANDER || receipt.nonce == by.nonce;
    rig.prefill
        .send(ToDecode::Receipt(receipt.clone()))
        .expect("link up");
    if inp.flag() {
        rig.prefill
            .send(ToDecode::Receipt(receipt.clone()))
            .expect("link up");
    }
    if !bystander_first {
        send_bystander(&mut rig.prefill);
    }
    rig.prefill.send(ToDecode::Abort(PROBE)).expect("link up");

    // Every message handled: the probe was counted.
    let mut outcomes = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    while rig.decode.stats().ignored_aborts == 0 {
        assert!(Instant::now() < until, "decode never handled its messages");
        outcomes.extend(rig.decode.poll(Duration::from_millis(1)));
    }
    // A transfer whose receipt went elsewhere waits for its receipt
    // timeout; the client gives up instead.
    for id in [TARGET, BYSTANDER] {
        if !outcomes.iter().any(|o| o.request == id) {
            assert_eq!(rig.decode.cancel(id), CancelOutcome::Fenced);
        }
    }
    assert_eq!(rig.decode.in_flight(), 0);
    assert_eq!(rig.decode.landing().open_transfers(), 0);

    let untouched = ops == 0 && !skip_rest && receipt == honest_receipt(&plan);
    let mut verified = Vec::new();
    for o in outcomes {
        typed(&o);
        let Ok(kv) = o.result else {
            continue;
        };
        let (id, want) = if o.request == TARGET {
            (TARGET, &plan)
        } else {
            (BYSTANDER, &by)
        };
        assert_eq!(kv.request().id, id);
        assert_eq!(kv.seq().owner(), id);
        assert_eq!(kv.seq().complete_len(), Some(want.tokens as usize));
        let planned: Vec<_> = kv.seq().pages()[..want.pages.len()]
            .iter()
            .map(|&p| PlannedPage::from(p))
            .collect();
        assert_eq!(
            planned, want.pages,
            "verified KV in other pages than planned"
        );
        assert_eq!(
            synthetic::check(&rig.decode_pool, kv.seq(), id).expect("audited read"),
            Ok(()),
            "{id} verified with bytes that are not its own"
        );
        if id == TARGET {
            assert!(
                matches_plan(&receipt, &plan),
                "accepted {receipt:?} for {plan:?}"
            );
        }
        verified.push((id, kv));
    }
    let accepted: Vec<RequestId> = verified.iter().map(|(id, _)| *id).collect();
    if untouched {
        assert!(accepted.contains(&TARGET), "the untouched transfer failed");
    }
    if !named_bystander {
        assert!(accepted.contains(&BYSTANDER), "the bystander was harmed");
    }

    // Prefill is acked for exactly the verified transfers.
    let mut acked = Vec::new();
    while let Ok(Some(msg)) = rig.prefill.recv(Duration::ZERO) {
        if let ToPrefill::Answer(a) = msg
            && a.verdict == Verdict::Ack
        {
            acked.push(a.request);
        }
    }
    acked.sort();
    let mut want = accepted.clone();
    want.sort();
    assert_eq!(acked, want, "acks differ from verified transfers");
    drop(verified);
}
