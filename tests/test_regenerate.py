"""Target-regenerated training data: resumable generation, chat rendering with response-only loss,
and a drafter trained on it."""

from __future__ import annotations

import json

import torch

from distill.config import DataConfig, parse_recipe
from distill.data import encode_example

from .conftest import reset_accelerate
from .test_drafters import drafter_recipe

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def regenerate_recipe(out, target_dir, **generation):
    return parse_recipe({"recipe": "regenerate", "output_dir": str(out), "seed": 1, "target": {"path": str(target_dir)},
                         "prompts": {"from_corpus": 6, "prompt_tokens": 12},
                         "generation": {"max_new_tokens": 10, "batch_size": 2, **generation},
                         "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1}, "torch_threads": 1})


def test_sampled_regeneration_resumes_to_the_same_data(tmp_path, tiny_target_dir):
    from recipes import regenerate

    full = tmp_path / "full"
    regenerate.main(regenerate_recipe(full, tiny_target_dir, temperature=1.0))
    lines = (full / "data.jsonl").read_text().splitlines()
    assert len(lines) == 6 and [json.loads(l)["id"] for l in lines] == list(range(6))
    assert all(json.loads(l)["prompt"] and "response" in json.loads(l) for l in lines)

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    # a kill after batch 0, in the middle of batch 1: one complete line of batch 1, then a torn one
    (crashed / "data.jsonl.partial").write_text("\n".join(lines[:3]) + "\n" + lines[3][:15])
    regenerate.main(regenerate_recipe(crashed, tiny_target_dir, temperature=1.0))
    assert (crashed / "data.jsonl").read_text().splitlines() == lines
    assert not (crashed / "data.jsonl.partial").exists()


def test_chat_template_scores_the_response_only(tiny_target_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    cfg = DataConfig(source="hub", hub_name="unused/unused", format="prompt_response", seq_len=64)
    record = {"prompt": "def f(x):", "response": "    return x"}
    ids, mask = encode_example(record, tok, cfg)  # no template: prompt + response + EOS
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "    return x<|endoftext|>"
    tok.chat_template = CHAT_TEMPLATE
    ids, mask = encode_example(record, tok, cfg)
    assert tok.decode(ids).startswith("<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "    return x<|im_end|>\n"


def test_drafter_trains_on_regenerated_responses(tmp_path, tiny_target_dir):
    from recipes import regenerate, train_drafter

    data = regenerate.main(regenerate_recipe(tmp_path / "regen", tiny_target_dir))["data"]
    reset_accelerate()
    raw = drafter_recipe(tmp_path / "drafter", tiny_target_dir, "dspark", max_steps=6, eval_every=3).model_dump(mode="json")
    raw["data"] = {"source": "files", "train_files": [data], "format": "prompt_response", "seq_len": 32, "val_fraction": 0.34}
    summary = train_drafter.main(parse_recipe(raw))
    assert torch.isfinite(torch.tensor(summary["val_loss"])) and summary["val_simulated_tau"] >= 1.0
