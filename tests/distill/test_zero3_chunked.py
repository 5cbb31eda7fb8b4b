"""A drafter's chunked loss under DeepSpeed ZeRO-3 trains exactly like the whole loss without DeepSpeed.

With ``drafter.loss_chunk`` the block loss runs per chunk of positions under ``torch.utils.checkpoint``
and is recomputed in the backward. Both heads read the frozen LM head there: the drafter's through a
module call, the target's logits from ``lm_head.weight`` itself (:meth:`drafters.base.DrafterBase.target_logits`).
ZeRO-3 partitions every parameter, frozen ones included, and gathers a partition around the forward of
the module that owns it, or, for a parameter read in another module's forward, registers it with that
module and gathers it with that module's own parameters (forward and backward): the recomputation, which
runs inside the drafter's backward, finds the whole head. The engine runs in-process on a one-rank gloo
world with the environment ``accelerate launch`` sets for ``cpu_zero3.yaml``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ..conftest import drafter_recipe, reset_accelerate

pytestmark = pytest.mark.xdist_group("distributed")


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    """A tiny random 4-layer Llama target with the testbed tokenizer (the comparison needs no trained target)."""
    from transformers import AutoTokenizer

    from distill.models import build_causal_lm, special_token_ids, tiny_target
    from distill.testbed import SHIPPED_TARGET

    folder = tmp_path_factory.mktemp("random-target")
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TARGET)
    torch.manual_seed(0)
    build_causal_lm(
        tiny_target().model_copy(update={"num_layers": 4}), len(tokenizer), special_token_ids(tokenizer)
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train(out, target, kind: str, loss_chunk: int | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The final weights and the per-step losses of a 4-step run (online features), ``loss_chunk`` positions at a time."""
    from recipes import train_drafter

    recipe = drafter_recipe(
        out,
        target,
        kind,
        drafter={"loss_chunk": loss_chunk},
        max_steps=4,
        eval_every=4,
        save_every=4,
        eval_batches=1,
        log_every=1,
    )
    train_drafter.main(recipe)
    log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(out / "model" / "model.safetensors")), [m["train/loss"] for m in log if "train/loss" in m]


@pytest.fixture
def zero3(deepspeed_env):  # noqa: F811
    """``enter()``: this process in a one-process ``cpu_zero3.yaml`` launch. Nothing is cleaned up behind the
    recipe: a recipe's ``end_run`` must leave the process fit for the next DeepSpeed run (the second kind's
    run follows the first's in this process)."""
    return lambda: deepspeed_env(3)


@pytest.fixture
def head_reads(monkeypatch):
    """Each read of the head by ``target_logits``: (inside a backward, a ZeRO-3 parameter, elements present)."""
    from drafters.base import DrafterBase

    reads, original = [], DrafterBase.target_logits

    def spy(self, hidden):
        w = self.lm_head.weight
        reads.append((torch._C._current_graph_task_id() >= 0, hasattr(w, "ds_status"), w.numel()))
        return original(self, hidden)

    monkeypatch.setattr(DrafterBase, "target_logits", spy)
    return reads


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_chunked_drafter_loss_under_zero3_trains_like_the_whole_loss_without_deepspeed(
    tmp_path, random_target, zero3, head_reads, kind
):
    """The whole loss without DeepSpeed, and 8 positions a chunk (each batch in many chunks, each recomputed
    in the backward) under ZeRO-3: the same losses and the same weights after 4 steps. The recomputations
    did run, in the backward, on the partitioned head, and found all of it."""
    reference, reference_losses = train(tmp_path / "plain", random_target, kind)
    reset_accelerate()
    head_reads.clear()
    zero3()
    chunked, losses = train(tmp_path / "zero3", random_target, kind, loss_chunk=8)
    strategy = json.loads((tmp_path / "zero3" / "provenance.json").read_text())["strategy"]
    assert strategy["model_wrapper"] == "DeepSpeedEngine" and strategy["zero_stage"] == 3
    # ZeRO-3 replaced torch's F.linear process-wide; the trainer hands the process back with torch's own
    assert torch.nn.functional.linear is torch._C._nn.linear
    recomputed = [r for r in head_reads if r[0]]
    assert len(recomputed) >= 4 * 2 and all(zero3 for _, zero3, _ in head_reads), (
        "no chunk was recomputed on a ZeRO-3 head"
    )
    whole = chunked["lm_head.weight"].numel() if "lm_head.weight" in chunked else reference["lm_head.weight"].numel()
    assert {n for *_, n in head_reads} == {whole}, "the head was a placeholder in a chunk"
    assert len(losses) == 4 and losses == pytest.approx(reference_losses, rel=1e-5)
    assert reference.keys() == chunked.keys()
    for k in reference:
        torch.testing.assert_close(chunked[k], reference[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")  # noqa: B023
