//! The TCP wire format: length-prefixed binary frames.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "HNDF"
//! 4       2     protocol version (LE), 1
//! 6       1     kind
//! 7       1     flags: 0, or FLAG_SEALED on an authenticated link
//! 8       4     sequence number (LE), +1 per frame per direction, from 0
//! 12      4     payload length (LE); sealed: ciphertext + 16-byte tag
//! 16      len   payload (kind-specific, little-endian fields); sealed:
//!               AEGIS-128X4 ciphertext of it, then the tag, with these 16
//!               header bytes as associated data (see `transfer::auth`)
//! ```
//!
//! Decoding is a pure function of a byte slice; it never panics and never
//! allocates more than the bytes it was given justify.

use crate::fingerprint::ModelFingerprint;
use crate::ids::{RequestId, TenantId};
use crate::kv::{KvDtype, KvGeometry};
use crate::sampling::SamplingParams;
use crate::sampling::{MAX_TOP_LOGPROBS, TokenLogprobs};
use crate::transfer::error::WireError;
use crate::transfer::link::identity::PeerId;
use crate::transfer::protocol::{
    Abort, AbortReason, Answer, FailReason, Nonce, Plan, PlannedPage, Receipt, ToDecode, ToPrefill,
    Verdict, WriteBatch, WriterRun,
};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"HNDF";
/// The protocol version this build speaks (2: plans name their model,
/// aborts can say the models differ; 3: plans carry `logprobs`, receipts
/// the first token's log-probabilities, staged writes the spans the decode
/// end READs; 4: plans name the worker they are addressed to).
pub const VERSION: u16 = 4;
/// Bytes of the frame header.
pub const HEADER_LEN: usize = 16;
/// Header flag of every frame on an authenticated link: the payload is
/// sealed (encrypted, then a 16-byte tag). A link accepts only its own kind.
pub const FLAG_SEALED: u8 = 1;
/// Bytes of a write frame's payload before the K and V rows.
pub const WRITE_PREFIX_LEN: usize = 28;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    Plan = 2,
    Answer = 3,
    Credit = 4,
    Write = 5,
    Receipt = 6,
    Abort = 7,
    Staged = 8,
    DataPlane = 9,
}

impl Kind {
    fn from_u8(k: u8) -> Result<Kind, WireError> {
        Ok(match k {
            1 => Kind::Hello,
            2 => Kind::Plan,
            3 => Kind::Answer,
            4 => Kind::Credit,
            5 => Kind::Write,
            6 => Kind::Receipt,
            7 => Kind::Abort,
            8 => Kind::Staged,
            9 => Kind::DataPlane,
            kind => return Err(WireError::UnknownKind { kind }),
        })
    }
    /// The kind's name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Hello => "hello",
            Kind::Plan => "plan",
            Kind::Answer => "answer",
            Kind::Credit => "credit",
            Kind::Write => "write",
            Kind::Receipt => "receipt",
            Kind::Abort => "abort",
            Kind::Staged => "staged write",
            Kind::DataPlane => "data plane",
        }
    }
}

/// Which end a hello comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub seq: u32,
    pub len: u32,
}

/// A decoded frame. A write borrows its K and V bytes from the input.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame<'a> {
    Hello(Role),
    ToPrefill(ToPrefill),
    /// KV bytes landed at the decode end; the sender may send that many more.
    Credit(u64),
    /// A write batch and its bytes: K rows then V rows, equal halves.
    Write(WriteBatch, &'a [u8]),
    /// A write batch whose bytes the decode end fetches by a data plane
    /// (NIXL) from where `Staged` says they lie at the prefill end.
    Staged(WriteBatch, Staged),
    ToDecode(ToDecode),
    /// A data plane's parameters (opaque to this layer): the decode end's,
    /// once, right after its hello; the prefill end's (its agent's
    /// metadata), before the first staged write that needs them.
    DataPlane(&'a [u8]),
}

/// Where a staged write's bytes lie at the prefill end: K rows then V
/// rows, in the order of `src`'s spans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Staged {
    /// The write's number on its link: 0, 1, 2, ... in send order.
    pub id: u64,
    /// Bytes of K and V together (the sum of `src`'s lengths).
    pub len: u64,
    /// The spans (address, length) of the prefill end's registered memory
    /// that hold the bytes, in order.
    pub src: Vec<(u64, u64)>,
}

/// Bytes of a staged write's payload before its spans.
pub const STAGED_LEN: usize = WRITE_PREFIX_LEN + 20;
/// Bytes of each span of a staged write.
pub const STAGED_SPAN_LEN: usize = 16;

impl Frame<'_> {
    /// The frame's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Frame::Hello(_) => Kind::Hello,
            Frame::ToPrefill(ToPrefill::Plan(_)) => Kind::Plan,
            Frame::ToPrefill(ToPrefill::Answer(_)) => Kind::Answer,
            Frame::Credit(_) => Kind::Credit,
            Frame::Write(..) => Kind::Write,
            Frame::Staged(..) => Kind::Staged,
            Frame::ToDecode(ToDecode::Receipt(_)) => Kind::Receipt,
            Frame::ToDecode(ToDecode::Abort(_)) => Kind::Abort,
            Frame::DataPlane(_) => Kind::DataPlane,
        }
    }
}

/// Decodes a header; refuses bad magic, versions, kinds, flags, and
/// payloads longer than `max_len`.
pub fn decode_header(h: &[u8], max_len: usize) -> Result<Header, WireError> {
    decode_header_flagged(h, max_len, 0)
}

/// [`decode_header`] for a link whose every frame carries `flags` (0, or
/// [`FLAG_SEALED`] on an authenticated link); any other flags are refused.
pub fn decode_header_flagged(h: &[u8], max_len: usize, want: u8) -> Result<Header, WireError> {
    let mut r = Rd::new(h);
    let magic = [
        r.u8("magic")?,
        r.u8("magic")?,
        r.u8("magic")?,
        r.u8("magic")?,
    ];
    if magic != MAGIC {
        return Err(WireError::BadMagic { got: magic });
    }
    let version = r.u16("version")?;
    if version != VERSION {
        return Err(WireError::UnsupportedVersion {
            got: version,
            supported: VERSION,
        });
    }
    let kind = Kind::from_u8(r.u8("kind")?)?;
    let flags = r.u8("flags")?;
    if flags != want {
        return Err(WireError::BadFlags { flags });
    }
    let seq = r.u32("sequence")?;
    let len = r.u32("length")?;
    if len as u64 > max_len as u64 {
        return Err(WireError::Oversized {
            len: len as u64,
            max: max_len as u64,
        });
    }
    Ok(Header { kind, seq, len })
}

/// Decodes one frame from the start of `buf`: `Ok(None)` when `buf` holds
/// less than a whole frame, else the header, the frame, and the bytes used.
pub fn decode_frame(
    buf: &[u8],
    max_len: usize,
) -> Result<Option<(Header, Frame<'_>, usize)>, WireError> {
    let Some(h) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let header = decode_header(h, max_len)?;
    let end = HEADER_LEN + header.len as usize;
    let Some(payload) = buf.get(HEADER_LEN..end) else {
        return Ok(None);
    };
    Ok(Some((header, decode_payload(header.kind, payload)?, end)))
}

/// Decodes a payload of `kind`.
pub fn decode_payload(kind: Kind, p: &[u8]) -> Result<Frame<'_>, WireError> {
    let mut r = Rd::new(p);
    let frame = match kind {
        Kind::Hello => Frame::Hello(match r.u8("role")? {
            0 => Role::Prefill,
            1 => Role::Decode,
            _ => return Err(WireError::Invalid { what: "hello role" }),
        }),
        Kind::Plan => Frame::ToPrefill(ToPrefill::Plan(read_plan(&mut r)?)),
        Kind::Answer => {
            let request = RequestId(r.u64("request")?);
            let nonce = Nonce(r.u64("nonce")?);
            let verdict = match r.u8("verdict")? {
                0 => Verdict::Ack,
                1 => Verdict::Fail(FailReason::Integrity),
                2 => Verdict::Fail(FailReason::Timeout),
                3 => Verdict::Fail(FailReason::Cancelled),
                _ => return Err(WireError::Invalid { what: "verdict" }),
            };
            Frame::ToPrefill(ToPrefill::Answer(Answer {
                request,
                nonce,
                verdict,
            }))
        }
        Kind::Credit => Frame::Credit(r.u64("credit")?),
        Kind::Write => {
            let batch = read_batch(&mut r)?;
            let bytes = r.rest();
            if !bytes.len().is_multiple_of(2) {
                return Err(WireError::Invalid {
                    what: "write payload (K and V halves differ)",
                });
            }
            return Ok(Frame::Write(batch, bytes));
        }
        Kind::Staged => {
            let batch = read_batch(&mut r)?;
            let id = r.u64("staged id")?;
            let len = r.u64("staged length")?;
            let n = r.count("staged spans", STAGED_SPAN_LEN)?;
            let src = (0..n)
                .map(|_| Ok((r.u64("span address")?, r.u64("span length")?)))
                .collect::<Result<Vec<_>, WireError>>()?;
            if !len.is_multiple_of(2) {
                return Err(WireError::Invalid {
                    what: "staged length (K and V halves differ)",
                });
            }
            let sum = src.iter().try_fold(0u64, |acc, &(_, l)| acc.checked_add(l));
            if sum != Some(len)
                || src
                    .iter()
                    .any(|&(a, l)| l == 0 || a.checked_add(l).is_none())
            {
                return Err(WireError::Invalid {
                    what: "staged spans (empty, wrapping, or not adding up to the length)",
                });
            }
            Frame::Staged(batch, Staged { id, len, src })
        }
        Kind::DataPlane => return Ok(Frame::DataPlane(r.rest())),
        Kind::Receipt => Frame::ToDecode(ToDecode::Receipt(read_receipt(&mut r)?)),
        Kind::Abort => Frame::ToDecode(ToDecode::Abort(Abort {
            request: RequestId(r.u64("request")?),
            nonce: Nonce(r.u64("nonce")?),
            reason: read_reason(&mut r)?,
        })),
    };
    if r.left() > 0 {
        return Err(WireError::TrailingBytes {
            kind: kind.name(),
            extra: r.left(),
        });
    }
    Ok(frame)
}

fn read_batch(r: &mut Rd<'_>) -> Result<WriteBatch, WireError> {
    Ok(WriteBatch {
        request: RequestId(r.u64("request")?),
        nonce: Nonce(r.u64("nonce")?),
        layer: r.u32("layer")?,
        start: r.u32("start")?,
        tokens: r.u32("tokens")?,
    })
}

fn read_plan(r: &mut Rd<'_>) -> Result<Plan, WireError> {
    let request = RequestId(r.u64("request")?);
    let tenant = TenantId(r.u32("tenant")?);
    let nonce = Nonce(r.u64("nonce")?);
    let tokens = r.u32("tokens")?;
    let geometry = KvGeometry {
        n_layers: r.u32("n_layers")? as usize,
        n_kv_heads: r.u32("n_kv_heads")? as usize,
        head_dim: r.u32("head_dim")? as usize,
        dtype: match r.u8("dtype")? {
            0 => KvDtype::F32,
            1 => KvDtype::F16,
            2 => KvDtype::BF16,
            3 => KvDtype::F8E4M3,
            _ => return Err(WireError::Invalid { what: "dtype" }),
        },
    };
    let page_size = r.u32("page_size")?;
    let n = r.count("prompt", 4)?;
    let prompt = (0..n).map(|_| r.u32("prompt")).collect::<Result<_, _>>()?;
    let pages = read_pages(r)?;
    let sampling = read_sampling(r)?;
    let model = read_model(r)?;
    let peer = match r.u8("peer")? {
        0 => None,
        1 => Some(PeerId::from_bytes(r.take::<32>("peer")?)),
        _ => return Err(WireError::Invalid { what: "peer" }),
    };
    let prefix_cache = match r.u8("prefix cache flag")? {
        0 => false,
        1 => true,
        _ => {
            return Err(WireError::Invalid {
                what: "prefix cache flag",
            });
        }
    };
    Ok(Plan {
        request,
        tenant,
        nonce,
        prompt,
        tokens,
        geometry,
        page_size,
        pages,
        sampling,
        model,
        peer,
        prefix_cache,
    })
}

fn read_sampling(r: &mut Rd<'_>) -> Result<SamplingParams, WireError> {
    let temperature = f32::from_bits(r.u32("temperature")?);
    let top_k = match r.u64("top_k")? {
        0 => None,
        k => Some(usize::try_from(k).map_err(|_| WireError::Invalid { what: "top_k" })?),
    };
    let top_p = match r.u8("top_p flag")? {
        0 => None,
        1 => Some(f32::from_bits(r.u32("top_p")?)),
        _ => return Err(WireError::Invalid { what: "top_p flag" }),
    };
    let seed = r.u64("seed")?;
    let n = r.count("stop ids", 4)?;
    let stop_ids = (0..n).map(|_| r.u32("stop id")).collect::<Result<_, _>>()?;
    let logprobs = match r.u8("logprobs flag")? {
        0 => None,
        1 => Some(r.u8("logprobs")?),
        _ => {
            return Err(WireError::Invalid {
                what: "logprobs flag",
            });
        }
    };
    Ok(SamplingParams {
        temperature,
        top_k,
        top_p,
        seed,
        stop_ids,
        logprobs,
    })
}

fn read_pages(r: &mut Rd<'_>) -> Result<Vec<PlannedPage>, WireError> {
    let n = r.count("pages", 12)?;
    (0..n)
        .map(|_| {
            Ok(PlannedPage {
                index: r.u32("page index")?,
                generation: r.u64("page generation")?,
            })
        })
        .collect()
}

fn read_receipt(r: &mut Rd<'_>) -> Result<Receipt, WireError> {
    let request = RequestId(r.u64("request")?);
    let nonce = Nonce(r.u64("nonce")?);
    let n = r.count("layer counts", 4)?;
    let layer_tokens = (0..n)
        .map(|_| r.u32("layer count"))
        .collect::<Result<_, _>>()?;
    let pages = read_pages(r)?;
    let n = r.count("checksums", 8)?;
    let page_checksums = (0..n)
        .map(|_| r.u64("checksum"))
        .collect::<Result<_, _>>()?;
    let n = r.count("writers", 20)?;
    let writers = (0..n)
        .map(|_| {
            Ok(WriterRun {
                layer: r.u32("writer layer")?,
                start: r.u32("writer start")?,
                len: r.u32("writer len")?,
                writer: RequestId(r.u64("writer")?),
            })
        })
        .collect::<Result<_, WireError>>()?;
    let first_token = match r.u8("first token flag")? {
        0 => None,
        1 => Some(r.u32("first token")?),
        _ => {
            return Err(WireError::Invalid {
                what: "first token flag",
            });
        }
    };
    let first_logprobs = match r.u8("first logprobs flag")? {
        0 => None,
        1 => {
            let token = r.u32("logprobs token")?;
            let logprob = f32::from_bits(r.u32("logprob")?);
            let n = r.count("top logprobs", 8)?;
            if n > MAX_TOP_LOGPROBS as usize {
                return Err(WireError::Invalid {
                    what: "top logprobs (more than 20)",
                });
            }
            let top = (0..n)
                .map(|_| Ok((r.u32("top id")?, f32::from_bits(r.u32("top logprob")?))))
                .collect::<Result<_, WireError>>()?;
            Some(TokenLogprobs {
                token,
                logprob,
                top,
            })
        }
        _ => {
            return Err(WireError::Invalid {
                what: "first logprobs flag",
            });
        }
    };
    Ok(Receipt {
        request,
        nonce,
        layer_tokens,
        pages,
        page_checksums,
        writers,
        first_token,
        first_logprobs,
    })
}

fn read_reason(r: &mut Rd<'_>) -> Result<AbortReason, WireError> {
    Ok(match r.u8("abort reason")? {
        0 => AbortReason::EmptyPrompt,
        1 => AbortReason::PromptTooLong {
            prompt: r.u64("prompt")?,
            max_context: r.u64("max_context")?,
        },
        2 => AbortReason::ExceedsPool {
            tokens: r.u64("tokens")?,
            pool_tokens: r.u64("pool_tokens")?,
        },
        3 => AbortReason::InvalidToken {
            index: r.u64("index")?,
            token: r.u32("token")?,
            vocab: r.u64("vocab")?,
        },
        4 => AbortReason::MalformedPlan,
        5 => AbortReason::IsolationViolation,
        6 => AbortReason::ComputeFailed,
        7 => AbortReason::ShuttingDown,
        8 => AbortReason::Busy {
            pending: r.u64("pending")?,
        },
        9 => AbortReason::ModelMismatch {
            planned: read_model(r)?,
            served: read_model(r)?,
        },
        _ => {
            return Err(WireError::Invalid {
                what: "abort reason",
            });
        }
    })
}

/// Appends a header for a payload of `len` bytes.
pub fn put_header(out: &mut Vec<u8>, kind: Kind, seq: u32, len: u32) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(kind as u8);
    out.push(0);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
}

/// Appends a whole frame. For a write, `Frame::Write`'s bytes are copied;
/// senders that copy rows straight from the pool use [`put_write_prefix`].
pub fn encode_frame(out: &mut Vec<u8>, seq: u32, frame: &Frame<'_>) {
    let at = out.len();
    put_header(out, frame.kind(), seq, 0);
    let body = out.len();
    let mut w = Wr(out);
    match frame {
        Frame::Hello(role) => w.u8(match role {
            Role::Prefill => 0,
            Role::Decode => 1,
        }),
        Frame::ToPrefill(ToPrefill::Plan(p)) => write_plan(&mut w, p),
        Frame::ToPrefill(ToPrefill::Answer(a)) => {
            w.u64(a.request.0);
            w.u64(a.nonce.0);
            w.u8(match a.verdict {
                Verdict::Ack => 0,
                Verdict::Fail(FailReason::Integrity) => 1,
                Verdict::Fail(FailReason::Timeout) => 2,
                Verdict::Fail(FailReason::Cancelled) => 3,
            });
        }
        Frame::Credit(n) => w.u64(*n),
        Frame::Write(b, bytes) => {
            write_batch(&mut w, b);
            w.0.extend_from_slice(bytes);
        }
        Frame::Staged(b, s) => {
            write_batch(&mut w, b);
            w.u64(s.id);
            w.u64(s.len);
            w.u32(s.src.len() as u32);
            for &(addr, len) in &s.src {
                w.u64(addr);
                w.u64(len);
            }
        }
        Frame::DataPlane(bytes) => w.0.extend_from_slice(bytes),
        Frame::ToDecode(ToDecode::Receipt(r)) => write_receipt(&mut w, r),
        Frame::ToDecode(ToDecode::Abort(a)) => {
            w.u64(a.request.0);
            w.u64(a.nonce.0);
            write_reason(&mut w, &a.reason);
        }
    }
    let len = (out.len() - body) as u32;
    out[at + 12..at + 16].copy_from_slice(&len.to_le_bytes());
}

/// Appends a write frame's header and fixed fields for `kv_bytes` bytes of
/// K and V rows that the caller appends next.
pub fn put_write_prefix(out: &mut Vec<u8>, seq: u32, b: &WriteBatch, kv_bytes: u32) {
    put_header(out, Kind::Write, seq, WRITE_PREFIX_LEN as u32 + kv_bytes);
    write_batch(&mut Wr(out), b);
}

fn write_batch(w: &mut Wr<'_>, b: &WriteBatch) {
    w.u64(b.request.0);
    w.u64(b.nonce.0);
    w.u32(b.layer);
    w.u32(b.start);
    w.u32(b.tokens);
}

fn write_plan(w: &mut Wr<'_>, p: &Plan) {
    w.u64(p.request.0);
    w.u32(p.tenant.0);
    w.u64(p.nonce.0);
    w.u32(p.tokens);
    let g = p.geometry;
    w.u32(g.n_layers as u32);
    w.u32(g.n_kv_heads as u32);
    w.u32(g.head_dim as u32);
    w.u8(match g.dtype {
        KvDtype::F32 => 0,
        KvDtype::F16 => 1,
        KvDtype::BF16 => 2,
        KvDtype::F8E4M3 => 3,
    });
    w.u32(p.page_size);
    w.u32(p.prompt.len() as u32);
    for &t in &p.prompt {
        w.u32(t);
    }
    write_pages(w, &p.pages);
    let s = &p.sampling;
    w.u32(s.temperature.to_bits());
    w.u64(s.top_k.map_or(0, |k| k as u64));
    match s.top_p {
        None => w.u8(0),
        Some(x) => {
            w.u8(1);
            w.u32(x.to_bits());
        }
    }
    w.u64(s.seed);
    w.u32(s.stop_ids.len() as u32);
    for &t in &s.stop_ids {
        w.u32(t);
    }
    match s.logprobs {
        None => w.u8(0),
        Some(n) => {
            w.u8(1);
            w.u8(n);
        }
    }
    write_model(w, p.model);
    match p.peer {
        None => w.u8(0),
        Some(id) => {
            w.u8(1);
            w.0.extend_from_slice(id.as_bytes());
        }
    }
    w.u8(u8::from(p.prefix_cache));
}

fn write_pages(w: &mut Wr<'_>, pages: &[PlannedPage]) {
    w.u32(pages.len() as u32);
    for p in pages {
        w.u32(p.index);
        w.u64(p.generation);
    }
}

fn write_receipt(w: &mut Wr<'_>, r: &Receipt) {
    w.u64(r.request.0);
    w.u64(r.nonce.0);
    w.u32(r.layer_tokens.len() as u32);
    for &t in &r.layer_tokens {
        w.u32(t);
    }
    write_pages(w, &r.pages);
    w.u32(r.page_checksums.len() as u32);
    for &c in &r.page_checksums {
        w.u64(c);
    }
    w.u32(r.writers.len() as u32);
    for x in &r.writers {
        w.u32(x.layer);
        w.u32(x.start);
        w.u32(x.len);
        w.u64(x.writer.0);
    }
    match r.first_token {
        None => w.u8(0),
        Some(t) => {
            w.u8(1);
            w.u32(t);
        }
    }
    match &r.first_logprobs {
        None => w.u8(0),
        Some(lp) => {
            w.u8(1);
            w.u32(lp.token);
            w.u32(lp.logprob.to_bits());
            w.u32(lp.top.len() as u32);
            for &(id, x) in &lp.top {
                w.u32(id);
                w.u32(x.to_bits());
            }
        }
    }
}

fn write_reason(w: &mut Wr<'_>, reason: &AbortReason) {
    match *reason {
        AbortReason::EmptyPrompt => w.u8(0),
        AbortReason::PromptTooLong {
            prompt,
            max_context,
        } => {
            w.u8(1);
            w.u64(prompt);
            w.u64(max_context);
        }
        AbortReason::ExceedsPool {
            tokens,
            pool_tokens,
        } => {
            w.u8(2);
            w.u64(tokens);
            w.u64(pool_tokens);
        }
        AbortReason::InvalidToken {
            index,
            token,
            vocab,
        } => {
            w.u8(3);
            w.u64(index);
            w.u32(token);
            w.u64(vocab);
        }
        AbortReason::MalformedPlan => w.u8(4),
        AbortReason::IsolationViolation => w.u8(5),
        AbortReason::ComputeFailed => w.u8(6),
        AbortReason::ShuttingDown => w.u8(7),
        AbortReason::Busy { pending } => {
            w.u8(8);
            w.u64(pending);
        }
        AbortReason::ModelMismatch { planned, served } => {
            w.u8(9);
            write_model(w, planned);
            write_model(w, served);
        }
    }
}

fn write_model(w: &mut Wr<'_>, model: Option<ModelFingerprint>) {
    match model {
        None => w.u8(0),
        Some(m) => {
            w.u8(1);
            w.u64(m.to_u64());
        }
    }
}

fn read_model(r: &mut Rd<'_>) -> Result<Option<ModelFingerprint>, WireError> {
    match r.u8("model")? {
        0 => Ok(None),
        1 => Ok(Some(ModelFingerprint::from_u64(r.u64("model")?))),
        _ => Err(WireError::Invalid { what: "model" }),
    }
}

/// A bounds-checked little-endian reader.
struct Rd<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Rd<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Rd { buf, pos: 0 }
    }
    fn take<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let end = self
            .pos
            .checked_add(N)
            .ok_or(WireError::Truncated { what })?;
        let bytes = self
            .buf
            .get(self.pos..end)
            .ok_or(WireError::Truncated { what })?;
        self.pos = end;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take::<1>(what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(what)?))
    }
    /// A count of `elem`-byte elements, refused when the bytes left cannot
    /// hold that many (so no allocation exceeds the input).
    fn count(&mut self, what: &'static str, elem: usize) -> Result<usize, WireError> {
        let n = self.u32(what)? as usize;
        if n.checked_mul(elem).is_none_or(|b| b > self.left()) {
            return Err(WireError::Truncated { what });
        }
        Ok(n)
    }
    fn left(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }
    fn rest(&mut self) -> &'a [u8] {
        let r = self.buf.get(self.pos..).unwrap_or_default();
        self.pos = self.buf.len();
        r
    }
}

/// A little-endian writer.
struct Wr<'a>(&'a mut Vec<u8>);

impl Wr<'_> {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u32(&mut self, x: u32) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::protocol::Abort;

    #[test]
    fn every_abort_reason_survives_the_wire() {
        let reasons = [
            AbortReason::EmptyPrompt,
            AbortReason::PromptTooLong {
                prompt: 9,
                max_context: 8,
            },
            AbortReason::ExceedsPool {
                tokens: 7,
                pool_tokens: 6,
            },
            AbortReason::InvalidToken {
                index: 1,
                token: 99,
                vocab: 50,
            },
            AbortReason::MalformedPlan,
            AbortReason::IsolationViolation,
            AbortReason::ComputeFailed,
            AbortReason::ShuttingDown,
            AbortReason::Busy { pending: 65_536 },
            AbortReason::ModelMismatch {
                planned: Some(ModelFingerprint::from_u64(u64::MAX)),
                served: None,
            },
            AbortReason::ModelMismatch {
                planned: None,
                served: Some(ModelFingerprint::from_u64(7)),
            },
        ];
        for reason in reasons {
            let abort = Abort {
                request: RequestId(3),
                nonce: Nonce(0xfeed),
                reason: reason.clone(),
            };
            let mut buf = Vec::new();
            encode_frame(
                &mut buf,
                1,
                &Frame::ToDecode(ToDecode::Abort(abort.clone())),
            );
            match decode_frame(&buf, 1 << 20) {
                Ok(Some((_, Frame::ToDecode(ToDecode::Abort(got)), used))) => {
                    assert_eq!(got, abort);
                    assert_eq!(used, buf.len());
                }
                other => panic!("{reason:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn staged_writes_and_data_plane_parameters_survive_the_wire() {
        let batch = WriteBatch {
            request: RequestId(5),
            nonce: Nonce(77),
            layer: 3,
            start: 16,
            tokens: 8,
        };
        let staged = Staged {
            id: 9,
            len: 1024,
            src: vec![(4096, 1000), (1 << 40, 24)],
        };
        let frames = [
            Frame::Staged(batch, staged.clone()),
            Frame::DataPlane(b"agent md"),
        ];
        for f in frames {
            let mut buf = Vec::new();
            encode_frame(&mut buf, 4, &f);
            match decode_frame(&buf, 1 << 20) {
                Ok(Some((h, got, used))) => {
                    assert_eq!((h.kind, h.seq, &got, used), (f.kind(), 4, &f, buf.len()));
                }
                other => panic!("{f:?}: {other:?}"),
            }
        }
        assert_eq!(
            {
                let mut buf = Vec::new();
                encode_frame(&mut buf, 0, &Frame::Staged(batch, staged.clone()));
                buf.len() - HEADER_LEN
            },
            STAGED_LEN + 2 * STAGED_SPAN_LEN
        );
        let lies: [(Staged, &str); 4] = [
            (
                Staged {
                    len: 1023,
                    src: vec![(0, 1023)],
                    ..staged.clone()
                },
                "staged length (K and V halves differ)",
            ),
            (
                Staged {
                    len: 1026,
                    ..staged.clone()
                },
                "staged spans (empty, wrapping, or not adding up to the length)",
            ),
            (
                Staged {
                    src: vec![(4096, 1024), (8192, 0)],
                    ..staged.clone()
                },
                "staged spans (empty, wrapping, or not adding up to the length)",
            ),
            (
                Staged {
                    src: vec![(u64::MAX - 8, 1024)],
                    ..staged.clone()
                },
                "staged spans (empty, wrapping, or not adding up to the length)",
            ),
        ];
        for (lie, what) in lies {
            let mut buf = Vec::new();
            encode_frame(&mut buf, 0, &Frame::Staged(batch, lie));
            assert_eq!(
                decode_frame(&buf, 1 << 20).err(),
                Some(WireError::Invalid { what })
            );
        }
    }
}
