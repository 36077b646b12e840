"""Drives handoff-server with the official `openai` Python client.

Usage: drive.py BASE_URL API_KEY MODEL OVER_WINDOW_TOKENS

Runs each story the Rust test (openai_server_python.rs) asserts on and prints
one JSON object on stdout with what the client saw; it asserts nothing
itself, so a wrong answer shows up as a failed assertion in the test, with
the values. Exceptions the client raises are recorded by class name, HTTP
status and error code.
"""

import concurrent.futures
import json
import sys

import openai


def error_of(e):
    body = getattr(e, "body", None)
    code = body.get("code") if isinstance(body, dict) else None
    return {
        "class": type(e).__name__,
        "status": getattr(e, "status_code", None),
        "code": code,
    }


def attempt(f):
    try:
        return {"ok": f()}
    except openai.APIError as e:
        return {"error": error_of(e)}


def main():
    base_url, key, model, over = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    ids = {"return_token_ids": True}
    out = {}

    out["models"] = [m.id for m in client.models.list().data]

    def chat():
        r = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=12, temperature=0, extra_body=ids
        )
        c = r.choices[0]
        return {
            "content": c.message.content,
            "role": c.message.role,
            "finish_reason": c.finish_reason,
            "token_ids": c.model_extra.get("token_ids"),
            "usage": r.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}),
            "object": r.object,
        }

    out["chat"] = attempt(chat)

    def chat_stream():
        s = client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=ids,
        )
        content, tokens, finish, usage, roles = "", [], None, None, []
        for chunk in s:
            if chunk.usage is not None:
                usage = chunk.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
            for c in chunk.choices:
                if c.delta.role:
                    roles.append(c.delta.role)
                content += c.delta.content or ""
                tokens += (c.model_extra or {}).get("token_ids") or []
                if c.finish_reason:
                    finish = c.finish_reason
        return {"content": content, "token_ids": tokens, "finish_reason": finish, "usage": usage, "roles": roles}

    out["chat_stream"] = attempt(chat_stream)

    def completion():
        r = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=10, temperature=0, extra_body=ids
        )
        c = r.choices[0]
        return {"text": c.text, "finish_reason": c.finish_reason, "token_ids": c.model_extra.get("token_ids"),
                "usage": r.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})}

    out["completion"] = attempt(completion)

    def completion_stream():
        s = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True, extra_body=ids
        )
        text, tokens, finish = "", [], None
        for chunk in s:
            for c in chunk.choices:
                text += c.text
                tokens += (c.model_extra or {}).get("token_ids") or []
                if c.finish_reason:
                    finish = c.finish_reason
        return {"text": text, "token_ids": tokens, "finish_reason": finish}

    out["completion_stream"] = attempt(completion_stream)

    def seeded(seed):
        r = client.completions.create(
            model=model, prompt="abc", max_tokens=8, temperature=1.0, top_p=0.9, seed=seed, extra_body=ids
        )
        return r.choices[0].model_extra.get("token_ids")

    out["seeded"] = [attempt(lambda: seeded(7)), attempt(lambda: seeded(7))]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        out["concurrent"] = list(pool.map(lambda _: attempt(chat_stream), range(8)))

    out["over_window"] = attempt(
        lambda: client.completions.create(model=model, prompt=[5] * over, max_tokens=4).choices[0].text
    )
    out["n2"] = attempt(
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=4, n=2).choices[0].text
    )
    out["unknown_model"] = attempt(
        lambda: client.completions.create(model="no-such-model", prompt="hi", max_tokens=4).choices[0].text
    )
    stranger = openai.OpenAI(base_url=base_url, api_key="not-a-key", max_retries=0, timeout=30)
    out["bad_key"] = attempt(lambda: [m.id for m in stranger.models.list().data])

    print(json.dumps(out))


if __name__ == "__main__":
    main()
