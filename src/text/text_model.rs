//! [`TextModel`]: everything a model ships for text in and out, loaded from
//! the same path as its weights.

use std::path::Path;

use super::{ChatTemplate, Message, TemplateLimits, TextError, Tokenizer, TokenizerMetadata};

/// The first of the private-use characters that stand in for special-token
/// text found in message content while the template renders (plane 15,
/// which no tokenizer gives a meaning to).
const STAND_IN: u32 = 0xF_0000;
/// How many distinct special-token texts one conversation can have stand-ins for.
const STAND_INS: u32 = 0xFFFE;

/// The private-use character that stands in for `forged[k]`.
fn stand_in(k: usize) -> char {
    char::from_u32(STAND_IN + k as u32).unwrap_or('\u{FFFD}')
}

/// `field` with each of `forged` (longest first) replaced by its stand-in.
fn stand_ins(field: &str, forged: &[String]) -> String {
    let mut c = field.to_string();
    for (k, special) in forged.iter().enumerate() {
        if c.contains(special.as_str()) {
            c = c.replace(special.as_str(), &stand_in(k).to_string());
        }
    }
    c
}

/// The longest piece (two characters or more, short of the whole) of
/// `special` that `field` ends with as its start, and the longest it begins
/// with as its end, whitespace aside: what a neighbour could complete.
fn edge_pieces<'a>(field: &str, special: &'a str) -> impl Iterator<Item = &'a str> {
    let (head, tail) = (field.trim_end(), field.trim_start());
    let cuts: Vec<usize> = special
        .char_indices()
        .map(|(i, _)| i)
        .filter(|&i| i > 0)
        .collect();
    let min = |piece: &str| piece.chars().count() >= 2;
    let start = cuts
        .iter()
        .rev()
        .map(|&i| &special[..i])
        .find(|p| min(p) && head.ends_with(*p));
    let end = cuts
        .iter()
        .map(|&i| &special[i..])
        .find(|p| min(p) && tail.starts_with(*p));
    start.into_iter().chain(end)
}

/// How a chat's message content is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContentTokens {
    /// As text: special-token text in a message (`<|im_end|>`) encodes as
    /// the pieces of its characters; only the template's own text yields
    /// control tokens. The default: a user cannot forge another role's turn.
    #[default]
    Text,
    /// Special-token text in messages encodes as the control token, as the
    /// rendered prompt's text reads (a deployment whose clients are trusted
    /// to write control tokens).
    Special,
}

/// A model's tokenizer, its chat template (if it ships one) and the ids that
/// end a generation: EOS, the template's end-of-turn token, and any other
/// end id the model's files name.
#[derive(Debug)]
pub struct TextModel {
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
    /// Where the chat template was looked for, for the refusal message.
    chat_source: String,
    stop_ids: Vec<u32>,
}

impl TextModel {
    /// The text side of the model at `path`: a Hugging Face folder
    /// (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`)
    /// or a `.gguf` file (its `tokenizer.*` metadata).
    pub fn load(path: &Path) -> Result<Self, TextError> {
        Self::load_with_limits(path, TemplateLimits::default())
    }

    /// [`load`](Self::load), its chat template bounded by `limits` (a
    /// template that exceeds them on the probe conversations is refused).
    pub fn load_with_limits(path: &Path, limits: TemplateLimits) -> Result<Self, TextError> {
        if path.is_dir() {
            return Self::from_hf_dir_with_limits(path, limits);
        }
        Self::from_file(path, limits)
    }

    /// The text side of a Hugging Face model folder.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TextError> {
        Self::from_hf_dir_with_limits(dir, TemplateLimits::default())
    }

    fn from_hf_dir_with_limits(dir: &Path, limits: TemplateLimits) -> Result<Self, TextError> {
        let tokenizer = Tokenizer::from_hf_dir(dir)?;
        let config = super::hf::tokenizer_config(dir)?;
        let chat = match config.and_then(|c| c.chat_template) {
            Some(source) => Some(ChatTemplate::for_tokenizer_with_limits(
                &source, &tokenizer, limits,
            )?),
            None => None,
        };
        let extra = super::hf::generation_eos_ids(dir)?;
        Ok(Self::assemble(
            tokenizer,
            chat,
            format!("{}/tokenizer_config.json", dir.display()),
            extra,
        ))
    }

    /// The text side described by GGUF tokenizer metadata.
    pub fn from_metadata(meta: &TokenizerMetadata) -> Result<Self, TextError> {
        Self::from_metadata_with_limits(meta, TemplateLimits::default())
    }

    /// [`from_metadata`](Self::from_metadata), its chat template bounded by `limits`.
    pub fn from_metadata_with_limits(
        meta: &TokenizerMetadata,
        limits: TemplateLimits,
    ) -> Result<Self, TextError> {
        let tokenizer = Tokenizer::from_metadata(meta)?;
        let chat = match &meta.chat_template {
            Some(source) => Some(ChatTemplate::for_tokenizer_with_limits(
                source, &tokenizer, limits,
            )?),
            None => None,
        };
        Ok(Self::assemble(
            tokenizer,
            chat,
            "GGUF metadata tokenizer.chat_template".into(),
            Vec::new(),
        ))
    }

    /// A GGUF file (told by its magic, not its name) carries its tokenizer;
    /// any other file (a llama2.c `.bin`) has none.
    fn from_file(path: &Path, limits: TemplateLimits) -> Result<Self, TextError> {
        let mut magic = [0u8; 4];
        let is_gguf = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .map(|()| &magic == b"GGUF");
        match is_gguf {
            Ok(true) => {
                let file = crate::format::gguf::GgufFile::open(path)?;
                Self::from_metadata_with_limits(&TokenizerMetadata::from_gguf(&file)?, limits)
            }
            Ok(false) => Err(TextError::NoTokenizer {
                path: path.display().to_string(),
            }),
            Err(source) => Err(TextError::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    fn assemble(
        tokenizer: Tokenizer,
        chat: Option<ChatTemplate>,
        chat_source: String,
        extra: Vec<u32>,
    ) -> Self {
        let turn_end = chat.as_ref().and_then(|c| c.end_of_turn(&tokenizer));
        let mut stop_ids = Vec::new();
        for id in [tokenizer.eos(), tokenizer.eot(), turn_end]
            .into_iter()
            .flatten()
            .chain(extra)
        {
            if !stop_ids.contains(&id) && tokenizer.id_to_token(id).is_some() {
                stop_ids.push(id);
            }
        }
        TextModel {
            tokenizer,
            chat,
            chat_source,
            stop_ids,
        }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model's chat template, or `NoChatTemplate` (400) when it ships none.
    pub fn chat_template(&self) -> Result<&ChatTemplate, TextError> {
        self.chat.as_ref().ok_or_else(|| TextError::NoChatTemplate {
            source_name: self.chat_source.clone(),
        })
    }

    /// `messages` rendered with the generation prompt, and its token ids
    /// (nothing added: the template writes its own special tokens). Message
    /// content is encoded as text ([`ContentTokens::Text`]).
    pub fn render_chat(&self, messages: &[Message]) -> Result<(String, Vec<u32>), TextError> {
        self.render_chat_with(messages, ContentTokens::Text)
    }

    /// [`render_chat`](Self::render_chat), with message content encoded as
    /// `content` says.
    ///
    /// With [`ContentTokens::Text`], each special-token text found in a
    /// message (its content or its role), and each piece of one that a
    /// content or role begins or ends with (which a neighbour in the
    /// rendered prompt could complete), is replaced, while the template
    /// renders, by a private-use character standing in for it; the rendered prompt is then encoded
    /// piece by piece: the template's text with special tokens parsed, each
    /// stand-in as its text with no special token parsed. The returned
    /// text is the prompt as the template rendered the real messages.
    pub fn render_chat_with(
        &self,
        messages: &[Message],
        content: ContentTokens,
    ) -> Result<(String, Vec<u32>), TextError> {
        let template = self.chat_template()?;
        let forged: Vec<String> = match content {
            ContentTokens::Special => Vec::new(),
            ContentTokens::Text => self.specials_in(messages),
        };
        if forged.is_empty() {
            let text = template.render(messages, true)?;
            let ids = self.tokenizer.encode_plain(&text)?;
            return Ok((text, ids));
        }
        let masked: Vec<Message> = messages
            .iter()
            .map(|m| Message::new(stand_ins(&m.role, &forged), stand_ins(&m.content, &forged)))
            .collect();
        let rendered = template.render(&masked, true)?;
        let mut text = String::with_capacity(rendered.len());
        let mut ids = Vec::new();
        let mut piece = String::new();
        for ch in rendered.chars() {
            let k = (ch as u32).wrapping_sub(STAND_IN) as usize;
            match forged.get(k) {
                Some(special) => {
                    ids.extend(self.tokenizer.encode_plain(&piece)?);
                    text.push_str(&piece);
                    piece.clear();
                    ids.extend(self.tokenizer.encode_text(special)?);
                    text.push_str(special);
                }
                None => piece.push(ch),
            }
        }
        ids.extend(self.tokenizer.encode_plain(&piece)?);
        text.push_str(&piece);
        Ok((text, ids))
    }

    /// The special-token texts that occur in any message's content or role,
    /// and the pieces of special-token text a content or role begins or ends
    /// with (`<|im_` at the end of one message and `end|>` at the start of
    /// the next would make `<|im_end|>` wherever the template puts them side
    /// by side); longest first, so a token whose text holds another's is
    /// replaced whole.
    fn specials_in(&self, messages: &[Message]) -> Vec<String> {
        let specials: Vec<String> = self
            .tokenizer
            .special_tokens()
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| !t.is_empty())
            .collect();
        let fields = || {
            messages
                .iter()
                .flat_map(|m| [m.role.as_str(), m.content.as_str()])
        };
        let mut found: Vec<String> = Vec::new();
        for t in &specials {
            for field in fields() {
                if field.contains(t.as_str()) {
                    found.push(t.clone());
                }
                found.extend(edge_pieces(field, t).map(str::to_string));
            }
        }
        found.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        found.dedup();
        found.truncate(STAND_INS as usize);
        found
    }

    /// The ids that end a generation (EOS, end of turn), each once.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }
}
