"""Exports: every drafter kind is written in every format that can hold it, reloaded, gated, and (when the
``speculators`` library is installed, as ``make install`` does) loaded by vLLM's drafter library with
exactly the weights it expects and the same maths; a shifted layer index is refused; the hub upload
plan is checked offline."""

from __future__ import annotations

import json

import pytest
import torch

from distill.config import DataConfig, DrafterSection, RecipeError, TargetConfig
from distill.models import load_target
from recipes.registry import parse_recipe

KINDS = ["dflash", "dspark", "eagle3"]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(TargetConfig(path=str(tiny_target_dir)))


@pytest.fixture(scope="module")
def val_windows(target):
    from distill.data import load_text_splits, make_windows

    data = DataConfig(source="stdlib", seq_len=64, max_documents=40, val_fraction=0.1)
    return make_windows(load_text_splits(data).val, target[1], data, "val")


def scrambled(drafter, seed: int):
    """Perturb every trainable weight (norms included) so that any swapped or misnamed tensor changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in drafter.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.05))
    return drafter


def drafter_folder(tmp_path, target, val_windows, kind, qk_norm=True, **section):
    """A drafter saved like a training checkpoint, with the simulated tau its 'training' recorded."""
    from distill.base.features import FeatureCapture
    from distill.drafter_eval import build_drafter, evaluate_drafter

    model, tok = target
    block = dict(
        kind=kind, num_layers=1, block_size=4, num_anchors=8, markov_rank=16, qk_norm=qk_norm and kind != "eagle3"
    )
    block.update(section)
    torch.manual_seed(0)
    drafter = scrambled(
        build_drafter(DrafterSection(**block), model, str(target_path(model)), tok.mask_token_id), 1
    ).eval()
    metrics = evaluate_drafter(
        drafter, FeatureCapture(model, drafter.config.target_layer_ids), val_windows, 4, max_batches=2
    )
    folder = tmp_path / f"{kind}_run" / "checkpoints" / "best"
    drafter.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 1, **metrics}))
    return folder, drafter


def target_path(model):
    return model.config._name_or_path


def export_recipe(folder, out, target_dir, **extra):
    raw = {
        "recipe": "export",
        "output_dir": str(out),
        "drafter": str(folder),
        "target": {"path": str(target_dir)},
        "prompts": {"from_corpus": 3, "split": "val", "prompt_tokens": 24},
        "data": {"source": "stdlib", "max_documents": 40, "val_fraction": 0.1},
        "gate": {"max_new_tokens": 16},
    }
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_recipe(raw)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, target, val_windows, tiny_target_dir):
    """Each kind exported once (module-scoped: the tests below read the same folders)."""
    return export_every_kind(tmp_path_factory, target, val_windows, tiny_target_dir, "export")


def export_every_kind(tmp_path_factory, target, val_windows, tiny_target_dir, name: str, **extra) -> dict:
    """kind -> (export folder, manifest, the drafter): a drafter of each kind saved and exported."""
    from recipes.export import export_drafter

    out = {}
    for kind in KINDS:
        tmp = tmp_path_factory.mktemp(f"{name}-{kind}")
        folder, drafter = drafter_folder(tmp, target, val_windows, kind)
        manifest = export_drafter(export_recipe(folder, tmp / "export", tiny_target_dir, **extra), *target)
        out[kind] = (tmp / "export", manifest, drafter)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_exports_reloads_and_passes_the_gate(exports, kind, target):
    from transformers import AutoModel

    folder, manifest, drafter = exports[kind]
    assert not (folder.parent / "export.tmp").exists(), "the temporary folder was not published"
    expected = {"transformers", "speculators"} | ({"sglang_eagle3"} if kind == "eagle3" else set())
    exported = {fmt for fmt, rec in manifest["formats"].items() if rec["folder"]}
    assert exported == expected
    for fmt in exported:
        assert (folder / fmt / "config.json").exists() and (folder / fmt / "model.safetensors").exists()
    gate = manifest["gate"]
    assert gate["passed"] and not gate["overridden"], gate
    assert gate["logits_max_abs_diff"] == 0.0
    assert {f"logits/{fmt}" for fmt in exported} | {"target_io", "acceptance"} == set(gate["checks"])
    acc = gate["checks"]["acceptance"]
    assert acc["lossless"] and acc["measured_tau"] >= 1.0 and acc["prompts"] == 3
    assert acc["simulated_tau"] == pytest.approx(
        json.loads((folder.parent / f"{kind}_run" / "checkpoints" / "best" / "trainer_state.json").read_text())[
            "val_simulated_tau"
        ],
        abs=1e-4,
    )
    # the manifest on disk is the one returned; the card states the gate, the numbers and how to serve
    assert json.loads((folder / "export.json").read_text())["gate"]["passed"]
    card = (folder / "README.md").read_text()
    assert "Parity gate: PASSED" in card and str(acc["measured_tau"]) in card and "vllm serve" in card
    assert ("sglang.launch_server" in card) == (kind == "eagle3")
    reloaded = AutoModel.from_pretrained(folder / "transformers")
    a, b = drafter.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (folder / "transformers" / "tokenizer.json").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_speculators_ids_follow_that_librarys_convention(exports, kind):
    folder, _, drafter = exports[kind]
    config = json.loads((folder / "speculators" / "config.json").read_text())
    ids = config.get("aux_hidden_state_layer_ids") or config["eagle_aux_hidden_state_layer_ids"]
    assert ids == [i + 1 for i in drafter.config.target_layer_ids]  # input of layer i+1 == output of layer i
    assert config["speculators_model_type"] == kind
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.config.block_size - 1
    if kind == "eagle3":
        sg = json.loads((folder / "sglang_eagle3" / "config.json").read_text())
        assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == drafter.config.target_layer_ids
        assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["tie_word_embeddings"] is False


def speculators_or_skip():
    try:
        import speculators  # noqa: F401
    except ImportError as e:
        pytest.skip(
            f"the speculators library is not installed ({e}); `make install` installs it (see docs/guides/publishing.md)"
        )
    return speculators


@pytest.mark.parametrize("kind", KINDS)
def test_speculators_library_loads_the_export_with_no_missing_or_unexpected_weights(exports, kind, target):
    speculators_or_skip()
    from safetensors.torch import load_file
    from speculators import SpeculatorModel, SpeculatorModelConfig

    folder, _, drafter = exports[kind]
    path = str(folder / "speculators")
    config = SpeculatorModelConfig.from_pretrained(path)
    assert (
        type(config).__name__
        == {"dflash": "DFlashSpeculatorConfig", "dspark": "DSparkSpeculatorConfig", "eagle3": "Eagle3SpeculatorConfig"}[
            kind
        ]
    )
    model = SpeculatorModel.from_pretrained(path).eval()
    on_disk = load_file(str(folder / "speculators" / "model.safetensors"))
    model_keys = set(model.state_dict())
    rebuilt_from_verifier = set(model._keys_to_ignore_on_load_missing)  # the library fills these from the verifier
    assert not set(on_disk) - model_keys, f"unexpected weights: {sorted(set(on_disk) - model_keys)}"
    missing = model_keys - set(on_disk) - rebuilt_from_verifier
    assert not missing, f"weights the library expects and the export lacks: {sorted(missing)}"
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in on_disk.items())
    assert not any(v.is_floating_point() and v.isnan().any() for v in state.values()), "a weight was never loaded"
    # the embeddings and LM head the library rebuilt from the verifier are the trained drafter's
    assert torch.equal(model.embed_tokens.weight, drafter.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, drafter.lm_head.weight)
    assert_same_maths(model, drafter, target[0], kind)


@torch.no_grad()
def assert_same_maths(spec, drafter, target_model, kind, vocab=None):
    """The library's own modules, fed the features its ids name, give the trained drafter's logits
    (over the draft vocabulary ``vocab``, where the library's heads are pruned to it)."""
    pick = (lambda logits: logits) if vocab is None else (lambda logits: logits[..., vocab])
    from serve_eval.parity import features_from_inputs

    tl = spec.config.transformer_layer_config
    tl._attn_implementation = "eager"
    ids = torch.randint(0, drafter.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    ours_aux = (
        __import__("distill.base.features", fromlist=["FeatureCapture"])
        .FeatureCapture(target_model, drafter.config.target_layer_ids)(ids)
        .aux
    )
    spec_ids = (
        spec.config.aux_hidden_state_layer_ids if kind != "eagle3" else spec.config.eagle_aux_hidden_state_layer_ids
    )
    spec_aux = features_from_inputs(target_model, ids, spec_ids)
    assert torch.equal(spec_aux, ours_aux)
    if kind == "eagle3":
        T = ids.shape[1]
        next_tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        state = drafter.extend({}, ours_aux, next_tokens, 0)
        ours = pick(drafter.lm_head(drafter.norm(state["g"]))[:, -1])
        x = torch.cat([spec.embed_tokens(next_tokens), spec.fc(spec_aux)], dim=-1)
        pos = torch.arange(T)[None]
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        h = spec.layers[0](x, attention_mask=causal, position_ids=pos, position_embeddings=spec.rotary_emb(x, pos))
        theirs = spec.lm_head(spec.norm(h))[:, -1]
        assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
        return
    K, a = drafter.config.block_size, 12
    anchor_tokens = ids[:, a : a + 1]
    hidden = drafter.block_hidden(ours_aux[:, :a], anchor_tokens, torch.tensor([[a]]))[:, 0]  # [1, K, H]
    noise = torch.full((1, K), drafter.config.mask_token_id)
    noise[:, 0] = anchor_tokens[:, 0]
    ctx = spec.hidden_norm(spec.fc(spec_aux[:, :a]))
    pos = torch.cat([torch.arange(a), a + torch.arange(K)])[None]
    h = spec.embed_tokens(noise)
    for layer in spec.layers:
        h = layer(hidden_states=h, target_hidden=ctx, attention_mask=None, position_embeddings=spec.rotary_emb(h, pos))
    theirs_hidden = spec.norm(h)
    assert torch.allclose(hidden, theirs_hidden, atol=1e-5), (hidden - theirs_hidden).abs().max()
    prev = ids[:, a : a + K - 1]  # teacher-forced previous tokens for block positions 1..K-1
    if kind == "dflash":
        ours, theirs = pick(drafter.lm_head(hidden[:, 1:])), spec.lm_head(theirs_hidden[:, 1:])
    else:
        ours, ours_conf = drafter.heads(hidden[:, 1:], prev)
        ours = pick(ours)
        code = spec.markov_head.prev_embeddings(prev)
        theirs = spec.lm_head(theirs_hidden[:, 1:]) + spec.markov_head.block_bias(
            prev_token_ids=prev, hidden_states=theirs_hidden[:, 1:], prev_emb=code
        )
        theirs_conf = spec.confidence_head(torch.cat([theirs_hidden[:, 1:], code], dim=-1))
        assert torch.allclose(ours_conf, theirs_conf, atol=1e-5)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_shifted_layer_index_is_refused(tmp_path, target, val_windows, tiny_target_dir, monkeypatch):
    """The classic export bug: writing draftsmith's output-of-layer ids into speculators (input-of-layer)
    unshifted. The gate reads the export back with features from the ids it declares and refuses it."""
    import drafters.export as export_module
    from recipes.cli import main as cli_main
    from recipes.export import ExportRefused, export_drafter

    folder, _ = drafter_folder(tmp_path, target, val_windows, "dflash")
    monkeypatch.setattr(export_module, "speculators_layer_ids", lambda cfg: list(cfg.target_layer_ids))
    out = tmp_path / "export"
    with pytest.raises(ExportRefused, match=r"logits/speculators"):
        export_drafter(export_recipe(folder, out, tiny_target_dir), *target)
    assert not out.exists() and (tmp_path / "export.tmp").exists()  # nothing published; the attempt kept for inspection
    # the command line refuses with status 3; the override publishes it, marked as failed
    args = [
        "export",
        "--drafter",
        str(folder),
        "--target",
        str(tiny_target_dir),
        "--output-dir",
        str(out),
        "--prompts-from-corpus",
        "2",
        "--max-new-tokens",
        "8",
    ]
    monkeypatch.setattr(
        "distill.regenerate.load_prompts", lambda section, data, seed, tok: [{"prompt": "import os\n"}] * 2
    )
    assert cli_main(args) == 3 and not out.exists()
    assert cli_main(args + ["--allow-failed-gate"]) == 0
    manifest = json.loads((out / "export.json").read_text())
    assert not manifest["gate"]["passed"] and manifest["gate"]["overridden"]
    assert manifest["gate"]["failed"] == ["logits/speculators"]
    assert manifest["gate"]["checks"]["logits/speculators"]["max_abs_diff"] > 1e-3
    assert "Parity gate: FAILED" in (out / "README.md").read_text()


def test_a_drafter_that_does_not_reproduce_its_training_tau_is_refused(tmp_path, target, val_windows, tiny_target_dir):
    from recipes.export import ExportRefused, export_drafter

    folder, _ = drafter_folder(tmp_path, target, val_windows, "eagle3")
    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**state, "val_simulated_tau": 2.5}))  # what training claimed
    with pytest.raises(ExportRefused, match=r"acceptance: measured tau .* vs simulated 2.5"):
        export_drafter(export_recipe(folder, tmp_path / "export", tiny_target_dir), *target)


def test_formats_that_cannot_express_a_drafter_are_refused_up_front(tmp_path, target, val_windows, tiny_target_dir):
    from drafters.export import ExportError, formats_for
    from recipes.export import export_drafter

    folder, drafter = drafter_folder(tmp_path, target, val_windows, "dflash", qk_norm=False)
    reasons = formats_for(drafter.config)
    assert (
        reasons["transformers"] is None
        and "qk_norm" in reasons["speculators"]
        and "EAGLE-3 drafters only" in reasons["sglang_eagle3"]
    )
    with pytest.raises(ExportError, match="qk_norm"):
        export_drafter(export_recipe(folder, tmp_path / "e1", tiny_target_dir, formats=["speculators"]), *target)
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e1.tmp").exists()  # refused before writing anything
    manifest = export_drafter(export_recipe(folder, tmp_path / "e2", tiny_target_dir), *target)  # default: what it can
    assert (
        manifest["formats"]["speculators"]["folder"] is None
        and "qk_norm" in manifest["formats"]["speculators"]["not_exported"]
    )
    assert "not exported" in (tmp_path / "e2" / "README.md").read_text()


def test_upload_plan_and_push_offline(exports, tmp_path, tiny_target_dir):
    from recipes.export import commit_operations, push_to_hub, upload_plan

    folder, _, _ = exports["eagle3"]
    plan = upload_plan(folder, "me/tiny-eagle3", private=True, revision="v1")
    dest = {d: s for s, d in plan["files"]}
    assert dest["config.json"].endswith(
        "speculators/config.json"
    )  # the primary format sits at the root (vllm serve REPO)
    assert dest["model.safetensors"].endswith("speculators/model.safetensors")
    assert {
        "README.md",
        "export.json",
        "transformers/config.json",
        "transformers/tokenizer.json",
        "sglang_eagle3/config.json",
        "sglang_eagle3/model.safetensors",
    } <= dest.keys()
    assert not any(d.startswith("speculators/") for d in dest)
    assert len(dest) == len(plan["files"])
    ops = commit_operations(plan)
    assert sorted(op.path_in_repo for op in ops) == sorted(dest)

    calls = []

    class FakeApi:  # records what would be sent; nothing leaves the machine
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def create_branch(self, repo_id, **kw):
            calls.append(("create_branch", repo_id, kw))

        def create_commit(self, repo_id, operations, commit_message, revision):
            calls.append(("create_commit", repo_id, len(operations), revision))
            return "https://huggingface.co/me/tiny-eagle3/commit/abc"

    assert push_to_hub(plan, "msg", api=FakeApi()).endswith("/commit/abc")
    assert calls[0] == ("create_repo", "me/tiny-eagle3", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert calls[1] == ("create_branch", "me/tiny-eagle3", {"branch": "v1", "exist_ok": True})
    assert calls[2] == ("create_commit", "me/tiny-eagle3", len(ops), "v1")
    with pytest.raises(ValueError, match="primary format 'sglang_eagle3' was not exported"):
        upload_plan(exports["dflash"][0], "me/x", primary_format="sglang_eagle3")


def test_export_recipe_is_validated_before_any_work(exports, tmp_path):
    folder = str(exports["dflash"][0] / "transformers")
    base = {"recipe": "export", "output_dir": str(tmp_path / "o"), "drafter": folder}
    with pytest.raises(RecipeError, match=r"push_to_hub.*needs push_to_hub.repo_id"):
        parse_recipe({**base, "push_to_hub": {"enabled": True}})
    with pytest.raises(
        RecipeError, match=r"key 'push_to_hub.repo_id' = 'nope': repo_id 'nope' is not of the form owner/name"
    ):
        parse_recipe({**base, "push_to_hub": {"repo_id": "nope"}})
    with pytest.raises(RecipeError, match=r"key 'drafter' = .*has no config.json"):
        parse_recipe({**base, "drafter": str(tmp_path)})
    with pytest.raises(RecipeError, match=r"unknown key 'gate.allow_failures'; did you mean 'gate.allow_failure'"):
        parse_recipe({**base, "gate": {"allow_failures": True}})
    with pytest.raises(RecipeError, match=r"formats.0"):
        parse_recipe({**base, "formats": ["onnx"]})


def test_tracked_runs_carry_checkpoints_tables_and_links(tmp_path, tiny_target_dir, target, val_windows):
    """Offline wandb: the drafter run logs its checkpoints as a model artifact (aliases best/latest) and
    the acceptance table; it links to its target's run, and the export run links to both."""
    import shutil

    from recipes import train_drafter
    from recipes.export import export_drafter

    from ..conftest import reset_accelerate
    from ..distill.test_trainer import wandb_records

    tracked_target = tmp_path / "target_run" / "model"
    shutil.copytree(tiny_target_dir, tracked_target)
    (tracked_target.parent / "wandb_run.json").write_text(
        json.dumps({"id": "tgt123", "project": "p", "entity": None, "name": "target", "url": None})
    )
    out = tmp_path / "drafter_run"
    recipe = parse_recipe(
        {
            "recipe": "train_drafter",
            "output_dir": str(out),
            "target": {"path": str(tracked_target)},
            "drafter": {"kind": "eagle3", "num_layers": 1, "block_size": 3},
            "data": {"source": "stdlib", "seq_len": 32, "max_documents": 40, "val_fraction": 0.1},
            "train": {
                "max_steps": 2,
                "micro_batch_size": 2,
                "eval_every": 2,
                "eval_batches": 1,
                "save_every": 2,
                "log_every": 1,
                "torch_threads": 1,
            },
            "wandb": {"enabled": True, "project": "draftsmith-tests", "name": "tiny-drafter"},
        }
    )
    train_drafter.main(recipe)
    reset_accelerate()
    run_record = json.loads((out / "wandb_run.json").read_text())
    records = wandb_records(next(next((out / "wandb").glob("offline-run-*")).glob("run-*.wandb")))
    config = {
        item.key: json.loads(item.value_json) for r in records if r.HasField("config") for item in r.config.update
    }
    assert config["upstream_runs"]["target"]["id"] == "tgt123" and config["drafter"]["kind"] == "eagle3"
    artifacts = [
        r.artifact for r in records if r.HasField("artifact") and r.artifact.type == "model"
    ]  # (tables are artifacts too)
    aliases = {a for art in artifacts for a in art.aliases}
    assert {"best", "latest", "step-2"} <= aliases
    assert all(art.name == run_record["model_artifact"] for art in artifacts)
    files = {entry.path for art in artifacts for entry in art.manifest.contents}
    assert "model.safetensors" in files and not any("optimizer" in f for f in files)  # weights, not optimizer state
    logged = set().union(
        *[{item.key or "/".join(item.nested_key) for item in r.history.item} for r in records if r.HasField("history")]
    )
    assert {"best/acceptance_by_position/_type", "val_simulated_tau"} <= logged, logged  # a wandb table (nested keys)

    export_out = tmp_path / "export"
    manifest = export_drafter(
        export_recipe(
            out / "checkpoints" / "best",
            export_out,
            tracked_target,
            wandb={"enabled": True, "project": "draftsmith-tests"},
        )
    )
    link = manifest["wandb_run"]["upstream_runs"]
    assert link["drafter"]["id"] == run_record["id"] and link["target"]["id"] == "tgt123"
    export_records = wandb_records(next((tmp_path / "export.wandb" / "wandb").glob("offline-run-*/run-*.wandb")))
    art = [r.artifact for r in export_records if r.HasField("artifact") and r.artifact.type == "model"]
    assert art and {"export", "gate-passed"} <= set(art[0].aliases)
    assert {"speculators/config.json", "README.md"} <= {e.path for e in art[0].manifest.contents}


@pytest.fixture(scope="module")
def pruned_exports(tmp_path_factory, target, val_windows, tiny_target_dir):
    """Each kind exported with a draft vocabulary of half the target's tokens."""
    size = target[0].config.vocab_size // 2
    exported = export_every_kind(
        tmp_path_factory, target, val_windows, tiny_target_dir, "pruned", draft_vocab=size, draft_vocab_prompts=4
    )
    return {kind: (folder, manifest, size) for kind, (folder, manifest, _) in exported.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_draft_vocabularies_export_as_serving_engines_load_them(pruned_exports, kind, target):
    """A drafter exported with a draft vocabulary: every format reloads restricted to the same tokens
    and passes the gate; speculators and SGLang hold d2t / t2d and pruned heads; the speculators
    library loads the folder and its pruned heads compute the drafter's logits on those tokens."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from drafters.export import read_speculators

    folder, manifest, size = pruned_exports[kind]
    gate = manifest["gate"]
    assert gate["passed"] and gate["logits_max_abs_diff"] == 0.0, gate
    assert (
        manifest["draft_vocab"]["size"] == size
        and "draft vocabulary | " + str(size) in (folder / "README.md").read_text()
    )
    reloaded = AutoModel.from_pretrained(folder / "transformers")
    ids = reloaded.draft_vocab
    assert reloaded.config.draft_vocab_size == size == len(ids) and bool((ids[1:] > ids[:-1]).all())
    assert torch.isneginf(
        reloaded.lm_head(torch.randn(2, reloaded.config.hidden_size))[:, ~torch.isin(torch.arange(2 * size), ids)]
    ).all()
    state = load_file(str(folder / "speculators" / "model.safetensors"))
    assert json.loads((folder / "speculators" / "config.json").read_text())["draft_vocab_size"] == size
    assert torch.equal(torch.arange(size) + state["d2t"], ids) and torch.equal(state["t2d"].nonzero().view(-1), ids)
    assert state["lm_head.weight"].shape[0] == size  # every kind stores its pruned head
    if kind == "dspark":
        assert state["markov_head.markov_w2.weight"].shape[0] == size
    if kind == "eagle3":
        sglang = load_file(str(folder / "sglang_eagle3" / "model.safetensors"))
        assert sglang["lm_head.weight"].shape[0] == size and torch.equal(torch.arange(size) + sglang["d2t"], ids)
    model, _ = read_speculators(folder / "speculators", target[0])
    assert torch.equal(model.draft_vocab, ids)
    speculators_or_skip()
    from speculators import SpeculatorModel

    spec = SpeculatorModel.from_pretrained(str(folder / "speculators")).eval()
    assert torch.equal(spec.t2d.nonzero().view(-1), ids) and spec.lm_head.weight.shape[0] == size
    assert torch.equal(spec.lm_head.weight, reloaded.lm_head.weight[ids])
    assert_same_maths(spec, reloaded, target[0], kind, ids)


def test_a_drafter_shipped_without_the_targets_weights_exports(tmp_path, target, val_windows, tiny_target_dir):
    """A shipped drafter (saved without the target's embeddings and head: they load from the target)
    shares them with a target that ties the two, one tensor under two names, which saving refuses;
    the export gives it copies of its own, and the gate passes."""
    from drafters.target_io import save_without_target_io, shares_target_io
    from recipes.export import export_drafter

    assert target[0].config.tie_word_embeddings
    folder, drafter = drafter_folder(tmp_path, target, val_windows, "eagle3")
    save_without_target_io(drafter, folder, dtype=torch.float32)
    assert shares_target_io(folder)
    manifest = export_drafter(export_recipe(folder, tmp_path / "export", tiny_target_dir), *target)
    assert manifest["gate"]["passed"] and manifest["gate"]["logits_max_abs_diff"] == 0.0
