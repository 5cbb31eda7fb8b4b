"""Recipe ``export``: publish a trained drafter in the formats serving engines load, behind a parity gate.

One export folder (written as ``<output_dir>.tmp`` and renamed only when complete and gated, so a crash
or a refusal never leaves a half export under the final name)::

    <output_dir>/
      README.md         model card: target, recipe, data fingerprint, gate, measured tau/speedup, serving
      export.json       manifest: every format's folder (or why the drafter cannot be expressed in it),
                        the gate's record, the source run
      transformers/     draftsmith's own folder (AutoModel.from_pretrained after `import drafters`) + tokenizer
      speculators/      vLLM speculators format (DFlash, DSpark, EAGLE-3)
      sglang_eagle3/    SGLang / SpecForge EAGLE-3 format (EAGLE-3 only)

Before the folder is published the parity gate (:mod:`serve_eval.parity`) reloads every format from
disk and requires equal logits and a measured acceptance length that matches the simulated one
recorded at training; on failure the export is refused (exit status 3) unless
``gate.allow_failure: true``, which publishes it with the failure printed and written into the card.

``push_to_hub.enabled: true`` uploads it in one commit (``huggingface_hub``): the primary format's
files at the repository root (so ``vllm serve REPO`` finds ``config.json``), the other formats in
their sub-folders, the card and manifest at the root. The upload plan is built (and tested) offline.

    draftsmith export --drafter runs/quickstart/drafter/checkpoints/best --output-dir runs/quickstart/export
    draftsmith run recipes/configs/export_testbed.yaml drafter=runs/eagle3_testbed/checkpoints/best
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from distill.checkpoint import write_atomically
from distill.config import ExportRecipe, RecipeError
from distill.runtime import set_threads


class ExportRefused(RuntimeError):
    """The parity gate failed and no override was given; ``gate`` holds its record."""

    def __init__(self, message: str, gate: dict | None = None):
        super().__init__(message)
        self.gate = gate


# --------------------------------------------------------------------------------------------------
# The upload plan (offline) and the upload (on request)
# --------------------------------------------------------------------------------------------------


def upload_plan(
    export_dir: str | Path,
    repo_id: str,
    private: bool = True,
    revision: str | None = None,
    primary_format: str = "speculators",
) -> dict:
    """Which local file goes where in the repository: ``{"repo_id", "private", "revision", "files":
    [(local_path, path_in_repo), ...]}``. The primary format's files sit at the root."""
    export_dir = Path(export_dir)
    manifest = json.loads((export_dir / "export.json").read_text())
    folders = {fmt: rec["folder"] for fmt, rec in manifest["formats"].items() if rec.get("folder")}
    if primary_format not in folders:
        raise ValueError(f"primary format {primary_format!r} was not exported (exported: {sorted(folders)})")
    files = [(str(export_dir / name), name) for name in ("README.md", "export.json")]
    for fmt, folder in sorted(folders.items()):
        for f in sorted((export_dir / folder).rglob("*")):
            if f.is_file():
                rel = f.relative_to(export_dir / folder).as_posix()
                files.append((str(f), rel if fmt == primary_format else f"{folder}/{rel}"))
    targets = [p for _, p in files]
    clashes = sorted({p for p in targets if targets.count(p) > 1})
    if clashes:
        raise ValueError(f"upload plan writes {clashes} twice")
    return {
        "repo_id": repo_id,
        "private": private,
        "revision": revision,
        "primary_format": primary_format,
        "files": files,
    }


def commit_operations(plan: dict) -> list:
    from huggingface_hub import CommitOperationAdd

    return [CommitOperationAdd(path_in_repo=dest, path_or_fileobj=src) for src, dest in plan["files"]]


def push_to_hub(plan: dict, commit_message: str, api=None) -> str:
    """Create the repository (and branch) if needed and upload the plan in one commit; returns its URL."""
    from huggingface_hub import HfApi

    api = api or HfApi()
    api.create_repo(plan["repo_id"], private=plan["private"], exist_ok=True, repo_type="model")
    if plan["revision"]:
        api.create_branch(plan["repo_id"], branch=plan["revision"], exist_ok=True)
    info = api.create_commit(
        plan["repo_id"], operations=commit_operations(plan), commit_message=commit_message, revision=plan["revision"]
    )
    return str(getattr(info, "commit_url", info))


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


def export_drafter(recipe, target=None, tokenizer=None) -> dict:  # noqa: PLR0915 the export's steps, in order
    """Write, gate and publish the export folder of ``recipe.drafter``; returns the manifest."""
    import drafters  # noqa: F401
    from distill.models import load_target
    from distill.regenerate import encoded_prompts
    from drafters.export import (
        FORMATS,
        check_expressible,
        formats_for,
        kind_of,
        recorded_simulated_tau,
        source_record,
        write_sglang_eagle3,
        write_speculators,
    )
    from drafters.target_io import own_target_io
    from recipes.evaluate import draft_vocabulary, load_drafter
    from serve_eval.parity import describe_failure, run_gate

    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if target is None:
        target, tokenizer = load_target(recipe.target, device)
    trained = own_target_io(load_drafter(recipe.drafter, target, device))  # a shipped drafter shares the target's
    cfg = trained.config
    kind = kind_of(cfg)
    if recipe.draft_vocab > cfg.vocab_size:
        raise RecipeError(
            f"draft_vocab = {recipe.draft_vocab} exceeds the target's vocabulary ({cfg.vocab_size} tokens)"
        )
    possible = formats_for(cfg)
    if recipe.formats is None:
        wanted = [f for f, reason in possible.items() if reason is None]
    else:
        wanted = list(recipe.formats)
        for fmt in wanted:
            check_expressible(cfg, fmt)  # an explicit request for an impossible format is an error
    if "transformers" not in wanted:
        wanted.insert(0, "transformers")  # the gate runs the engine on it
    record = source_record(recipe.drafter)
    simulated = recipe.gate.simulated_tau if recipe.gate.simulated_tau is not None else recorded_simulated_tau(record)
    verifier = recipe.verifier_name_or_path or cfg.target_name_or_path or recipe.target.path
    prompts = encoded_prompts(
        recipe.prompts, recipe.data, recipe.seed, tokenizer, device, recipe.target.chat_template_kwargs
    )
    vocab_record = (
        draft_vocabulary(
            trained,
            target,
            tokenizer,
            recipe.draft_vocab,
            recipe.draft_vocab_prompts,
            recipe.data,
            recipe.seed,
            recipe.prompts.prompt_tokens,
            recipe.gate.max_new_tokens,
        )
        if recipe.draft_vocab
        else None
    )
    out = Path(recipe.output_dir)
    manifest: dict = {}

    def write(tmp: Path) -> None:
        folders = {}
        trained.save_pretrained(tmp / "transformers")
        tokenizer.save_pretrained(tmp / "transformers")
        folders["transformers"] = tmp / "transformers"
        if "speculators" in wanted:
            write_speculators(trained, target.config, verifier, tmp / "speculators")
            folders["speculators"] = tmp / "speculators"
        if "sglang_eagle3" in wanted:
            write_sglang_eagle3(trained, target.config, tmp / "sglang_eagle3")
            folders["sglang_eagle3"] = tmp / "sglang_eagle3"
        gate = run_gate(
            trained,
            target,
            prompts,
            folders,
            simulated,
            recipe.gate.max_new_tokens,
            tokenizer.eos_token_id,
            recipe.gate,
        )
        gate["overridden"] = not gate["passed"] and recipe.gate.allow_failure
        manifest.update(
            {
                "kind": kind,
                "drafter": str(Path(recipe.drafter).resolve()),
                "target": recipe.target.path,
                "verifier_name_or_path": verifier,
                "formats": {
                    fmt: (
                        {"folder": fmt, "checked_with": CHECKED_WITH[fmt]}
                        if fmt in folders
                        else {"folder": None, "not_exported": possible[fmt] or "not requested"}
                    )
                    for fmt in FORMATS
                },
                "gate": gate,
                "draft_vocab": vocab_record,
                "source": {k: v for k, v in record.items() if k != "provenance"},
                "data_fingerprint": ((record.get("provenance") or {}).get("data") or {}).get("data_fingerprint"),
                "git": (record.get("provenance") or {}).get("git"),
                "eval_reports": [_report_row(p) for p in recipe.eval_reports],
                "seconds": None,
            }
        )
        if not gate["passed"]:
            message = describe_failure(gate)
            if not recipe.gate.allow_failure:
                raise ExportRefused(
                    f"parity gate failed, export refused ({out} not written; inspect {tmp}):\n{message}", gate
                )
            banner = "!" * 78
            print(
                f"{banner}\nPARITY GATE FAILED, EXPORT PUBLISHED ANYWAY (gate.allow_failure=true):\n{message}\n{banner}",
                file=sys.stderr,
            )
        manifest["seconds"] = round(time.perf_counter() - t0, 1)
        (tmp / "export.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(model_card(manifest, cfg, recipe))

    write_atomically(None, out, write)
    manifest["output_dir"] = str(out)
    if recipe.wandb.enabled:
        manifest["wandb_run"] = track_export(recipe, manifest)
    if recipe.push_to_hub.enabled:
        plan = upload_plan(
            out,
            recipe.push_to_hub.repo_id,
            recipe.push_to_hub.private,
            recipe.push_to_hub.revision,
            recipe.push_to_hub.primary_format,
        )
        manifest["hub_url"] = push_to_hub(plan, recipe.push_to_hub.commit_message)
    return manifest


def track_export(recipe, manifest: dict) -> dict:
    """A wandb run (job type ``export``) with the resolved recipe, the gate's numbers, its
    acceptance-by-position table and plot, the export folder as an artifact (aliases ``export`` and
    ``gate-passed``/``gate-failed``) and links to the drafter's and the target's runs. Its record goes
    to ``<output_dir>.wandb_run.json`` (the export folder itself is final and not rewritten)."""
    import wandb

    from distill.provenance import write_json_atomic
    from distill.runtime import model_artifact_name, upstream_runs

    out = Path(recipe.output_dir)
    config = recipe.model_dump(mode="json")
    upstream = upstream_runs(config)
    wandb_dir = out.parent / f"{out.name}.wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=recipe.wandb.project,
        entity=recipe.wandb.entity,
        name=recipe.wandb.name or f"export-{out.name}",
        tags=recipe.wandb.tags,
        job_type="export",
        dir=str(wandb_dir),
        config={**config, "upstream_runs": upstream},
    )
    try:
        gate, acc = manifest["gate"], manifest["gate"]["checks"]["acceptance"]
        table = wandb.Table(
            columns=["position", "acceptance"], data=[[k + 1, a] for k, a in enumerate(acc["acceptance_by_position"])]
        )
        run.log(
            {
                "gate/acceptance_by_position": table,
                "gate/acceptance_plot": wandb.plot.bar(
                    table, "position", "acceptance", title="served drafter: acceptance"
                ),
                "gate/measured_tau": acc["measured_tau"],
                "gate/simulated_tau": acc["simulated_tau"],
                "gate/speedup": acc.get("speedup"),
                "gate/logits_max_abs_diff": gate["logits_max_abs_diff"],
                "gate/passed": int(gate["passed"]),
            }
        )
        for role, link in upstream.items():
            run.summary[f"upstream/{role}"] = link.get("url") or link["id"]
        artifact = wandb.Artifact(
            model_artifact_name(run.name),
            type="model",
            metadata={
                "gate": {
                    k: gate[k] for k in ("passed", "failed", "measured_tau", "simulated_tau", "logits_max_abs_diff")
                }
            },
        )
        artifact.add_dir(str(out))
        run.log_artifact(artifact, aliases=["export", "gate-passed" if gate["passed"] else "gate-failed"])
        record = {
            "id": run.id,
            "project": run.project,
            "entity": run.entity,
            "name": run.name,
            "url": getattr(run, "url", None),
            "upstream_runs": upstream,
        }
    finally:
        run.finish()
    write_json_atomic(out.parent / f"{out.name}.wandb_run.json", record)
    return record


CHECKED_WITH = {
    "transformers": "reloaded with transformers AutoModel.from_pretrained; logits and decoding-loop acceptance (parity gate)",
    "speculators": "read back by draftsmith with features from the declared ids (input-of-layer, pre-hooks); logits "
    "(parity gate); tests load it with speculators 0.9.0 SpeculatorModel.from_pretrained (key sets, "
    "tensors, module-level forward)",
    "sglang_eagle3": "read back by draftsmith with features from the declared ids (SGLang's rule: capture before layer "
    "i + 1); logits (parity gate); names checked against SGLang's llama_eagle3.py loader and "
    "SpecForge's LlamaForCausalLMEagle3 (SGLang not run here: no GPU)",
}


def _report_row(path: str) -> dict:
    report = json.loads(Path(path).read_text())
    return {
        "report": str(path),
        "prompts": report.get("prompts"),
        "max_new_tokens": report.get("max_new_tokens"),
        "mode": report.get("mode"),
        "temperature": report.get("temperature"),
        "tau": report.get("tau"),
        "speedup": report.get("speedup"),
        "lossless": report.get("lossless"),
        "device": report.get("device"),
        "torch_threads": report.get("torch_threads"),
    }


def _vocab_line(record: dict | None) -> str:
    if not record:
        return "the whole vocabulary"
    return (
        f"{record['size']} of {record['of']} tokens (`d2t` / `t2d`; {record['coverage']:.1%} of {record['source']}; "
        "tokens outside it are never drafted, the output is unchanged)"
    )


def model_card(manifest: dict, cfg, recipe) -> str:
    from serve_eval.parity import describe_check

    gate = manifest["gate"]
    acc = gate["checks"]["acceptance"]
    kind = manifest["kind"]
    status = "PASSED" if gate["passed"] else "FAILED (published anyway: gate.allow_failure)"
    base = manifest["verifier_name_or_path"]
    lines = [
        "---",
        "library_name: draftsmith",
        "tags:",
        "- speculative-decoding",
        f"- {kind}",
        f"base_model: {base}",
        "---",
        "",
        f"# {kind} drafter for `{base}`",
        "",
        f"A {kind} speculative-decoding drafter ({cfg.num_hidden_layers} layer(s), block size {cfg.block_size}, "
        f"{cfg.block_size - 1} drafted tokens per step) trained by draftsmith against the target `{manifest['target']}`.",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{manifest['target']}` (verifier recorded for serving: `{base}`) |",
        f"| target layers | {cfg.target_layer_ids} (draftsmith: output of layer i) |",
        f"| recipe | `{manifest['source'].get('recipe_file')}` |",
        f"| checkpoint | `{manifest['source'].get('checkpoint')}` |",
        f"| data fingerprint | `{manifest.get('data_fingerprint')}` |",
        f"| draft vocabulary | {_vocab_line(manifest.get('draft_vocab'))} |",
        f"| code | {manifest.get('git')} |",
        "",
        f"## Parity gate: {status}",
        "",
        "Every format below was reloaded from disk and its drafts compared with the trained model's on a fixed batch; "
        "the reloaded drafter then ran in draftsmith's lossless decoding loop.",
        "",
        "| check | result |",
        "|---|---|",
    ]
    lines += [
        f"| {name} | {'pass' if check['passed'] else 'FAIL'}: {describe_check(name, check)} |"
        for name, check in gate["checks"].items()
    ]
    lines += [
        "",
        "## Measured acceptance length and speedup",
        "",
        "| prompt set | prompts | new tokens | mode | T | tau | speedup | lossless |",
        "|---|---|---|---|---|---|---|---|",
        f"| parity gate (`{recipe.prompts.file or f'{recipe.prompts.from_corpus} corpus snippets, {recipe.prompts.split}'}`) | "
        f"{acc['prompts']} | {acc['max_new_tokens']} | chain | 0 | {acc['measured_tau']} | {acc.get('speedup')} | {acc['lossless']} |",
    ]
    for row in manifest["eval_reports"]:
        lines.append(
            f"| `{row['report']}` | {row['prompts']} | {row['max_new_tokens']} | {row['mode']} | {row['temperature']} | "
            f"{row['tau']} | {row['speedup']} | {row['lossless']} |"
        )
    lines += [
        "",
        "Speedups are against plain decoding of the same target on the same machine "
        f"({'GPU' if torch.cuda.is_available() else 'CPU, 1 thread'}); they depend on the hardware.",
        "",
        "## Formats",
        "",
        "| format | folder | checked with |",
        "|---|---|---|",
    ]
    for fmt, rec in manifest["formats"].items():
        lines.append(
            f"| {fmt} | `{rec['folder']}/` | {rec['checked_with']} |"
            if rec["folder"]
            else f"| {fmt} | not exported | {rec['not_exported']} |"
        )
    K = cfg.block_size
    lines += ["", "## Serving", "", "Commands (not run by draftsmith; no GPU where it was exported):", ""]
    if manifest["formats"]["speculators"]["folder"]:
        lines += [
            "vLLM (speculators format; the verifier is read from `speculators_config`):",
            "",
            "```bash",
            "vllm serve speculators/   # or the hub repository, whose root holds this format",
            "```",
            "",
        ]
    if manifest["formats"]["sglang_eagle3"]["folder"]:
        lines += [
            "SGLang (EAGLE-3):",
            "",
            "```bash",
            f"python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE3 \\",
            f"  --speculative-draft-model-path sglang_eagle3/ --speculative-num-steps {K - 1} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {K}",
            "```",
            "",
        ]
    lines += [
        "draftsmith (the reference loop):",
        "",
        "```bash",
        f"draftsmith eval --drafter transformers/ --target {manifest['target']}",
        "```",
        "",
    ]
    return "\n".join(lines)


SCHEMA = ExportRecipe


def main(recipe, dry_run: bool = False) -> dict:
    set_threads(recipe.torch_threads)
    if dry_run:
        from transformers import AutoConfig

        import drafters  # noqa: F401
        from drafters.export import formats_for

        cfg = AutoConfig.from_pretrained(recipe.drafter)
        return {"drafter": recipe.drafter, "kind": cfg.model_type, "formats": formats_for(cfg)}
    manifest = export_drafter(recipe)
    gate = manifest["gate"]
    print(f"\n== export ({manifest['kind']}) -> {manifest['output_dir']} ==")
    for fmt, rec in manifest["formats"].items():
        print(f"  {fmt:<14} {rec['folder'] or 'not exported: ' + rec['not_exported']}")
    print(
        f"  parity gate    {'passed' if gate['passed'] else 'FAILED'}: measured tau {gate['measured_tau']} vs simulated "
        f"{gate['simulated_tau']}, logits max abs diff {gate['logits_max_abs_diff']}"
    )
    return manifest
