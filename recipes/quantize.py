"""Recipe ``quantize``: full precision vs PTQ vs QAT of one trained drafter or causal LM, per scheme.

Given a trained folder (``model:``; a DFlash / DSpark / EAGLE-3 drafter or any causal LM: a student,
the testbed target, a Parcae model once it saves as a transformers folder) and one or more
``variants`` (a scheme, a group size and an optional per-layer map each), one run writes the whole
comparison. The models of each table (torchao's convention, made compute-fair):

    full      the trained model as given (0 extra steps)
    full_ft   full precision fine-tuned ``train.max_steps`` more steps on ``data`` (compute_matched)
    ptq       ``full`` quantized as is
    ptq_ft    ``full_ft`` quantized as is: the PTQ baseline with the same compute as QAT (compute_matched)
    qat       ``full`` fine-tuned ``train.max_steps`` steps with fake quantization (same data, optimizer,
              seed and sample order as ``full_ft``), then converted to real quantized weights

``recovered = (qat - ptq_ft) / (full_ft - ptq_ft)`` on the primary metric (drafters: simulated tau on
held-out windows; LMs: held-out loss), i.e. the share of the quantization gap QAT wins back against
the baseline that had equal compute; ``recovered_vs_original`` uses ``full`` and ``ptq`` instead
(torchao's usual comparison, which credits QAT with its extra steps). When ``full - ptq`` is tiny
(4-bit and wider on small models) the ratio is noise: read the ``gap`` column first.

Drafters are also run in the speculative-decoding loop against their (untouched, full-precision)
target: measured tau, tokens/s and speedup vs plain decoding, and ``lossless`` (greedy output equals
plain decoding); LMs decode the same prompts on their own (tokens/s). Outputs in ``output_dir``:
``quant_report.{json,md,png}``, ``summary.json``, ``<variant>/model_quantized`` (the QAT model,
reloadable with :func:`distill.quantize.load_quantized`), and the fine-tuning runs' folders
(``full_ft/``, ``<variant>/qat/``, each resumable). Launch::

    draftsmith run recipes/configs/quantize_dflash_testbed.yaml model=runs/dflash_testbed/checkpoints/best
    draftsmith run recipes/configs/quantize_lm_testbed.yaml
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from distill.base.decoding import DecodingSection
from distill.config import PromptsSection, QuantizeRecipe, RecipeError
from distill.data import load_text_splits, make_windows, tokenizer_fingerprint
from distill.provenance import write_json_atomic, write_run_header
from distill.quantize import (
    check_hardware,
    convert,
    fake_quant_hook,
    model_bytes,
    prepare_qat,
    ptq,
    resolve_layer_map,
    save_quantized,
    set_fake_quant,
)
from distill.runtime import end_run, init_tracking, make_accelerator, set_threads
from distill.trainer import Trainer
from recipes.quant_report import quant_report, recovered


class Subject:
    """The model being quantized, with its data, loss, evaluation and decoding measurement."""

    def __init__(self, recipe: QuantizeRecipe, device):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        import drafters  # (and registers the drafter configs and models with the Auto classes)
        import parcae  # noqa: F401  (registers Parcae with AutoModelForCausalLM)

        self.recipe = recipe
        self.device = device
        config = AutoConfig.from_pretrained(recipe.model)
        self.is_drafter = drafters.kind_of(config) is not None
        if self.is_drafter:
            from distill.base.features import FeatureCapture
            from distill.models import load_target
            from recipes.evaluate import load_drafter

            self.target, self.tokenizer = load_target(recipe.target, device)
            self.model = load_drafter(recipe.model, self.target, device).train()
            self.capture = FeatureCapture(self.target, self.model.config.target_layer_ids)
            self.metric, self.greater = "val_simulated_tau", True
            self.exclude = ("embed_tokens", "lm_head")  # copies of the target's, shared when served
            self.loss_fn = self._drafter_loss
        else:
            self.model = AutoModelForCausalLM.from_pretrained(recipe.model, dtype=torch.float32).to(device).train()
            self.tokenizer = AutoTokenizer.from_pretrained(recipe.model)
            self.metric, self.greater = "val_loss", False
            self.exclude = ()
            from distill.lm import lm_loss
            from parcae.training import parcae_lm_loss

            # a Parcae model fine-tunes with per-sequence depths, as it was trained
            self.loss_fn = parcae_lm_loss(recipe.seed) if config.model_type == "draftsmith_parcae" else lm_loss

    # ----------------------------------------------------------------------------------------------
    def load_data(self, acc) -> None:
        r = self.recipe
        with acc.main_process_first():
            splits = load_text_splits(r.data, r.seed)
            self.train = make_windows(splits.train, self.tokenizer, r.data, "train", r.seed)
            self.val = make_windows(splits.val, self.tokenizer, r.data, "val", r.seed)
        self.data_record = {
            "description": splits.description,
            "data_fingerprint": splits.fingerprint,
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer),
        }
        self.prompts = self._encode_prompts() if r.measure.prompts else []

    def _encode_prompts(self) -> list[torch.Tensor]:
        from distill.regenerate import encoded_prompts

        r = self.recipe
        section = PromptsSection(from_corpus=r.measure.prompts, split="val", prompt_tokens=r.measure.prompt_tokens)
        return encoded_prompts(section, r.data, r.seed, self.tokenizer, self.device)

    def _drafter_loss(self, model, batch):
        from distill.feature_cache import batch_features

        out = model(*batch_features(batch, self.capture), loss_mask=batch.loss_mask)
        return out.loss, out.logs or {}

    def evaluate(self, model, acc=None) -> dict:
        bs, nb = self.recipe.train.micro_batch_size, self.recipe.train.eval_batches
        if self.is_drafter:
            from distill.drafter_eval import evaluate_drafter

            return evaluate_drafter(model, self.capture, self.val, bs, nb, acc)
        from distill.base.lm import evaluate_lm

        return evaluate_lm(model, self.val, bs, nb, acc)

    def flops_per_token(self, model) -> float:
        if self.is_drafter:
            from recipes.train_drafter import drafter_flops_per_token

            return drafter_flops_per_token(model, self.target, self.recipe.data.seq_len)
        from distill.base.flops import flops_per_token

        return flops_per_token(model, self.recipe.data.seq_len)

    @torch.no_grad()
    def decode(self, model) -> dict:
        """Drafters: the speculative loop against plain decoding of the target; LMs: plain decoding."""
        if not self.prompts:
            return {}
        from serve_eval.loop import plain_generate, speculative_generate
        from serve_eval.sampling import Sampler

        model.eval()
        eos = self.tokenizer.eos_token_id
        m = self.recipe.measure
        if self.is_drafter:
            from serve_eval.measure import measure

            speculative_generate(self.target, model, self.prompts[0], 4, eos)  # warm-up
            dec = DecodingSection(max_new_tokens=m.max_new_tokens, temperature=0.0, mode="chain")
            r = measure(self.target, model, self.prompts, dec, eos, lambda i: Sampler(), None)
            return {
                "measured_tau": r["tau"],
                "tokens_per_s": r["tokens_per_s"],
                "baseline_tokens_per_s": r["baseline_tokens_per_s"],
                "speedup": r["speedup"],
                "lossless": r["lossless"],
                "draft_fraction": r["time_split"]["draft_fraction"],
            }
        # each prompt is decoded by the given model and by the full-precision one back to back, so load on
        # a shared machine hits both alike: speed_vs_full is the robust number, tokens_per_s the raw one
        self.model.eval()
        plain_generate(model, self.prompts[0], 4, eos), plain_generate(self.model, self.prompts[0], 4, eos)  # warm-up
        tokens = seconds = ref_tokens = ref_seconds = 0
        sample = None
        for p in self.prompts:
            out, stats = plain_generate(model, p, m.max_new_tokens, eos)
            _, ref = plain_generate(self.model, p, m.max_new_tokens, eos)
            tokens, seconds = tokens + stats.tokens, seconds + stats.total_seconds
            ref_tokens, ref_seconds = ref_tokens + ref.tokens, ref_seconds + ref.total_seconds
            sample = sample or self.tokenizer.decode(out)[:120]
        speed, ref_speed = tokens / seconds, ref_tokens / ref_seconds
        return {
            "tokens_per_s": round(speed, 2),
            "full_tokens_per_s": round(ref_speed, 2),
            "speed_vs_full": round(speed / ref_speed, 4),
            "sample": sample,
        }


SCHEMA = QuantizeRecipe


def main(recipe: QuantizeRecipe, dry_run: bool = False) -> dict:  # noqa: PLR0915 the recipe's steps, in order
    set_threads(recipe.train.torch_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    subject = Subject(recipe, device)
    model = subject.model

    ### Every variant's layer map against the real model, and the hardware, before any compute
    plans = {}
    for name, spec in recipe.variants.items():
        plans[name] = resolve_layer_map(model, spec, key=f"variants.{name}")
        check_hardware(plans[name], key=f"variants.{name}")
    if dry_run:
        return {
            "kind": "drafter" if subject.is_drafter else "lm",
            "metric": subject.metric,
            "variants": {n: p.to_json()["counts"] for n, p in plans.items()},
        }

    out = Path(recipe.output_dir)
    acc = make_accelerator(recipe.train, recipe.seed, out, recipe.wandb)
    if acc.num_processes > 1:
        raise RecipeError(
            "recipe 'quantize' runs in one process (it measures decoding speed): launch it without accelerate/torchrun"
        )
    subject.load_data(acc)
    write_run_header(
        out,
        recipe,
        data=subject.data_record,
        kind="drafter" if subject.is_drafter else "lm",
        plans={n: p.to_json() for n, p in plans.items()},
    )
    init_tracking(acc, recipe.wandb, out, recipe.model_dump(mode="json"), out.name)
    metric = subject.metric
    steps = recipe.train.max_steps

    def measure_row(m, model_kind: str, variant: str, extra_steps: int, metrics: dict | None = None) -> dict:
        t0 = time.perf_counter()
        m.eval()
        with torch.no_grad():
            metrics = metrics or subject.evaluate(m)
        row = {
            "variant": variant,
            "model": model_kind,
            "extra_steps": extra_steps,
            **model_bytes(m),
            "own_packed_bytes": model_bytes(m, subject.exclude)["packed_bytes"],
            **metrics,
            **subject.decode(m),
        }
        row["eval_seconds"] = round(time.perf_counter() - t0, 1)
        print(
            f"[quantize] {variant:>10} {model_kind:<8} {metric}={row[metric]:.4f}"
            + (f" measured_tau={row['measured_tau']:.3f}" if "measured_tau" in row else "")
            + f" packed={row['packed_bytes'] / 1e6:.2f} MB",
            flush=True,
        )
        return row

    def finetune(m, folder: Path, before_step=None):
        ft_acc = make_accelerator(recipe.train, recipe.seed, folder)  # own checkpoints, same seed and data order
        trainer = Trainer(
            accelerator=ft_acc,
            model=m,
            train_cfg=recipe.train,
            optim_cfg=recipe.optim,
            output_dir=folder,
            data=subject.train,
            loss_fn=subject.loss_fn,
            evaluate_fn=lambda mm: subject.evaluate(mm, ft_acc),
            flops_per_token=subject.flops_per_token(m),
            best_metric=metric,
            greater_is_better=subject.greater,
            before_step=before_step,
        )
        result = trainer.fit()
        return ft_acc.unwrap_model(trainer.model, keep_torch_compile=False), result

    ### Full precision, and full precision fine-tuned with the same compute QAT gets
    rows = [measure_row(model, "full", "-", 0)]
    full_ft = None
    if recipe.compute_matched:
        full_ft, _ = finetune(copy.deepcopy(model), out / "full_ft")
        rows.append(measure_row(full_ft, "full_ft", "-", steps))

    ### Per variant: PTQ, compute-matched PTQ, QAT (fine-tuned with fake quantization, converted)
    for name, spec in recipe.variants.items():
        plan = plans[name]
        q = copy.deepcopy(model)
        ptq(q, spec, plan)
        rows.append(measure_row(q, "ptq", name, 0))
        if full_ft is not None:
            q = copy.deepcopy(full_ft)
            ptq(q, spec, plan)
            rows.append(measure_row(q, "ptq_ft", name, steps))
        qat_model = copy.deepcopy(model)
        prepare_qat(qat_model, spec, plan)
        qat_model, result = finetune(
            qat_model, out / name / "qat", before_step=fake_quant_hook(qat_model, recipe.fake_quant_after_steps)
        )
        set_fake_quant(qat_model, True)
        fake_metric = result.final_eval.get(metric)
        convert(qat_model, spec, plan)
        row = measure_row(qat_model, "qat", name, steps)
        row[f"fake_quant_{metric}"] = fake_metric
        rows.append(row)
        save_quantized(
            qat_model,
            out / name / "model_quantized",
            plan,
            {"scheme": spec.scheme, "group_size": spec.group_size, "source": recipe.model, "qat_steps": steps},
            subject.tokenizer,
        )

    ### Report
    result = write_report(recipe, rows, out, subject.is_drafter)
    acc.log(
        {
            f"quant/{r['variant']}/{r['model']}/{k}": v
            for r in rows
            for k, v in r.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    )
    if recipe.wandb.enabled and acc.is_main_process:  # the tables themselves, as wandb tables
        import wandb

        for key, table in (("quant/rows", rows), ("quant/summary", result["summary"])):
            columns = list(dict.fromkeys(k for r in table for k in r))
            acc.log({key: wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in table])})
    end_run(acc)
    return result


def write_report(recipe: QuantizeRecipe, rows: list[dict], out: Path, is_drafter: bool) -> dict:
    """The per-row table, the per-variant summary (gap, recovered), the plot and ``summary.json``."""
    metric = "val_simulated_tau" if is_drafter else "val_loss"
    min_gap = recipe.min_gap if recipe.min_gap is not None else 0.01
    summary = [
        variant_summary(name, spec, rows, metric, is_drafter, min_gap)
        for name, spec in recipe.variants.items()
        if any(r["variant"] == name for r in rows)
    ]
    columns = ["variant", "model", "extra_steps", "bytes", "packed_bytes", "own_packed_bytes", metric]
    columns += (
        ["val_tau_probabilistic", "measured_tau", "tokens_per_s", "speedup", "lossless"]
        if is_drafter
        else ["val_ppl", "val_acc", "tokens_per_s", "speed_vs_full"]
    )
    title = (
        f"{'drafter' if is_drafter else 'LM'} {recipe.model}: full vs PTQ vs QAT ({recipe.train.max_steps} QAT steps; "
        f"recovered shown where |gap| >= {min_gap})"
    )
    report = quant_report(rows, out, metric, [c for c in columns if any(c in r for r in rows)], title, summary)
    print((out / "quant_report.md").read_text())
    result = {"report": str(out / "quant_report.md"), "metric": metric, "min_gap": min_gap, "summary": summary}
    write_json_atomic(out / "summary.json", {**result, "rows": report["rows"]})
    return result


def variant_summary(name: str, spec, rows: list[dict], metric: str, is_drafter: bool, min_gap: float) -> dict:
    """One line per variant: the primary metric of every model, the gap and how much QAT recovered
    (None where the gap is below ``min_gap``: a ratio of noise to noise)."""
    get = {r["model"]: r for r in rows if r["variant"] in (name, "-")}
    value = lambda kind, key=metric: get.get(kind, {}).get(key)  # noqa: E731
    matched = "full_ft" in get

    def share(full, base, qat):
        return None if None in (full, base) or abs(full - base) < min_gap else _round(recovered(full, base, qat))

    full, base = (value("full_ft"), value("ptq_ft")) if matched else (value("full"), value("ptq"))
    out = {
        "variant": name,
        "scheme": spec.scheme + (" + map" if spec.layers else ""),
        "group_size": spec.group_size,
        "packed_MB": round(get["qat"]["packed_bytes"] / 1e6, 3),
        "own_packed_MB": round(get["qat"]["own_packed_bytes"] / 1e6, 3),
        f"full {metric}": value("full"),
        f"full_ft {metric}": value("full_ft"),
        f"ptq {metric}": value("ptq"),
        f"ptq_ft {metric}": value("ptq_ft"),
        f"qat {metric}": value("qat"),
        "gap": None if None in (full, base) else round(full - base, 4),
        "recovered": share(full, base, value("qat")),
        "recovered_vs_original": share(value("full"), value("ptq"), value("qat")),
    }
    if is_drafter and value("qat", "measured_tau") is not None:  # a few hundred drafts: too noisy for a ratio
        out.update(
            {
                f"measured_tau {kind}": value(kind, "measured_tau")
                for kind in ("full", "full_ft", "ptq", "ptq_ft", "qat")
                if kind in get
            }
        )
    return out


def _round(v):
    return None if v is None else round(v, 3)
