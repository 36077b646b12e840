//! [`ChatTemplate`]: a conversation rendered to the prompt text the model
//! was trained on, by the model's own Jinja template.

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

/// A model's chat template, compiled once. Rendering follows Hugging Face's
/// `apply_chat_template`: Jinja with `trim_blocks` and `lstrip_blocks`, the
/// globals `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
/// `raise_exception(msg)` and `strftime_now(fmt)`, and Python's string
/// methods (`.strip()`, `.startswith()`...).
pub struct ChatTemplate {
    env: Environment<'static>,
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
        let mut env = Environment::new();
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
        Ok(ChatTemplate { env })
    }

    /// The template a tokenizer's model ships, with its BOS/EOS texts.
    pub fn for_tokenizer(source: &str, tokenizer: &Tokenizer) -> Result<Self, TextError> {
        Self::new(
            source,
            tokenizer.bos_token().as_deref(),
            tokenizer.eos_token().as_deref(),
        )
    }

    /// The prompt text for `messages`; with `add_generation_prompt`, ending
    /// where the assistant's answer begins. A conversation the template
    /// refuses (its `raise_exception`) is `TemplateRefused` (400).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let template = self.env.get_template(NAME).map_err(render_error)?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let ctx = Value::from_pairs([
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ]);
        template.render(ctx).map_err(render_error)
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
