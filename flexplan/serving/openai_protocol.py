"""OpenAI's request and response shapes, translated: a JSON body into a prompt and
:class:`SamplingParams`, engine outputs into completions, chat completions and their stream chunks,
and any refusal into OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

Rule: a field the engine cannot honour (n > 1, logprobs, penalties, echo, tools...) is refused
with a 400 naming it, never silently ignored (a client would get an answer it did not ask for).
Fields OpenAI lists that change nothing here (user, metadata, store...) are accepted.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from flexplan.errors import InvalidInputError
from flexplan.serving.types import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the context left)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # the roles OpenAI's API takes
# (field, the value that means "off"): a field given anything else is refused
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
               "best_of": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "response_format": (None, {"type": "text"})}


class ApiError(Exception):
    """A request refused: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Parsed:
    """One request translated: ``prompt`` (a string or token ids) or ``messages`` (chat)."""

    model: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool


def _int(body: dict, name: str, default=None):
    v = body.get(name, default)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise bad(f"{name} must be an integer, got {v!r}", name)
    return v


def _number(body: dict, name: str, default):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"{name} must be a number, got {v!r}", name)
    return float(v)


def _top_k(body: dict) -> int:
    """top_k (not OpenAI's; vLLM's clients send it): 0 or None off, and -1 off as vLLM reads it."""
    k = _int(body, "top_k", 0) or 0
    return 0 if k == -1 else k


def _prompt(body: dict):
    """A completion's prompt: a string, token ids, or a list of one of either."""
    if "prompt" not in body:
        raise bad("'prompt' is a required property", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise bad("the prompt is empty: give at least one character or token", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise bad(f"this server takes one prompt per request, got {len(p)}: send them as separate requests", "prompt")
    raise bad("prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def _messages(body: dict) -> list[dict]:
    if "messages" not in body:
        raise bad("'messages' is a required property", "messages", "missing_required_parameter")
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", f"messages.[{i}].role")
        if m["role"] not in ROLES:
            raise bad(f"messages[{i}].role {m['role']!r} is not a role: use one of {', '.join(ROLES)}",
                      f"messages.[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text parts joined, anything else refused
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise bad("only text content parts are supported", f"messages.[{i}].content")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or text parts", f"messages.[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


def parse(body, chat: bool) -> Parsed:
    """Translate a request body; :class:`ApiError` naming the field where it cannot be served."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_json")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"model must be a string, got {model!r}", "model")
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise bad(f"{name}={body[name]!r} is not supported by this server; leave it out", name, "unsupported")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise bad(f"n={n} is not supported: this server returns one choice per request (n=1)", "n", "unsupported")
    # max_completion_tokens (chat's newer name) is honoured on either endpoint, before max_tokens
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name)
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"{max_name} must be at least 1, got {max_tokens}", max_name)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("stop must be a string or a list of strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad(f"stream must be a boolean, got {stream!r}", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    try:
        params = SamplingParams(max_tokens=max_tokens or DEFAULT_COMPLETION_MAX_TOKENS,
                                temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                                top_k=_top_k(body), stop=tuple(s for s in stop if s),
                                seed=_int(body, "seed"), ignore_eos=bool(body.get("ignore_eos", False)))
    except InvalidInputError as e:  # SamplingParams' own check, its message names the field first
        field = str(e).split(" ", 1)[0]
        raise bad(str(e), field if field in body else None) from None
    return Parsed(model or "", None if chat else _prompt(body), _messages(body) if chat else None, params,
                  max_tokens is not None, bool(stream), bool(opts.get("include_usage", False)))


# ---- responses ----
def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, created: int, text: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}], "usage": use}


def chat_completion(rid: str, model: str, created: int, text: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": use}


def chunk(rid: str, model: str, created: int, chat: bool, text: str | None, finish_reason: str | None,
          first: bool = False) -> dict:
    """One stream event's JSON (``text=None``: no content, e.g. the chunk with finish_reason)."""
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, use: dict) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": use}


def now_s() -> int:
    return int(time.time())
