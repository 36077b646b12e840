//! [`ChatTemplate`]: a conversation rendered to the prompt text the model
//! was trained on, by the model's own Jinja template.

use std::sync::Arc;
use std::time::Duration;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};

use super::{TextError, Tokenizer};

/// Name of the one template in the environment.
const NAME: &str = "chat";

/// Marks an error raised by the template's own `raise_exception`.
const REFUSAL: &str = "raise_exception: ";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant`, or whatever roles the template knows.
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// The bounds every render of a chat template runs under. A template is
/// code from the model file: these keep a hostile or broken one from
/// hanging or exhausting the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateLimits {
    /// minijinja's fuel: about one per instruction executed and one per 64
    /// bytes of data the template creates, so it bounds both the time and
    /// the memory of a render.
    pub fuel: u64,
    /// The rendered prompt's size at most, in bytes.
    pub max_output_bytes: usize,
    /// The wall-clock time a render may take; the caller gets its error
    /// when it passes, whatever the render is doing.
    pub deadline: Duration,
}

impl Default for TemplateLimits {
    /// One million fuel (a chat template needs a few thousand per message;
    /// it also caps a render's data near 64 MB), 8 MiB of prompt text, 2 s.
    fn default() -> Self {
        TemplateLimits {
            fuel: 1_000_000,
            max_output_bytes: 8 << 20,
            deadline: Duration::from_secs(2),
        }
    }
}

/// Which of [`TemplateLimits`] a render ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateLimit {
    /// The fuel budget ([`TemplateLimits::fuel`]).
    Fuel(u64),
    /// The output cap, in bytes ([`TemplateLimits::max_output_bytes`]).
    OutputBytes(usize),
    /// The deadline ([`TemplateLimits::deadline`]).
    Deadline(Duration),
}

impl std::fmt::Display for TemplateLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateLimit::Fuel(n) => write!(f, "fuel budget of {n}"),
            TemplateLimit::OutputBytes(n) => write!(f, "output cap of {n} bytes"),
            TemplateLimit::Deadline(d) => write!(f, "deadline of {} ms", d.as_millis()),
        }
    }
}

/// A model's chat template, compiled once. Rendering follows Hugging Face's
/// `apply_chat_template`: Jinja with `trim_blocks` and `lstrip_blocks`, the
/// globals `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
/// `raise_exception(msg)` and `strftime_now(fmt)`, and Python's string
/// methods (`.strip()`, `.startswith()`...).
///
/// Every render runs under [`TemplateLimits`]; a template that exceeds
/// them on a probe conversation is refused when it is loaded
/// ([`TextError::TemplateLimit`]), and one that exceeds them later fails
/// only the render that did.
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    limits: TemplateLimits,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{REFUSAL}{message}"),
    ))
}

/// The current UTC time in `format` (the `%` codes templates use for a
/// date line: `%d %b %Y`, `%Y-%m-%d`, `%H:%M`...).
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime(secs, &format)))
}

/// `format` for the UTC time `secs` after the epoch.
pub(crate) fn strftime(secs: u64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn render_error(e: Error) -> TextError {
    match e.detail().and_then(|d| d.strip_prefix(REFUSAL)) {
        Some(message) if e.kind() == ErrorKind::InvalidOperation => TextError::TemplateRefused {
            message: message.to_string(),
        },
        _ => TextError::TemplateRender {
            reason: format!("{e:#}"),
        },
    }
}

impl ChatTemplate {
    /// Compiles `source` (the model's `chat_template`); `bos_token` and
    /// `eos_token` are the texts the template sees under those names.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, TextError> {
        Self::with_limits(source, bos_token, eos_token, TemplateLimits::default())
    }

    /// [`new`](Self::new) under `limits`. The template renders probe
    /// conversations before it is accepted: one that exceeds a limit there
    /// is refused with [`TextError::TemplateLimit`] naming it.
    pub fn with_limits(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        limits: TemplateLimits,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_fuel(Some(limits.fuel));
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TextError::TemplateSyntax {
                reason: e.to_string(),
            })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_global("bos_token", Value::from(bos_token.unwrap_or("")));
        env.add_global("eos_token", Value::from(eos_token.unwrap_or("")));
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| TextError::TemplateSyntax {
                reason: format!("{e:#}"),
            })?;
        let template = ChatTemplate {
            env: Arc::new(env),
            limits,
        };
        template.probe()?;
        Ok(template)
    }

    /// Renders the probe conversations a template must handle at load;
    /// only a limit is an error here (a template may refuse a probe, for
    /// instance a system turn, with its own `raise_exception`).
    fn probe(&self) -> Result<(), TextError> {
        let system = Message::new("system", "You are a helpful assistant.");
        let user = Message::new("user", "What is the capital of France?");
        let answer = Message::new("assistant", "Paris.");
        let again = Message::new("user", "And of Italy?");
        let probes: [&[Message]; 2] = [
            &[system, user.clone(), answer.clone(), again.clone()],
            &[user, answer, again],
        ];
        for probe in probes {
            for generation_prompt in [true, false] {
                if let Err(TextError::TemplateLimit { limit, .. }) =
                    self.render(probe, generation_prompt)
                {
                    return Err(TextError::TemplateLimit {
                        limit,
                        at_load: true,
                    });
                }
            }
        }
        Ok(())
    }

    /// The bounds this template renders under.
    pub fn limits(&self) -> TemplateLimits {
        self.limits
    }

    /// The template a tokenizer's model ships, with its BOS/EOS texts.
    pub fn for_tokenizer(source: &str, tokenizer: &Tokenizer) -> Result<Self, TextError> {
        Self::for_tokenizer_with_limits(source, tokenizer, TemplateLimits::default())
    }

    /// [`for_tokenizer`](Self::for_tokenizer) under `limits`.
    pub fn for_tokenizer_with_limits(
        source: &str,
        tokenizer: &Tokenizer,
        limits: TemplateLimits,
    ) -> Result<Self, TextError> {
        Self::with_limits(
            source,
            tokenizer.bos_token().as_deref(),
            tokenizer.eos_token().as_deref(),
            limits,
        )
    }

    /// The prompt text for `messages`; with `add_generation_prompt`, ending
    /// where the assistant's answer begins. A conversation the template
    /// refuses (its `raise_exception`) is `TemplateRefused` (400); one on
    /// which it exceeds a [`TemplateLimits`] bound is `TemplateLimit`
    /// (500), returned by the deadline at the latest: the render goes on
    /// on its own thread until its fuel ends, and its result is dropped.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let ctx = context(messages, add_generation_prompt);
        let env = self.env.clone();
        let limits = self.limits;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("chat-template".into())
            .spawn(move || {
                let _ = tx.send(render_bounded(&env, ctx, limits));
            })
            .map_err(|e| TextError::TemplateRender {
                reason: format!("no thread to render on: {e}"),
            })?;
        let over = |limit| TextError::TemplateLimit {
            limit,
            at_load: false,
        };
        match rx.recv_timeout(limits.deadline) {
            Ok(rendered) => rendered,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                Err(over(TemplateLimit::Deadline(limits.deadline)))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err(TextError::TemplateRender {
                    reason: "the render stopped without a result".into(),
                })
            }
        }
    }

    /// The token that ends an assistant turn in this template (`<|im_end|>`
    /// for ChatML, `<|eot_id|>` for Llama 3), found by rendering a probe
    /// conversation and reading the first token after the assistant's text:
    /// `Some` only when that token is a special token.
    pub fn end_of_turn(&self, tokenizer: &Tokenizer) -> Option<u32> {
        const ANSWER: &str = "\u{E001}answer\u{E001}";
        let probe = [
            Message::new("user", "\u{E000}question"),
            Message::new("assistant", ANSWER),
        ];
        let text = self.render(&probe, false).ok()?;
        let after = &text[text.rfind(ANSWER)? + ANSWER.len()..];
        let first = *tokenizer.encode_plain(after).ok()?.first()?;
        tokenizer.is_special(first).then_some(first)
    }
}

/// The template's context: the conversation and the generation flag.
fn context(messages: &[Message], add_generation_prompt: bool) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| {
            Value::from_pairs([
                ("role", Value::from(m.role.as_str())),
                ("content", Value::from(m.content.as_str())),
            ])
        })
        .collect();
    Value::from_pairs([
        ("messages", Value::from(messages)),
        ("add_generation_prompt", Value::from(add_generation_prompt)),
    ])
}

/// Collects rendered text up to a cap; one byte more fails the write.
struct Capped {
    out: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other("over the output cap"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One render under `limits`' fuel and output cap (the deadline is the
/// caller's).
fn render_bounded(
    env: &Environment<'static>,
    ctx: Value,
    limits: TemplateLimits,
) -> Result<String, TextError> {
    let over = |limit| TextError::TemplateLimit {
        limit,
        at_load: false,
    };
    let template = env.get_template(NAME).map_err(render_error)?;
    let mut out = Capped {
        out: Vec::new(),
        cap: limits.max_output_bytes,
        over: false,
    };
    match template.render_captured_to(ctx, &mut out) {
        Ok(_) => String::from_utf8(out.out).map_err(|e| TextError::TemplateRender {
            reason: format!("the output is not UTF-8: {e}"),
        }),
        Err(_) if out.over => Err(over(TemplateLimit::OutputBytes(limits.max_output_bytes))),
        Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(over(TemplateLimit::Fuel(limits.fuel))),
        Err(e) => Err(render_error(e)),
    }
}
