//! Generates from a llama2.c `.bin` file or a Hugging Face model folder,
//! serving every prompt concurrently in one continuous batch.
//!
//! ```sh
//! cargo run --release --example generate -- --model PATH \
//!     --prompt-ids 1,2,3 [--prompt-ids 1,5 ...] --max-new-tokens N --temperature 0
//! cargo run --release --example generate -- --model PATH --prompt "Once upon" --max-new-tokens 32
//! cargo run --release --example generate -- --model PATH --chat "What is a KV cache?" --max-new-tokens 128
//! ```
//!
//! With `--prompt-ids`, stdout has one line per prompt, in order: the
//! generated token ids separated by single spaces. Generation stops only at
//! max new tokens unless `--stop-ids` is given. Logs and timings go to stderr.
//!
//! Text needs the model's tokenizer (a Hugging Face folder's tokenizer.json,
//! or a GGUF file's metadata). `--prompt TEXT` (repeatable) tokenizes the
//! text as the model's tokenizer does (BOS only where it says) and prints,
//! per prompt, in order, the generated text followed by a newline. Text
//! modes generate at most 64 new tokens unless `--max-new-tokens` says.
//! `--chat TEXT` renders a one-turn conversation with the model's chat
//! template and streams the answer to stdout as it is generated, then a
//! newline. In both, the model's EOS and end-of-turn tokens end generation
//! (and are not printed), as does any `--stop STRING` (repeatable; the stop
//! string is not printed). The last stderr line gives tokens/s and the time
//! to first token.
//!
//! Other flags: `--stop-ids 1,2`, `--top-k K`, `--top-p P`, `--seed S`
//! (request i uses S + i), `--page-size N` (16; a power of two, lowered to
//! fit the context window), `--kv-dtype f32|f16|bf16|fp8` (f16, as llama.cpp and vLLM
//! default: half the bytes per attended position, so long contexts decode faster; f32 for exactness checks), `--threads N`
//! (all cores), `--speculative ngram|off` (off: prompt-lookup drafts verified
//! in one pass; greedy output unchanged, the acceptance rate on stderr),
//! `--backend cpu|cuda` (cpu). `--backend cuda` runs the model
//! on GPU 0 with its KV pages in device memory and sampling on the device
//! (a build with `--features cuda`; without one, or without a usable GPU,
//! it exits 2 and says why).
//!
//! Bad arguments (including counts that overflow, and prompts the engine
//! rejects) print the reason and the usage on stderr, nothing on stdout, and
//! exit with status 2. A request that fails while generating still gets its
//! line (the tokens it streamed), and the exit status is 1.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use handoff::backend::{Backend, CpuBackend};
use handoff::model::Model;
use handoff::request::SpecConfig;
use handoff::text::{Message, StopMatcher, StreamDecoder, TextModel, Tokenizer};
use handoff::{
    Engine, EngineConfig, EngineOptions, Event, KvDtype, Outcome, Request, RequestId,
    SamplingParams, TenantId,
};

#[path = "support/on_gpu.rs"]
mod on_gpu;

/// What the prompts are and how the output is printed.
#[derive(Debug, Clone, PartialEq)]
enum Mode {
    /// `--prompt-ids`: ids in, one line of ids out per prompt.
    Ids,
    /// `--prompt`: text in, text out per prompt.
    Text(Vec<String>),
    /// `--chat`: one user turn in, the answer streamed out.
    Chat(String),
}

struct Args {
    model: PathBuf,
    mode: Mode,
    prompts: Vec<Vec<u32>>,
    stops: Vec<String>,
    max_new: usize,
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
    seed: u64,
    stop_ids: Vec<u32>,
    page_size: usize,
    kv_dtype: KvDtype,
    threads: Option<usize>,
    cuda: bool,
    /// `--speculative ngram`: every request drafts by prompt lookup.
    speculative: Option<SpecConfig>,
}

/// `--max-new-tokens` of `--prompt` and `--chat` when it is not given.
const TEXT_MAX_NEW: usize = 64;

const USAGE: &str = "usage: generate --model PATH (--prompt-ids 1,2,3 [--prompt-ids ...] | \
--prompt TEXT [--prompt ...] | --chat TEXT) --max-new-tokens N (64 for text) [--temperature T] [--top-k K] \
[--top-p P] [--seed S] [--stop-ids a,b] [--stop STRING ...] [--page-size N] \
[--kv-dtype f32|f16|bf16|fp8] [--threads N] [--backend cpu|cuda] [--speculative ngram|off]";

fn ids(s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|e| format!("bad token id {t:?}: {e}"))
        })
        .collect()
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.parse().map_err(|e| format!("{flag} {v:?}: {e}"))
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        model: PathBuf::new(),
        mode: Mode::Ids,
        prompts: Vec::new(),
        stops: Vec::new(),
        max_new: 0,
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
        stop_ids: Vec::new(),
        page_size: 16,
        kv_dtype: KvDtype::F16,
        threads: None,
        cuda: false,
        speculative: None,
    };
    let mut have_model = false;
    let mut have_max_new = false;
    let mut texts = Vec::new();
    let mut chat = None;
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => {
                a.model = PathBuf::from(v);
                have_model = true;
            }
            "--prompt-ids" => a.prompts.push(ids(&v)?),
            "--prompt" => texts.push(v),
            "--chat" => {
                if chat.replace(v).is_some() {
                    return Err("--chat is given once (one conversation turn)".into());
                }
            }
            "--stop" => {
                if v.is_empty() {
                    return Err("--stop needs a non-empty string".into());
                }
                a.stops.push(v)
            }
            "--max-new-tokens" => {
                a.max_new = num(&flag, &v)?;
                have_max_new = true;
            }
            "--temperature" => a.temperature = num(&flag, &v)?,
            "--top-k" => a.top_k = Some(num(&flag, &v)?),
            "--top-p" => a.top_p = Some(num(&flag, &v)?),
            "--seed" => a.seed = num(&flag, &v)?,
            "--stop-ids" => a.stop_ids = ids(&v)?,
            "--page-size" => a.page_size = num(&flag, &v)?,
            "--kv-dtype" => {
                a.kv_dtype =
                    KvDtype::parse(&v).ok_or(format!("--kv-dtype {v:?}: f32, f16, bf16 or fp8"))?
            }
            "--threads" => a.threads = Some(num(&flag, &v)?),
            "--speculative" => {
                a.speculative = match v.as_str() {
                    "ngram" => Some(SpecConfig::ngram()),
                    "off" => None,
                    _ => return Err(format!("--speculative {v:?}: ngram or off")),
                }
            }
            "--backend" => {
                a.cuda = match v.as_str() {
                    "cpu" => false,
                    "cuda" => true,
                    _ => return Err(format!("--backend {v:?}: cpu or cuda")),
                }
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    let modes = usize::from(!a.prompts.is_empty())
        + usize::from(!texts.is_empty())
        + usize::from(chat.is_some());
    if modes > 1 {
        return Err("give prompts one way: --prompt-ids, --prompt or --chat".into());
    }
    if !texts.is_empty() {
        a.mode = Mode::Text(texts);
    } else if let Some(c) = chat {
        a.mode = Mode::Chat(c);
    }
    // Text ends at the model's EOS; ids need a count.
    if !have_max_new && a.mode != Mode::Ids {
        a.max_new = TEXT_MAX_NEW;
    }
    if !have_model || modes == 0 || a.max_new == 0 {
        return Err(
            "--model, a prompt (--prompt-ids, --prompt or --chat) and --max-new-tokens > 0 are required"
                .into(),
        );
    }
    if a.mode == Mode::Ids && !a.stops.is_empty() {
        return Err(
            "--stop applies to text (--prompt or --chat); use --stop-ids with --prompt-ids".into(),
        );
    }
    if a.cuda && a.threads.is_some() {
        return Err("--threads sets the CPU backend's threads; --backend cuda has none".into());
    }
    if !a.page_size.is_power_of_two() {
        return Err(format!(
            "--page-size {}: a power of two is required",
            a.page_size
        ));
    }
    for p in &a.prompts {
        tokens_needed(p, a.max_new)?;
    }
    Ok(a)
}

/// Prompt plus new tokens, or a usage error when that does not fit a `usize`.
fn tokens_needed(prompt: &[u32], max_new: usize) -> Result<usize, String> {
    prompt.len().checked_add(max_new).ok_or(format!(
        "--max-new-tokens {max_new} with a prompt of {} tokens is more tokens than can be counted",
        prompt.len()
    ))
}

/// `n` rounded up to whole pages, or a usage error on overflow.
fn whole_pages(n: usize, page: usize) -> Result<usize, String> {
    n.checked_next_multiple_of(page)
        .ok_or(format!("{n} tokens in pages of {page} overflow"))
}

/// The KV sizing that runs every prompt at once: `(max_context, page,
/// pool_tokens)`. The window covers the longest request, capped at the
/// model's `max_seq_len`; the pool holds every request (each capped at the
/// window: longer ones are rejected at submit) and at least twice the
/// window, in whole pages, as [`EngineConfig`] requires.
fn sizing(args: &Args, model_max: usize) -> Result<(usize, usize, usize), String> {
    let page = args.page_size;
    let mut need = 1;
    for p in &args.prompts {
        need = need.max(tokens_needed(p, args.max_new)?);
    }
    let max_context = whole_pages(need, page)?.min(model_max);
    let page = page.min(prev_power_of_two(max_context));
    let mut all = 0usize;
    for p in &args.prompts {
        let one = whole_pages(tokens_needed(p, args.max_new)?.min(max_context), page)?;
        all = all
            .checked_add(one)
            .ok_or("the prompts together need more tokens than can be counted")?;
    }
    let window2 = max_context
        .checked_mul(2)
        .ok_or("twice the context window overflows")?;
    Ok((max_context, page, whole_pages(all.max(window2), page)?))
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<ExitCode, String> {
    let args = parse(std::env::args().skip(1))?;
    if args.cuda {
        let gpu = on_gpu::open("generate")?;
        return generate(on_gpu::backend(&gpu), on_gpu::describe(&gpu), args);
    }
    let backend = match args.threads {
        Some(n) => CpuBackend::with_threads(n),
        None => CpuBackend::new(),
    };
    let on = format!("{} threads", backend.threads());
    generate(backend, on, args)
}

/// Loads the model on `backend` (described as `on` in the log) and serves
/// every prompt at once.
fn generate<B: Backend>(backend: B, on: String, args: Args) -> Result<ExitCode, String> {
    let mut err = std::io::stderr();
    let t_load = Instant::now();
    // Placed as it is read: a bf16 checkpoint never sits in memory in f32.
    let model =
        Model::load(backend, &args.model).map_err(|e| format!("{}: {e}", args.model.display()))?;
    let mc = model.config().clone();
    let text = match &args.mode {
        Mode::Ids => None,
        _ => Some(
            TextModel::load(&args.model).map_err(|e| format!("{}: {e}", args.model.display()))?,
        ),
    };
    let mut args = args;
    let mut stop_ids = args.stop_ids.clone();
    if let Some(text) = &text {
        args.prompts = match &args.mode {
            Mode::Text(texts) => texts
                .iter()
                .map(|t| text.tokenizer().encode(t))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("--prompt: {e}"))?,
            Mode::Chat(turn) => vec![
                text.render_chat(&[Message::new("user", turn.as_str())])
                    .map_err(|e| format!("--chat: {e}"))?
                    .1,
            ],
            Mode::Ids => Vec::new(),
        };
        for p in &args.prompts {
            tokens_needed(p, args.max_new)?;
        }
        for &id in text.stop_ids() {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
    }
    let _ = writeln!(
        err,
        "loaded {} in {:.2?}: dim {}, {} layers, {} heads / {} KV heads, vocab {}, {:.1} MB of weights, on {}",
        args.model.display(),
        t_load.elapsed(),
        mc.dim,
        mc.n_layers,
        mc.n_heads,
        mc.n_kv_heads,
        mc.vocab_size,
        model.weight_bytes() as f64 / 1e6,
        on
    );

    // Size the deployment so that every prompt runs at once.
    let (max_context, page, pool_tokens) = sizing(&args, mc.max_seq_len)?;
    let cfg = EngineConfig::colocated(model.kv_geometry(args.kv_dtype))
        .max_context(max_context)
        .page_size(page)
        .pool_tokens(pool_tokens)
        .build()
        .map_err(|e| e.to_string())?;
    let opts = EngineOptions {
        speculative: args.speculative,
        ..EngineOptions::default()
    };
    let mut engine = Engine::with_options(model, cfg, opts).map_err(|e| e.to_string())?;

    let t0 = Instant::now();
    let mut handles = Vec::new();
    let mut rejected = Vec::new();
    for (i, prompt) in args.prompts.iter().enumerate() {
        let sampling = SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed.wrapping_add(i as u64),
            stop_ids: stop_ids.clone(),
            logprobs: None,
        };
        let req = Request::new(
            RequestId(i as u64),
            TenantId(0),
            prompt.clone(),
            args.max_new,
        )
        .with_sampling(sampling);
        match engine.submit(req) {
            Ok(h) => handles.push(h),
            Err(r) => rejected.push(format!(
                "prompt {i}: rejected ({}): {r}",
                handoff::HttpStatus::http_status(&r)
            )),
        }
    }
    // A prompt the engine refuses (a token outside the vocabulary, more
    // tokens than the model's window) is a bad argument: say why and print
    // no lines rather than a blank line that reads like an empty generation.
    if !rejected.is_empty() {
        return Err(rejected.join("\n"));
    }
    let mut failed = false;

    let n = handles.len();
    // Text output: one sink per prompt; --chat streams its one sink to stdout.
    let streaming = matches!(args.mode, Mode::Chat(_));
    let mut sinks: Vec<Option<TextSink>> = match &text {
        Some(text) => args
            .prompts
            .iter()
            .map(|p| TextSink::new(text.tokenizer(), p, &args.stops, &stop_ids).map(Some))
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut first: Vec<Option<Duration>> = vec![None; n];
    let mut outcome: Vec<Option<Outcome>> = vec![None; n];
    let mut steps = 0usize;
    while !engine.is_idle() {
        steps += 1;
        if !engine.step().progressed() {
            break;
        }
        for (i, h) in handles.iter().enumerate() {
            for ev in h.events().try_iter() {
                match ev {
                    Event::Token(t) => {
                        first[i].get_or_insert_with(|| t0.elapsed());
                        tokens[i].push(t);
                        if let Some(Some(sink)) = sinks.get_mut(i) {
                            let more = sink.token(t, streaming);
                            if !more {
                                // A stop string or an undecodable id: end it here.
                                engine.cancel(h.id());
                            }
                        }
                    }
                    Event::Logprobs(_) => {}
                    Event::Done(o) => outcome[i] = Some(o),
                }
            }
        }
    }
    let elapsed = t0.elapsed();

    let mut out = std::io::stdout().lock();
    for (i, toks) in tokens.iter().enumerate() {
        let mut ended_by_us = false;
        if let Some(sink) = sinks.get_mut(i).and_then(Option::take) {
            let (text, error, stopped) = sink.finish(streaming);
            if streaming {
                writeln!(out).map_err(|e| e.to_string())?;
            } else {
                writeln!(out, "{text}").map_err(|e| e.to_string())?;
            }
            if let Some(e) = error {
                let _ = writeln!(err, "prompt {i}: {e}");
                failed = true;
            }
            ended_by_us = stopped;
        } else {
            let line: Vec<String> = toks.iter().map(u32::to_string).collect();
            writeln!(out, "{}", line.join(" ")).map_err(|e| e.to_string())?;
        }
        let finished = matches!(outcome[i], Some(Outcome::Finished(_)))
            || (ended_by_us && matches!(outcome[i], Some(Outcome::Cancelled)));
        if !finished {
            let _ = writeln!(err, "prompt {i}: ended with {:?}", outcome[i]);
            failed = true;
        }
    }
    let generated: usize = tokens.iter().map(Vec::len).sum();
    if args.speculative.is_some() {
        let t = engine.tally();
        let _ = writeln!(
            err,
            "speculative: {} drafted, {} accepted ({:.1}% acceptance)",
            t.drafted,
            t.accepted,
            100.0 * t.accepted as f64 / (t.drafted as f64).max(1.0)
        );
    }
    let ttfts: Vec<Duration> = first.iter().flatten().copied().collect();
    let _ = writeln!(
        err,
        "{} prompts, {generated} tokens in {elapsed:.2?} ({steps} steps): {:.1} tokens/s; \
         time to first token: min {:.2?}, max {:.2?}",
        n,
        generated as f64 / elapsed.as_secs_f64().max(1e-9),
        ttfts.iter().min().copied().unwrap_or_default(),
        ttfts.iter().max().copied().unwrap_or_default(),
    );
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn prev_power_of_two(n: usize) -> usize {
    if n == 0 {
        1
    } else {
        1 << (usize::BITS - 1 - n.leading_zeros())
    }
}

/// One prompt's generated text: ids are detokenized as they arrive (whole
/// characters only), stop ids end it unprinted, and user stop strings are
/// held back until they are ruled out or matched (then never printed).
struct TextSink<'t> {
    decoder: StreamDecoder<'t>,
    stop: StopMatcher,
    stop_ids: Vec<u32>,
    /// Text so far (when not streaming to stdout).
    text: String,
    /// Ended by a stop id or a stop string: later tokens are ignored.
    done: bool,
    /// Ended by a stop string: the request was cancelled on purpose.
    stopped: bool,
    error: Option<String>,
}

impl<'t> TextSink<'t> {
    fn new(
        tokenizer: &'t Tokenizer,
        prompt: &[u32],
        stops: &[String],
        stop_ids: &[u32],
    ) -> Result<Self, String> {
        Ok(TextSink {
            decoder: StreamDecoder::after(tokenizer, prompt, true),
            stop: StopMatcher::new(stops.iter().cloned()).map_err(|e| e.to_string())?,
            stop_ids: stop_ids.to_vec(),
            text: String::new(),
            done: false,
            stopped: false,
            error: None,
        })
    }

    /// Streams `chunk` to stdout, or keeps it in `text`.
    fn emit(text: &mut String, chunk: &str, streaming: bool) {
        if chunk.is_empty() {
            return;
        }
        if streaming {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(chunk.as_bytes());
            let _ = out.flush();
        } else {
            text.push_str(chunk);
        }
    }

    /// Takes one generated id; false when generation should end here.
    fn token(&mut self, id: u32, streaming: bool) -> bool {
        if self.done {
            return false;
        }
        if self.stop_ids.contains(&id) {
            self.done = true;
            return true; // the engine ends the request itself
        }
        match self.decoder.push(id) {
            Ok(None) => true,
            Ok(Some(chunk)) => {
                let step = self.stop.push(&chunk);
                Self::emit(&mut self.text, &step.text, streaming);
                if step.stopped.is_some() {
                    self.done = true;
                    self.stopped = true;
                    return false;
                }
                true
            }
            Err(e) => {
                self.error = Some(e.to_string());
                self.done = true;
                false
            }
        }
    }

    /// Releases what is held (no stop matched); returns the whole text,
    /// the error that ended it (if any), and whether a stop string did.
    fn finish(self, streaming: bool) -> (String, Option<String>, bool) {
        let TextSink {
            decoder,
            mut stop,
            mut text,
            mut error,
            stopped,
            ..
        } = self;
        if !stopped && error.is_none() {
            match decoder.finish() {
                Ok(tail) => {
                    let step = stop.push(&tail);
                    Self::emit(&mut text, &step.text, streaming);
                    if step.stopped.is_none() {
                        Self::emit(&mut text, &stop.finish(), streaming);
                    }
                }
                Err(e) => error = Some(e.to_string()),
            }
        }
        (text, error, stopped)
    }
}
