"""Target-regenerated training data: resumable generation, chat rendering with response-only loss,
and a drafter trained on it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from distill.config import DataConfig, TargetConfig
from distill.data import encode_example
from recipes.registry import parse_recipe

from ..conftest import drafter_recipe, reset_accelerate

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def regenerate_recipe(out, target_dir, **generation):
    return parse_recipe(
        {
            "recipe": "regenerate",
            "output_dir": str(out),
            "seed": 1,
            "target": {"path": str(target_dir)},
            "prompts": {"from_corpus": 6, "prompt_tokens": 12},
            "generation": {"max_new_tokens": 10, "batch_size": 2, **generation},
            "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
            "torch_threads": 1,
        }
    )


def test_sampled_regeneration_resumes_to_the_same_data(tmp_path, tiny_target_dir):
    from recipes import regenerate

    full = tmp_path / "full"
    regenerate.main(regenerate_recipe(full, tiny_target_dir, temperature=1.0))
    lines = (full / "data.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(lines) == 6 and [r["id"] for r in records] == list(range(6))
    assert all(r["prompt"] and "response" in r for r in records)

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
    ((ids, mask),) = encode_example(record, tok, cfg)  # no template: prompt + response + EOS
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "    return x<|endoftext|>"
    tok.chat_template = CHAT_TEMPLATE
    ((ids, mask),) = encode_example(record, tok, cfg)
    assert tok.decode(ids).startswith("<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "    return x<|im_end|>"  # not the newline after it


def test_drafter_recipe_regenerates_in_process_online_and_offline_alike(tmp_path, tiny_target_dir):
    from recipes import train_drafter

    def run(out, **features):
        reset_accelerate()
        raw = drafter_recipe(out, tiny_target_dir, "dflash", max_steps=6, eval_every=3).model_dump(mode="json")
        raw["regenerate"] = {
            "train_prompts": 12,
            "val_prompts": 4,
            "prompt_tokens": 12,
            "max_new_tokens": 16,
            "temperatures": [0.0, 0.7],
            "batch_size": 4,
        }
        raw["features"] = features or {"mode": "online"}
        summary = train_drafter.main(parse_recipe(raw))
        log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return summary, log

    online, online_log = run(tmp_path / "online")
    offline, offline_log = run(tmp_path / "offline", mode="offline", cache_dir=str(tmp_path / "cache"), dtype="float32")
    prov = json.loads((tmp_path / "offline" / "provenance.json").read_text())
    regenerated = prov["data"]["regenerated"]
    assert regenerated["reused"] and regenerated["train_response_tokens"] > 0  # the second run reused the answers
    assert [m.get("train/loss") for m in online_log] == [m.get("train/loss") for m in offline_log]
    assert online["val_simulated_tau"] == offline["val_simulated_tau"]
    # only the target's answers are scored: every sampled block starts where a label is scored
    assert 0 < online["scored_tokens_per_s"] < online["tokens_per_s"] and online["scored_labels_per_s"] > 0


def test_a_student_recipe_trains_on_the_answers_a_drafter_recipe_cached(tmp_path, tiny_target_dir, monkeypatch):
    """A ``regenerate:`` stage in a distill_student recipe (a PARD drafter, a student) reads the answers
    a drafter recipe with the same stage, corpus, target and seed regenerated, and trains on them."""
    from recipes import distill_student, train_drafter

    from ..conftest import student_recipe

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    stage = {
        "train_prompts": 8,
        "val_prompts": 4,
        "prompt_tokens": 12,
        "max_new_tokens": 16,
        "temperatures": [0.0, 0.7],
        "batch_size": 4,
    }
    data = {"source": "stdlib", "seq_len": 64, "max_documents": 40, "val_fraction": 0.1}
    reset_accelerate()
    raw = drafter_recipe(tmp_path / "drafter", tiny_target_dir, "dflash", max_steps=2, eval_every=2).model_dump(
        mode="json"
    )
    train_drafter.main(parse_recipe({**raw, "data": data, "regenerate": stage, "features": {"mode": "online"}}))
    reset_accelerate()
    raw = student_recipe(tmp_path / "student", tiny_target_dir, max_steps=4, eval_every=4).model_dump(mode="json")
    summary = distill_student.main(parse_recipe({**raw, "data": data, "regenerate": stage}))
    drafter_data, student_data = (
        json.loads((tmp_path / run / "provenance.json").read_text())["data"] for run in ("drafter", "student")
    )
    assert not drafter_data["regenerated"]["reused"] and student_data["regenerated"]["reused"]
    assert student_data["regenerated"]["key"] == drafter_data["regenerated"]["key"]
    assert student_data["data_fingerprint"] == drafter_data["data_fingerprint"]  # the answers, not the corpus
    assert torch.isfinite(torch.tensor(summary["val_loss"]))


def test_drafter_trains_on_regenerated_responses(tmp_path, tiny_target_dir, trained_drafters):
    """A drafter (the corpus-trained one, trained on) trains on the target's regenerated answers, and its
    held-out simulated tau is the tau the decoding loop measures on the held-out answers: each answer is
    the target's greedy continuation of its prompt, and the replay walks it as the loop decodes it."""
    from transformers import AutoModel

    from distill.models import load_target
    from recipes import regenerate, train_drafter
    from recipes.train_drafter import drafter_windows
    from serve_eval.loop import speculative_generate

    data = regenerate.main(regenerate_recipe(tmp_path / "regen", tiny_target_dir))["data"]
    reset_accelerate()
    raw = drafter_recipe(
        tmp_path / "drafter",
        tiny_target_dir,
        "dspark",
        {"init_from": str(trained_drafters["dspark"].folder)},
        max_steps=6,
        eval_every=3,
    ).model_dump(mode="json")
    raw["data"] = {
        "source": "files",
        "train_files": [data],
        "format": "prompt_response",
        "seq_len": 32,
        "val_fraction": 0.34,
    }
    recipe = parse_recipe(raw)
    summary = train_drafter.main(recipe)
    assert torch.isfinite(torch.tensor(summary["val_loss"]))
    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    _, val, _ = drafter_windows(recipe, target, tok)
    drafter = AutoModel.from_pretrained(tmp_path / "drafter" / "model").eval()
    tokens = forwards = 0
    for i in range(len(val)):
        window = val.collate([i])
        scored, ids = window.loss_mask[0].nonzero(), window.input_ids[0]
        first, last = int(scored[0]), int(scored[-1])
        out, stats = speculative_generate(target, drafter, ids[:first], last - first + 1)
        assert out == ids[first : last + 1].tolist()
        tokens, forwards = tokens + stats.tokens, forwards + stats.target_forwards
    assert len(val) > 0 and forwards < tokens  # drafts kept on the answers
    assert summary["val_simulated_tau"] == pytest.approx(tokens / forwards), (
        summary["val_simulated_tau"],
        tokens,
        forwards,
    )


def test_regenerated_records_keep_the_exact_tokens(tmp_path, tiny_target_dir):
    from recipes import regenerate

    regenerate.main(regenerate_recipe(tmp_path / "regen", tiny_target_dir))
    records = [json.loads(line) for line in (tmp_path / "regen" / "data.jsonl").read_text().splitlines()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    cfg = DataConfig(source="hub", hub_name="unused/unused", format="prompt_response", seq_len=64)
    for r in records:
        assert len(r["prompt_ids"]) == 12 and len(r["response_ids"]) + r["eos"] <= 10
        ((ids, mask),) = encode_example(r, tok, cfg)  # what training reads: exactly what the target read and wrote
        assert ids == r["prompt_ids"] + r["response_ids"] + ([tok.eos_token_id] if r["eos"] else [])
        assert sum(mask) == len(r["response_ids"]) + r["eos"] and mask[:12] == [0] * 12


def test_in_process_regeneration_is_cached_and_reused(tmp_path, tiny_target_dir, monkeypatch):
    from distill.config import RegenerateStage
    from distill.data import load_text_splits, tokenizer_fingerprint
    from distill.feature_cache import target_fingerprint
    from distill.models import load_target
    from distill.regenerate import regenerated_splits

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    splits = load_text_splits(DataConfig(source="stdlib", max_documents=40, val_fraction=0.1))
    stage = RegenerateStage(
        train_prompts=6, val_prompts=2, prompt_tokens=8, max_new_tokens=6, temperatures=[0.0, 1.0], batch_size=4
    )
    fps = (target_fingerprint(target), tokenizer_fingerprint(tok))
    first = regenerated_splits(stage, target, tok, splits, 0, *fps)
    assert not first["reused"] and len(first["train_files"]) == 2 and first["train_response_tokens"] > 0
    rows = [json.loads(line) for f in first["train_files"] for line in Path(f).read_text().splitlines()]
    assert len(rows) == 6 and {r["temperature"] for r in rows} == {0.0, 1.0}
    val = [json.loads(line) for line in Path(first["val_files"][0]).read_text().splitlines()]
    assert len(val) == 2 and all(r["temperature"] == 0.0 for r in val)
    assert all(f["tokens_per_s"] for f in first["files"].values())

    monkeypatch.setattr(target, "generate", lambda *a, **k: pytest.fail("a cached regeneration must not generate"))
    again = regenerated_splits(stage, target, tok, splits, 0, *fps)
    assert again["reused"] and again["key"] == first["key"]
    other = stage.model_copy(update={"max_new_tokens": 5})
    with pytest.raises(pytest.fail.Exception):  # any setting changes the key: new answers are made
        regenerated_splits(other, target, tok, splits, 0, *fps)


@contextlib.contextmanager
def serving(folder):
    """``transformers serve`` with the model in ``folder`` on a loopback port: a real OpenAI-compatible server."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = Path(sys.executable).with_name("transformers")
    proc = subprocess.Popen(
        [str(cli), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("transformers serve did not start within 120 s")
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": str(folder)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served_target(tiny_target_dir):
    with serving(tiny_target_dir) as server:
        yield server


@pytest.mark.slow
def test_regeneration_through_a_server_matches_in_process_and_resumes(tmp_path, tiny_target_dir, served_target):
    """The same prompts answered greedily through ``transformers serve`` and in-process: the same
    prompts, responses and ends; a run killed mid-batch resumes to the same file; a sampled run works."""
    from recipes import regenerate

    regenerate.main(regenerate_recipe(tmp_path / "local", tiny_target_dir))
    recipe = regenerate_recipe(tmp_path / "served", tiny_target_dir).model_dump(mode="json")
    recipe["server"] = {**served_target, "concurrency": 4}
    regenerate.main(parse_recipe(recipe))
    local = [json.loads(line) for line in (tmp_path / "local" / "data.jsonl").read_text().splitlines()]
    served = [json.loads(line) for line in (tmp_path / "served" / "data.jsonl").read_text().splitlines()]
    assert len(served) == len(local) == 6
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    for a, b in zip(local, served):
        assert b["prompt"] == a["prompt"] and b["response"] == a["response"] and b["eos"] == a["eos"]
        # this server returns text only: its tokens are the text re-tokenized (not always the generated ones)
        assert (
            b["retokenized"] is True and b["response_ids"] == tok(b["response"], add_special_tokens=False)["input_ids"]
        )
        assert b["prompt_ids"] == tok(b["prompt"], add_special_tokens=False)["input_ids"]

    lines = (tmp_path / "served" / "data.jsonl").read_text().splitlines()
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "data.jsonl.partial").write_text("\n".join(lines[:3]) + "\n" + lines[3][:15])  # killed in batch 1
    regenerate.main(parse_recipe({**recipe, "output_dir": str(crashed)}))
    assert (crashed / "data.jsonl").read_text().splitlines() == lines

    sampled = {
        **recipe,
        "output_dir": str(tmp_path / "sampled"),
        "generation": {**recipe["generation"], "temperature": 1.0},
    }
    regenerate.main(parse_recipe(sampled))
    assert len((tmp_path / "sampled" / "data.jsonl").read_text().splitlines()) == 6


def test_an_unreachable_server_is_a_clear_error_before_any_prompt(tmp_path, tiny_target_dir):
    from distill.config import RecipeError
    from recipes import regenerate

    recipe = regenerate_recipe(tmp_path / "x", tiny_target_dir).model_dump(mode="json")
    recipe["server"] = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "timeout_s": 2}
    with pytest.raises(
        RecipeError, match="server.base_url: no OpenAI-compatible server answered at http://127.0.0.1:9/v1"
    ):
        regenerate.main(parse_recipe(recipe))
    assert not (tmp_path / "x" / "data.jsonl").exists()
    with pytest.raises(RecipeError, match="server.base_url"):
        parse_recipe({**recipe, "server": {"base_url": "localhost:8000", "model": "m"}})


CONVERSATION = [
    {"role": "user", "content": "def add(a, b):\n"},
    {"role": "assistant", "content": "    pass  # an answer from elsewhere\n"},
    {"role": "user", "content": "\n\ndef sub(a, b):\n"},
    {"role": "assistant", "content": "    pass\n"},
]


def test_conversations_are_answered_turn_by_turn_after_the_targets_own_answers(tmp_path, tiny_target_dir):
    """Every assistant turn is answered again given the target's own earlier answers; a one-prompt
    record stays as it was; the summary counts turns and cut answers; training reads each turn's
    exact tokens, the response scored."""
    from transformers import AutoTokenizer

    from recipes import regenerate

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in ({"messages": CONVERSATION}, {"prompt": "import os\n"})))
    raw = regenerate_recipe(tmp_path / "out", tiny_target_dir).model_dump(mode="json")
    raw["prompts"] = {"file": str(prompts)}
    summary = regenerate.main(parse_recipe(raw))
    conversation, single = [json.loads(line) for line in (tmp_path / "out" / "data.jsonl").read_text().splitlines()]
    assert summary["records"] == 2 and summary["turns"] == 3 and summary["failed"] == summary["skipped"] == 0
    assert summary["truncated"] == sum(not t["eos"] for t in [*conversation["turns"], single])
    assert set(single) >= {"prompt", "prompt_ids", "response", "response_ids", "eos"} and "turns" not in single

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    first, second = conversation["turns"]
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant", "user", "assistant"]
    assert conversation["messages"][1]["content"] == first["response"] != CONVERSATION[1]["content"]
    # the second question is asked after the target's own first answer, greedily what generate writes
    asked = CONVERSATION[0]["content"] + first["response"] + CONVERSATION[2]["content"]
    assert second["prompt_ids"] == tok(asked, add_special_tokens=False)["input_ids"]
    target = AutoModelForCausalLM_from(tiny_target_dir)
    greedy = target.generate(torch.tensor([second["prompt_ids"]]), max_new_tokens=10, do_sample=False)[0]
    written = greedy[len(second["prompt_ids"]) :].tolist()
    assert written[: len(second["response_ids"])] == second["response_ids"]

    cfg = DataConfig(source="hub", hub_name="unused/unused", format="messages", seq_len=64)
    examples = encode_example(conversation, tok, cfg)
    scored = [[t for t, m in zip(ids, mask) if m] for ids, mask in examples]
    expected = [t["response_ids"] + [tok.eos_token_id] * t["eos"] for t in conversation["turns"]]
    assert sum(scored, []) == sum(expected, [])  # every answer, each once, nothing else
    # the file as a recipe reads it (a table: every record gets every column, None where it has none)
    from distill.data import load_text_splits, make_windows

    data = str(tmp_path / "out" / "data.jsonl")
    files = DataConfig(source="files", train_files=[data], val_files=[data], format="messages", seq_len=64)
    windows = make_windows(load_text_splits(files).train, tok, files, "train")
    single_scored = single["response_ids"] + [tok.eos_token_id] * single["eos"]
    read = [windows.ids[i][windows.mask[i].astype(bool)].tolist() for i in range(len(windows))]
    assert sum(read, []) == sum(expected, []) + single_scored


def AutoModelForCausalLM_from(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def test_a_failed_turn_ends_the_conversation_and_is_counted():
    from distill.regenerate import TURN_SEED_STRIDE, converse

    class Tok:
        eos_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(96 + i) for i in ids)

    calls = []

    def answer(asked, max_new_tokens, temperature, top_p, top_k, seed):
        calls.append((len(asked), seed))
        # the second conversation's second turn fails (a server that gave up)
        return [None if seed > 10 and k == 1 else ([1, 2], [k + 1, 3], True, {}) for k in range(len(asked))]

    three_turns = CONVERSATION + [{"role": "user", "content": "more"}]
    records = converse(answer, Tok(), [{"messages": CONVERSATION}, {"messages": three_turns}], 4, 0.0, 1.0, 0, 10)
    assert calls == [(2, 10), (2, 10 + TURN_SEED_STRIDE)]  # turn t samples with its own seed; nothing left at t = 2
    done, failed = records
    assert len(done["turns"]) == 2 and "failed_turns" not in done
    assert failed["failed_turns"] == 1 and failed["skipped_turns"] == 1 and len(failed["turns"]) == 1
    assert [m["role"] for m in failed["messages"]] == ["user", "assistant", "user"]  # up to the failed turn
    assert done["messages"][1]["content"] == "ac"  # the target's answer replaced the original


def test_reasoning_is_kept_or_dropped():
    from distill.regenerate import _answer_message

    text = "<think>\nadd them\n</think>\n\nreturn a + b"
    assert _answer_message(text, "keep") == {
        "role": "assistant",
        "content": "return a + b",
        "reasoning_content": "add them",
    }
    assert _answer_message(text, "drop") == {"role": "assistant", "content": "return a + b"}


@pytest.mark.slow
def test_chat_completions_answer_turn_by_turn_as_in_process(tmp_path):
    """A chat target (a tiny random Llama with a ChatML template) served by ``transformers serve``:
    regenerating a two-turn conversation through /v1/chat/completions (the server applies the template)
    and through /v1/completions (the text rendered here) gives the answers the in-process run gives,
    turn by turn."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from distill.testbed import ASSETS
    from recipes import regenerate

    folder = tmp_path / "chat_target"
    tok = AutoTokenizer.from_pretrained(ASSETS / "testbed_target")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    raw = regenerate_recipe(tmp_path / "local", folder).model_dump(mode="json")
    raw["prompts"] = {"file": str(prompts)}
    regenerate.main(parse_recipe(raw))
    with serving(folder) as server:
        for api in ("chat", "completions"):  # the server's template, or the text rendered here
            raw_api = {**raw, "output_dir": str(tmp_path / api), "server": {**server, "api": api}}
            regenerate.main(parse_recipe(raw_api))
    local = json.loads((tmp_path / "local" / "data.jsonl").read_text())
    for api in ("chat", "completions"):
        served = json.loads((tmp_path / api / "data.jsonl").read_text())
        assert [t["response"] for t in served["turns"]] == [t["response"] for t in local["turns"]], api
        assert served["messages"] == local["messages"] and len(served["turns"]) == 2
        assert [t["prompt_ids"] for t in served["turns"]] == [t["prompt_ids"] for t in local["turns"]]

    # a chat target ends its turn with its own token, not the tokenizer's EOS (here: the token it writes
    # first, so turn 1 ends at once): the record keeps it, and training scores the token written
    asked = tok.apply_chat_template(CONVERSATION[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    first = int(model(asked["input_ids"]).logits[0, -1].argmax())
    assert first != tok.eos_token_id
    model.config.eos_token_id = model.generation_config.eos_token_id = first
    model.save_pretrained(folder)
    regenerate.main(parse_recipe({**raw, "output_dir": str(tmp_path / "ends")}))
    ends = json.loads((tmp_path / "ends" / "data.jsonl").read_text())
    turn = ends["turns"][0]
    assert turn["eos"] and turn["response_ids"] == [] and turn["stop_id"] == first
    (ids, mask), *_ = encode_example(ends, tok, DataConfig(source="hub", hub_name="unused/unused", format="messages"))
    assert ids[: len(turn["prompt_ids"]) + 1] == [*turn["prompt_ids"], first] and mask[len(turn["prompt_ids"])] == 1
