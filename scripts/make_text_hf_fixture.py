#!/usr/bin/env python3
"""Makes tests/fixtures/text/hf_tiny/: a small Hugging Face tokenizer folder
(tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json) and expected.json, the ids Python's `tokenizers`
gives for some texts with add_special_tokens=True (its post-processor adds
<s>).

    /tmp/tokvenv/bin/pip install tokenizers
    /tmp/tokvenv/bin/python scripts/make_text_hf_fixture.py tests/fixtures/text/hf_tiny
"""

import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, hello again.",
    "Streaming text one token at a time: café, naïve, 日本語, 🙂.",
    "def add(a, b):\n    return a + b\n",
] * 20

TEXTS = [
    "Hello world",
    "the lazy fox, again",
    "<|user|>hi<|end|>",
    "café 🙂 日本",
    "",
]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # 128 ids, as many as the random-weights fixture model's vocabulary
        # (tests/fixtures/hf_tiny_llama), so the two make a servable folder.
        # The alphabet is the corpus's bytes: the texts use no others.
        vocab_size=128,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(os.path.join(out, "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}, f, indent=1
        )
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.token_to_id("</s>"), tok.token_to_id("<|end|>")]}, f, indent=1)
    expected = {
        "source": "Python tokenizers " + __import__("tokenizers").__version__ + ", add_special_tokens=True",
        "texts": [{"text": t, "ids": tok.encode(t).ids} for t in TEXTS],
        "eos_ids": [tok.token_to_id("</s>"), tok.token_to_id("<|end|>")],
        "bos_id": tok.token_to_id("<s>"),
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
