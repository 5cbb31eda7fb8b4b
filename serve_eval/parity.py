"""The train-to-serve parity gate: an export is final only if what was written behaves like what was trained.

The failures reported against drafter trainers are drafters that score well in training and accept
about one token when served: a shifted layer index, a wrong mask, an untied or foreign LM head. Each
of those changes the drafter's logits for the same target context, so the gate compares logits, and
then measures acceptance in the real decoding loop:

``target_io``
    the drafter's embeddings and LM head equal the target's (they were copied in frozen; a serving
    engine reuses the target's).
``logits/<format>``
    every exported format is read back from disk (``transformers`` with ``AutoModel``; ``speculators``
    and ``sglang_eagle3`` through :mod:`drafters.export`'s readers) and run on a fixed batch. Its
    target features are computed **from the layer ids the folder declares, in that format's own
    convention** (speculators: input of layer i, read with forward *pre*-hooks; SGLang: SGLang's own
    rule, input of layer i + 1), independently of the hooks training used. The drafts' logits must
    equal the trained model's within ``logits_atol`` (0 by default on CPU: same weights, same maths).
``acceptance``
    the reloaded ``transformers`` drafter runs in the speculative-decoding loop
    (:func:`serve_eval.loop.speculative_generate`, greedy, every draft verified: what the
    simulation replays) on the evaluation prompts; the measured
    acceptance length must match the simulated tau recorded at training: ``|(measured - 1) - (simulated
    - 1)| <= tau_rel_tolerance * (simulated - 1) + tau_abs_tolerance``. Greedy decoding also checks the
    output equals plain decoding (lossless).

:func:`run_gate` returns a record with every check's numbers and ``passed``; the caller refuses to
publish on failure unless overridden.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from distill.base.decoding import GateSettings
from distill.base.features import FeatureCapture, decoder_layers, final_norm
from drafters import is_block_drafter
from drafters.masks import sample_anchors


@contextmanager
def layer_inputs(target, input_ids_of_layers: list[int]):
    """Capture the *input* of decoder layer i for each i (i = num_layers: the input of the final norm)."""
    layers = decoder_layers(target)
    n = len(layers)
    bad = [i for i in input_ids_of_layers if not 0 <= i <= n]
    if bad:
        raise ValueError(f"layer ids {bad} are outside 0..{n} for a target with {n} layers")
    captured: dict = {}

    def grab(i):
        def hook(_module, args, kwargs):
            captured[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    handles = [
        (final_norm(target) if i == n else layers[i]).register_forward_pre_hook(grab(i), with_kwargs=True)
        for i in input_ids_of_layers
    ]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def features_from_inputs(target, ids: torch.Tensor, input_layer_ids: list[int]) -> torch.Tensor:
    with layer_inputs(target, input_layer_ids) as captured:
        base = getattr(target, "model", None) or target.base_model
        base(input_ids=ids, use_cache=False)
    return torch.cat([captured[i] for i in input_layer_ids], dim=-1)


def fixed_batch(prompts: list[torch.Tensor], vocab_size: int, settings: GateSettings) -> torch.Tensor:
    """``batch_size`` windows of ``seq_len`` tokens: the evaluation prompts, concatenated and cut, padded
    with seeded random tokens when they are short."""
    need = settings.batch_size * settings.seq_len
    flat = torch.cat([p.flatten().cpu() for p in prompts]) if prompts else torch.empty(0, dtype=torch.long)
    if flat.numel() < need:
        gen = torch.Generator().manual_seed(settings.seed)
        flat = torch.cat([flat, torch.randint(0, vocab_size, (need - flat.numel(),), generator=gen)])
    return flat[:need].view(settings.batch_size, settings.seq_len)


@torch.no_grad()
def draft_logits(
    drafter, ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor, anchors: torch.Tensor | None
) -> torch.Tensor:
    """What decoding would draft for a fixed batch (at fixed anchors, for block drafters)."""
    drafter.eval()
    kwargs = {"anchors": anchors} if is_block_drafter(drafter) else {}
    return drafter(ids, aux, last, **kwargs).draft_logits.float()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, where equal entries (the -inf of tokens outside a draft vocabulary) differ by 0."""
    if a.shape != b.shape:
        return float("inf")
    return torch.where(a == b, 0.0, (a - b).abs()).max().item()


@torch.no_grad()
def run_gate(  # noqa: PLR0915 the gate's checks, in order
    trained,
    target,
    prompts: list[torch.Tensor],
    folders: dict,
    simulated_tau: float | None,
    max_new_tokens: int,
    eos_token_id: int | None,
    settings: GateSettings | None = None,
) -> dict:
    """Check every exported folder in ``folders`` (format -> path) against the ``trained`` drafter.

    ``prompts`` are encoded evaluation prompts (1-D token tensors on the target's device)."""
    from transformers import AutoModel

    from distill.base.decoding import DecodingSection
    from drafters.export import read_sglang_eagle3, read_speculators
    from serve_eval.loop import speculative_generate
    from serve_eval.measure import measure
    from serve_eval.sampling import Sampler

    settings = settings or GateSettings()
    device = next(target.parameters()).device
    trained = trained.to(device).eval()
    checks: dict = {}

    # --- target_io
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    io_ok = torch.equal(trained.embed_tokens.weight, emb.to(trained.embed_tokens.weight.dtype)) and torch.equal(
        trained.lm_head.weight, head.to(trained.lm_head.weight.dtype)
    )
    checks["target_io"] = {
        "passed": io_ok,
        "detail": "embeddings and LM head equal the target's"
        if io_ok
        else "the drafter's embeddings or LM head differ from the target's (untied head or another target)",
    }

    # --- logits on a fixed batch, for every exported format
    ids = fixed_batch(prompts, trained.config.vocab_size, settings).to(device)
    reference_feats = FeatureCapture(target, trained.config.target_layer_ids)(ids)
    gen = torch.Generator().manual_seed(settings.seed)
    anchors = sample_anchors(
        ids.shape[1], trained.config.block_size, trained.config.num_anchors, ids.shape[0], device, gen
    )
    reference = draft_logits(trained, ids, reference_feats.aux, reference_feats.last, anchors)
    reloaded = None
    for fmt, folder in folders.items():
        if fmt == "transformers":
            reloaded = AutoModel.from_pretrained(folder).to(device).eval()
            same_type = type(reloaded) is type(trained)
            aux = FeatureCapture(target, reloaded.config.target_layer_ids)(ids).aux
            logits = draft_logits(reloaded, ids, aux, reference_feats.last, anchors) if same_type else None
            declared = {
                "target_layer_ids": reloaded.config.target_layer_ids,
                "convention": reloaded.config.layer_id_convention,
            }
        elif fmt == "speculators":
            model, config = read_speculators(folder, target)
            spec_ids = config.get("aux_hidden_state_layer_ids") or config["eagle_aux_hidden_state_layer_ids"]
            aux = features_from_inputs(target, ids, spec_ids)  # speculators: id i = input of layer i
            logits = draft_logits(model.to(device), ids, aux, reference_feats.last, anchors)
            declared = {"aux_layer_ids": spec_ids, "convention": "input_of_layer (speculators)"}
        elif fmt == "sglang_eagle3":
            model, config = read_sglang_eagle3(folder, block_size=trained.config.block_size)
            sg_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            aux = features_from_inputs(target, ids, [i + 1 for i in sg_ids])  # SGLang captures before layer i + 1
            logits = draft_logits(model.to(device), ids, aux, reference_feats.last, anchors)
            declared = {"eagle_aux_hidden_state_layer_ids": sg_ids, "convention": "output_of_layer (SGLang)"}
        else:
            raise ValueError(f"unknown export format {fmt!r}")
        diff = float("inf") if logits is None else _max_abs(logits, reference)
        checks[f"logits/{fmt}"] = {
            "passed": diff <= settings.logits_atol,
            "max_abs_diff": diff,
            "atol": settings.logits_atol,
            "declared": declared,
            "folder": str(folder),
        }

    # --- acceptance in the decoding loop, with the drafter reloaded from disk
    if reloaded is None:
        raise ValueError("the parity gate needs the transformers export (format 'transformers') to run the engine")
    speculative_generate(target, reloaded, prompts[0], 4, eos_token_id)  # warm-up, as every benchmark here
    # every draft verified: the simulated tau replays exactly that (a budget, or the draft switch, would
    # make the measured tau a property of this machine's costs rather than of the drafter)
    run = measure(
        target,
        reloaded,
        prompts,
        DecodingSection(max_new_tokens=max_new_tokens, budget={"adaptive": False}),
        eos_token_id,
        lambda i: Sampler(),
        None,
    )
    measured, lossless = run["tau"], run["lossless"]
    acceptance = {
        "measured_tau": measured,
        "simulated_tau": None if simulated_tau is None else round(simulated_tau, 4),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "lossless": lossless,
        "speedup": run["speedup"],
        "acceptance_by_position": run["acceptance_by_position"],
        "rel_tolerance": settings.tau_rel_tolerance,
        "abs_tolerance": settings.tau_abs_tolerance,
    }
    if simulated_tau is None:
        acceptance.update(passed=False, detail="no simulated tau was recorded for this checkpoint at training")
    else:
        allowed = settings.tau_rel_tolerance * max(simulated_tau - 1.0, 0.0) + settings.tau_abs_tolerance
        gap = abs(measured - simulated_tau)
        acceptance.update(passed=gap <= allowed and lossless, gap=round(gap, 4), allowed_gap=round(allowed, 4))
    checks["acceptance"] = acceptance
    failed = [name for name, c in checks.items() if not c["passed"]]
    return {
        "passed": not failed,
        "failed": failed,
        "checks": checks,
        "measured_tau": acceptance["measured_tau"],
        "simulated_tau": acceptance["simulated_tau"],
        "logits_max_abs_diff": max(
            (c["max_abs_diff"] for k, c in checks.items() if k.startswith("logits/")), default=None
        ),
    }


def describe_check(name: str, c: dict) -> str:
    """One gate check in words (the failure message and the model card both use it)."""
    if name.startswith("logits/"):
        return f"max |diff| of the drafts {c['max_abs_diff']:.3g} (tolerance {c['atol']}); declared {c['declared']}"
    if name == "acceptance":
        return (
            f"measured tau {c['measured_tau']} vs simulated {c['simulated_tau']} (gap {c.get('gap')}, allowed "
            f"{c.get('allowed_gap')}), lossless {c['lossless']}" + (f"; {c['detail']}" if "detail" in c else "")
        )
    return str(c.get("detail", ""))


def describe_failure(result: dict) -> str:
    return "\n".join(f"{name}: {describe_check(name, result['checks'][name])}" for name in result["failed"])
