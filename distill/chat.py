"""Conversations: the common record schemas read as one message list, rendered by the target's chat
template, with loss masks that come from the template itself.

Schemas (``data.schema``)
    ``openai``: ``messages``, a list of ``{"role", "content"}`` (``system`` / ``user`` / ``assistant`` /
    ``tool``; an assistant message may carry ``tool_calls`` and ``reasoning_content``, a tool message
    ``tool_call_id`` / ``name``). ``sharegpt``: ``conversations``, a list of ``{"from", "value"}`` with
    ``from`` in ``system`` / ``human`` / ``gpt`` / ``function_call`` / ``observation``. ``ultrachat``:
    ``data``, a list of strings, user and assistant in turn. Every schema reads into the ``openai`` form
    (:func:`read_conversation`) and writes back from it (:func:`write_conversation`) without loss.

Masks
    Assistant turn ``i`` is the text the template adds between ``render(messages[:i],
    add_generation_prompt=True)`` (the prompt a serving engine sends for that turn) and
    ``render(messages[:i + 1])``, trailing whitespace off: its tokens, up to and including the
    end-of-turn token, are scored; the generation prompt and the next turn's header are not. Turns are
    rendered incrementally, so nothing searches the text for role markers. A template that renders the
    history differently once a later turn exists (Qwen3 drops earlier turns' ``<think>`` blocks) makes
    the turn after the rewrite start a new example in the rewritten history: every turn is scored in
    exactly the context the target sees when it writes that turn.

Pieces
    An example is a list of ``(text, scored)`` pieces; each piece is tokenized on its own (what the
    target reads as a prompt is tokenized alone when it is served), so a token never straddles a
    scored and an unscored piece.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

Schema = Literal["openai", "sharegpt", "ultrachat"]

#: where each schema keeps its turns (``data.messages_field`` overrides it)
SCHEMA_FIELDS: dict[str, str] = {"openai": "messages", "sharegpt": "conversations", "ultrachat": "data"}
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "observation": "tool",
    "tool": "tool",
}
SHAREGPT_NAMES = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}

Piece = tuple[str, bool]  # text, scored


class ConversationError(ValueError):
    """A record that is not a conversation of its schema (the message names the turn and what was expected)."""


def read_conversation(turns: Any, schema: Schema = "openai") -> list[dict]:
    """``turns`` (one record's field) as OpenAI-style messages, checked."""
    if not isinstance(turns, list) or not turns:
        raise ConversationError(f"expected a non-empty list of turns ({schema} schema), got {type(turns).__name__}")
    if schema == "ultrachat":
        if not all(isinstance(t, str) for t in turns):
            raise ConversationError("ultrachat turns are strings, user and assistant in turn")
        return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    messages = _from_sharegpt(turns) if schema == "sharegpt" else list(turns)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ConversationError(f"turn {i}: expected a role in {ROLES}, got {m!r:.80}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m.get("tool_calls"))):
            raise ConversationError(f"turn {i} ({m['role']}): content must be a string, got {content!r:.60}")
    # keys a table gives every message (None where a message lacks them) are not the message's
    return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages]


def _from_sharegpt(turns: list) -> list[dict]:
    messages: list[dict] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise ConversationError(f"turn {i}: expected {{'from', 'value'}} (sharegpt schema), got {turn!r:.80}")
        if turn["from"] == "function_call":  # a tool call: joins the assistant message it follows
            try:
                call = json.loads(turn["value"])
            except (TypeError, json.JSONDecodeError):
                call = None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ConversationError(
                    f"turn {i}: a function_call's value must be JSON with a 'name', got {turn['value']!r:.60}"
                )
            tool_call = {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
                messages[-1]["tool_calls"] = [tool_call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
            continue
        if turn["from"] not in SHAREGPT_ROLES:
            raise ConversationError(
                f"turn {i}: 'from' must be one of {[*SHAREGPT_ROLES, 'function_call']}, got {turn['from']!r}"
            )
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages


def write_conversation(messages: Sequence[dict], schema: Schema = "openai") -> list:
    """``messages`` (OpenAI-style) in ``schema``: the inverse of :func:`read_conversation`."""
    if schema == "openai":
        return [dict(m) for m in messages]
    if schema == "ultrachat":
        roles = [m["role"] for m in messages]
        if roles != [("user", "assistant")[i % 2] for i in range(len(roles))] or any(len(m) != 2 for m in messages):
            raise ConversationError("the ultrachat schema holds only user and assistant text, in turn")
        return [m["content"] for m in messages]
    turns = []
    for m in messages:
        extra = sorted(set(m) - {"role", "content", "tool_calls"})
        if extra:
            raise ConversationError(f"the sharegpt schema cannot hold a message's {extra}")
        if m["content"] is not None:
            turns.append({"from": SHAREGPT_NAMES[m["role"]], "value": m["content"]})
        for call in m.get("tool_calls", []):
            fn = call["function"]
            turns.append(
                {"from": "function_call", "value": json.dumps({"name": fn["name"], "arguments": fn["arguments"]})}
            )
    return turns


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(
    tokenizer,
    messages: Sequence[dict],
    template_kwargs: dict | None = None,
    generation_prompt: bool = False,
    tools=None,
) -> str:
    """The conversation as the target's chat template writes it; without a template (the testbed) the
    turns' contents joined as they are."""
    if not has_template(tokenizer):
        return "".join(m["content"] or "" for m in messages)
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **(template_kwargs or {})
    )


def conversation_pieces(
    tokenizer,
    messages: Sequence[dict],
    template_kwargs: dict | None = None,
    turns: Literal["all", "last"] = "all",
    tools=None,
) -> list[list[Piece]]:
    """The examples one conversation trains (module doc): each a list of ``(text, scored)`` pieces
    whose scored pieces are the assistant turns (every one, or the last with ``turns="last"``).

    Without a chat template (the testbed) the contents are joined as they are and each assistant turn
    ends with the EOS text."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        raise ConversationError("the conversation has no assistant turn to train on")
    scored = set(assistants if turns == "all" else assistants[-1:])
    if not has_template(tokenizer):
        eos = tokenizer.eos_token or ""
        texts = [(m["content"] or "") + (eos if m["role"] == "assistant" else "") for m in messages]
        return [_joined([(t, i in scored) for i, t in enumerate(texts[: assistants[-1] + 1])])]
    examples: list[tuple[str, list[tuple[int, int]]]] = []
    text, spans = "", []
    for i in assistants:
        prompt = render(tokenizer, messages[:i], template_kwargs, True, tools)
        upto = render(tokenizer, messages[: i + 1], template_kwargs, False, tools)
        if not upto.startswith(prompt):
            at = next(k for k, (a, b) in enumerate(zip(prompt + "\0", upto + "\0")) if a != b)
            raise ConversationError(
                f"turn {i}: the chat template renders this assistant turn's prompt ...{prompt[max(0, at - 30) : at + 20]!r} "
                f"but the conversation up to it ...{upto[max(0, at - 30) : at + 20]!r}: its tokens cannot be told from "
                "the prompt's (reasoning in the data while chat_template_kwargs turn thinking off?)"
            )
        if text and not prompt.startswith(text):  # the history was rewritten: a new example in it
            examples.append((text, spans))
            spans = []
        text = upto
        if i in scored:
            spans.append((len(prompt), len(prompt) + len(upto[len(prompt) :].rstrip())))
    examples.append((text, spans))
    return [_cut(text, spans) for text, spans in examples if spans]


def _cut(text: str, spans: list[tuple[int, int]]) -> list[Piece]:
    pieces, at = [], 0
    for start, end in spans:
        pieces += [(text[at:start], False), (text[start:end], True)]
        at = end
    return _joined([*pieces, (text[at:], False)])


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Empty pieces dropped, neighbours with the same bit joined."""
    out: list[Piece] = []
    for text, scored in pieces:
        if not text:
            continue
        if out and out[-1][1] == scored:
            out[-1] = (out[-1][0] + text, scored)
        else:
            out.append((text, scored))
    return out


def tokenized(tokenizer, pieces: Sequence[Piece]) -> tuple[list[int], list[int]]:
    """Token ids of ``pieces``, each tokenized alone, and their mask (1 on scored pieces)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, scored in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(scored)] * len(piece)
    return ids, mask
