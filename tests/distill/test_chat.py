"""Conversations: schemas read and written back, masks derived from the chat template, turn by turn."""

from __future__ import annotations

import json

import pytest

from distill.chat import (
    ConversationError,
    conversation_pieces,
    read_conversation,
    render,
    tokenized,
    write_conversation,
)
from tests.chat_templates import END_OF_TURN, chat_tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "a greeting"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.", "reasoning_content": "two and two"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Add 2 and 3."},
    {
        "role": "assistant",
        "content": "Calling add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
    },
    {"role": "tool", "content": "5", "tool_call_id": "c0"},
    {"role": "assistant", "content": "The sum is 5."},
]


@pytest.fixture(scope="module")
def tokenizers():
    return {family: chat_tokenizer(family) for family in END_OF_TURN}


def scored_runs(tok, pieces) -> list[tuple[list[int], list[int], list[int]]]:
    """Each scored run of the example as (the ids before it, its ids, the ids after it)."""
    ids, mask = tokenized(tok, pieces)
    runs, start = [], None
    for k, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = k
        if not bit and start is not None:
            runs.append((ids[:start], ids[start:k], ids[k:]))
            start = None
    return runs


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_each_assistant_turn_is_scored_in_the_context_the_target_answered_it_in(tokenizers, family):
    tok = tokenizers[family]
    examples = conversation_pieces(tok, CHAT)
    runs = [run for pieces in examples for run in scored_runs(tok, pieces)]
    assert len(runs) == 2  # both assistant turns, nothing else
    for k, (turn, (before, scored, after)) in enumerate(zip((2, 4), runs)):
        # the context is the prompt a serving engine sends for this turn: its text, and for the first turn its
        # tokens (later turns keep the tokens of the answers before them, which the engine may cut differently)
        prompt = render(tok, CHAT[:turn], generation_prompt=True)
        assert tok.decode(before) == prompt
        if k == 0 or family == "qwen3":
            assert before == tok(prompt, add_special_tokens=False)["input_ids"]
        text = tok.decode(scored)
        assert text.endswith(CHAT[turn]["content"] + END_OF_TURN[family])  # the answer and its end-of-turn token
        assert scored[-1] == tok.convert_tokens_to_ids(END_OF_TURN[family])
        assert not after or not tok.decode(after).startswith("assistant")  # the next turn's header is not scored
        if family == "qwen3":  # the turn after the last query writes its reasoning; it is the target's to draft
            assert text == f"<think>\n{CHAT[turn]['reasoning_content']}\n</think>\n\n{CHAT[turn]['content']}<|im_end|>"
        else:
            assert text == CHAT[turn]["content"] + "<|eot_id|>"
    # Llama-3 renders the history as it was: one example. Qwen3 drops the first turn's reasoning once a
    # later query exists, so the second turn is scored in that rewritten history: a second example.
    assert len(examples) == {"llama3": 1, "qwen3": 2}[family]
    if family == "qwen3":
        assert "a greeting" not in "".join(text for text, _ in examples[1])


def test_thinking_off_keeps_the_empty_think_block_in_the_prompt(tokenizers):
    tok = tokenizers["qwen3"]
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CHAT]
    pieces = conversation_pieces(tok, plain, {"enable_thinking": False})[-1]
    (_, scored, _), *rest = scored_runs(tok, pieces)
    assert tok.decode(scored) == "It is 4.<|im_end|>" and not rest  # the '<think>\n\n</think>' is the prompt's
    with pytest.raises(ConversationError, match="thinking off"):  # reasoning in the data, thinking off
        conversation_pieces(tok, CHAT, {"enable_thinking": False})


def test_last_turn_only(tokenizers):
    tok = tokenizers["llama3"]
    (pieces,) = conversation_pieces(tok, CHAT, turns="last")
    ((before, scored, _),) = scored_runs(tok, pieces)
    assert tok.decode(scored) == "It is 4.<|eot_id|>"
    assert "Hello!<|eot_id|>" in tok.decode(before)  # the earlier answer is context


def test_tool_calls_are_scored_and_tool_results_are_context(tokenizers):
    tok = tokenizers["qwen3"]
    texts = [
        tok.decode(scored)
        for pieces in conversation_pieces(tok, TOOL_CHAT, tools=TOOLS)
        for _, scored, _ in scored_runs(tok, pieces)
    ]
    assert texts[0].endswith(
        'Calling add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    )
    assert texts[1].endswith("The sum is 5.<|im_end|>")
    assert all("<tool_response>" not in t for t in texts)


def test_without_a_template_contents_are_joined_and_answers_end_with_eos():
    from transformers import AutoTokenizer

    from distill.testbed import ASSETS

    tok = AutoTokenizer.from_pretrained(ASSETS / "testbed_target")
    (pieces,) = conversation_pieces(tok, CHAT[1:])
    assert pieces == [
        ("Hi there", False),
        ("Hello!<|endoftext|>", True),
        ("What is 2+2?", False),
        ("It is 4.<|endoftext|>", True),
    ]


def test_schemas_round_trip():
    sharegpt = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Add 2 and 3."},
        {"from": "gpt", "value": "Calling add."},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})},
        {"from": "observation", "value": "5"},
        {"from": "gpt", "value": "The sum is 5."},
    ]
    messages = read_conversation(sharegpt, "sharegpt")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert write_conversation(messages, "sharegpt") == sharegpt
    assert read_conversation(write_conversation(messages, "sharegpt"), "sharegpt") == messages
    only_call = [{"from": "human", "value": "x"}, {"from": "function_call", "value": '{"name": "f", "arguments": {}}'}]
    assert write_conversation(read_conversation(only_call, "sharegpt"), "sharegpt") == only_call
    ultra = ["Hi", "Hello!", "2+2?", "4"]
    assert read_conversation(ultra, "ultrachat")[3] == {"role": "assistant", "content": "4"}
    assert write_conversation(read_conversation(ultra, "ultrachat"), "ultrachat") == ultra
    # OpenAI messages from a table: keys other messages have arrive as None and are dropped
    tabled = [{**m, "tool_calls": m.get("tool_calls"), "tool_call_id": m.get("tool_call_id")} for m in TOOL_CHAT]
    assert read_conversation(tabled) == TOOL_CHAT


@pytest.mark.parametrize(
    ("turns", "schema", "error"),
    [
        ([], "openai", "non-empty list"),
        ([{"role": "bot", "content": "x"}], "openai", "expected a role"),
        ([{"role": "user", "content": 3}], "openai", "content must be a string"),
        ([{"from": "human"}], "sharegpt", "'from', 'value'"),
        ([{"from": "robot", "value": "x"}], "sharegpt", "'from' must be one of"),
        ([{"from": "function_call", "value": "not json"}], "sharegpt", "must be JSON"),
        ([{"from": "function_call", "value": '{"arguments": {}}'}], "sharegpt", "with a 'name'"),
        ([1, 2], "ultrachat", "strings"),
    ],
)
def test_bad_turns_name_what_was_expected(turns, schema, error):
    with pytest.raises(ConversationError, match=error):
        read_conversation(turns, schema)


def test_a_sharegpt_file_trains_every_turn_in_its_own_context(tmp_path, tokenizers):
    """Through the data section: a ShareGPT JSONL file, read by ``datasets``, one row per example."""
    from distill.config import DataConfig
    from distill.data import load_text_splits, make_windows

    tok = tokenizers["qwen3"]
    conversation = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]
    two_turns = [*conversation, {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye!"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"conversations": c, "id": i}) for i, c in enumerate([two_turns] * 3)))
    cfg = DataConfig(
        source="files",
        train_files=[str(path)],
        val_files=[str(path)],
        format="messages",
        chat_schema="sharegpt",
        seq_len=64,
    )
    windows = make_windows(load_text_splits(cfg).train, tok, cfg, "train")
    assert len(windows) == 6  # each answer, in the history the target saw when it wrote it
    texts = [tok.decode(windows.ids[i][windows.mask[i].astype(bool)]) for i in range(2)]
    assert texts == ["<think>\n\n</think>\n\nHello!<|im_end|>", "<think>\n\n</think>\n\nBye!<|im_end|>"]
    last = make_windows(load_text_splits(cfg).train, tok, cfg.model_copy(update={"assistant_turns": "last"}), "train")
    assert len(last) == 3
