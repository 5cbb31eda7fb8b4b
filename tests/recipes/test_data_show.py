"""``draftsmith data show``: a record as the recipe trains on it, each token with its mask bit."""

from __future__ import annotations

import json

from recipes.cli import main
from tests.chat_templates import chat_tokenizer

CONVERSATION = [
    {"from": "human", "value": "Reverse a list."},
    {"from": "gpt", "value": "xs[::-1]"},
    {"from": "human", "value": "In place?"},
    {"from": "gpt", "value": "xs.reverse()"},
]


def test_data_show_prints_each_token_with_its_mask_bit(tmp_path, capsys):
    chat_tokenizer("llama3", tmp_path / "llama")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"id": 0, "conversations": CONVERSATION}) + "\n")
    args = ["data", "show", str(data), "--target", str(tmp_path / "llama"), "--schema", "sharegpt"]
    assert main([*args, "--json"]) == 0
    (rows,) = json.loads(capsys.readouterr().out)  # Llama-3 keeps its history: one example
    scored = "".join(r["token"] for r in rows if r["mask"])
    assert scored == "xs[::-1]<|eot_id|>xs.reverse()<|eot_id|>"
    assert [r["mask"] for r in rows].count(1) == sum(1 for r in rows if r["mask"])
    assert main([*args, "--turns", "last", "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "1 training example(s)" in out and " cut " in out  # tokens past the window are marked
    lines = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [line[1] for line in lines[:9]] == ["0"] * 9  # the first question and answer are context now


def test_data_show_bad_input_exits_2(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"conversations": CONVERSATION}) + "\n")
    assert main(["data", "show", str(data), "--target", "testbed", "--schema", "sharegpt", "--index", "5"]) == 2
    assert "--index 5" in capsys.readouterr().err
    assert main(["data", "show", str(data), "--target", "testbed"]) == 2  # the openai schema's column is missing
    assert "'messages'" in capsys.readouterr().err
