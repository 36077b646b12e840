//! [`TextModel`]: everything a model ships for text in and out, loaded from
//! the same path as its weights.

use std::path::Path;

use super::{ChatTemplate, Message, TextError, Tokenizer, TokenizerMetadata};

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
        if path.is_dir() {
            return Self::from_hf_dir(path);
        }
        Self::from_file(path)
    }

    /// The text side of a Hugging Face model folder.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TextError> {
        let tokenizer = Tokenizer::from_hf_dir(dir)?;
        let config = super::hf::tokenizer_config(dir)?;
        let chat = match config.and_then(|c| c.chat_template) {
            Some(source) => Some(ChatTemplate::for_tokenizer(&source, &tokenizer)?),
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
        let tokenizer = Tokenizer::from_metadata(meta)?;
        let chat = match &meta.chat_template {
            Some(source) => Some(ChatTemplate::for_tokenizer(source, &tokenizer)?),
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
    fn from_file(path: &Path) -> Result<Self, TextError> {
        let mut magic = [0u8; 4];
        let is_gguf = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .map(|()| &magic == b"GGUF");
        match is_gguf {
            Ok(true) => {
                let file = crate::format::gguf::GgufFile::open(path)?;
                Self::from_metadata(&TokenizerMetadata::from_gguf(&file)?)
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
    /// (nothing added: the template writes its own special tokens).
    pub fn render_chat(&self, messages: &[Message]) -> Result<(String, Vec<u32>), TextError> {
        let text = self.chat_template()?.render(messages, true)?;
        let ids = self.tokenizer.encode_plain(&text)?;
        Ok((text, ids))
    }

    /// The ids that end a generation (EOS, end of turn), each once.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }
}
