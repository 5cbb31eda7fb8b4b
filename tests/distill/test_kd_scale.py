"""Distillation at scale: the KD loss in chunks of positions equals the whole-vocabulary loss (value and
gradients) without ever holding a [B, T, V] tensor; held-out evaluation runs the same number of forwards
on every rank; a mixture-of-experts model's FLOPs count the experts a token visits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from distill.base.flops import flops_per_token, matmul_params
from distill.config import ModelConfig, PardSection
from distill.data import Batch
from distill.kd import evaluate_pard, evaluate_student, kd_loss_fn
from distill.models import build_causal_lm

V, B, L = 300, 2, 32  # vocabulary, windows a batch, window length (inputs)
MASK = 5

# ---------------------------------------------------------------------------------------------------
# Tiny models and data


def teacher_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def student_model(arch: str = "llama"):
    torch.manual_seed(1)
    cfg = {
        "arch": arch,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
        "initializer_range": 0.1,
    }
    if arch == "parcae":
        cfg.update(
            num_layers=3,
            parcae={
                "prelude_layers": 1,
                "core_layers": 1,
                "coda_layers": 1,
                "mean_recurrence": 2,
                "backprop_depth": 1,
                "eval_recurrences": [1],
            },
        )
    return build_causal_lm(ModelConfig.model_validate(cfg), V).train()


def windows_batch(rows: int = B, seed: int = 2) -> Batch:
    """Windows of L + 1 tokens whose first tokens are an unscored prompt (loss mask 0), of varying length."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, V, (rows, L + 1), generator=gen)
    mask = (torch.arange(L + 1)[None] >= torch.randint(1, L // 2, (rows, 1), generator=gen)).long()
    return Batch(ids, mask, first_sample=seed)


# ---------------------------------------------------------------------------------------------------
# Chunked KD loss


def loss_and_grads(student, loss_fn, batch):
    student.zero_grad(set_to_none=True)
    loss, logs = loss_fn(student, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}, logs


CASES = {  # arch, divergence, temperature, ce_weight, PARD
    "llama-forward_kl": ("llama", "forward_kl", 1.0, 0.0, False),
    "llama-jsd-ce-t2": ("llama", "jsd", 2.0, 0.3, False),
    "llama-reverse_kl-ce-pard": ("llama", "reverse_kl", 1.0, 0.2, True),
    "parcae-forward_kl-ce": ("parcae", "forward_kl", 1.0, 0.1, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_kd_equals_whole_logits_kd(case):
    from parcae.training import training_forward_kwargs

    arch, divergence, temperature, ce_weight, with_pard = CASES[case]
    teacher, student, batch = teacher_model(), student_model(arch), windows_batch()
    depths = (lambda model, b: training_forward_kwargs(model, b, 0)) if arch == "parcae" else None
    pard = PardSection(draft_tokens=4, anchors=3, keep=0.7) if with_pard else None

    def make(chunk):
        return kd_loss_fn(teacher, divergence, 0.5, temperature, ce_weight, depths, pard, MASK, 0, chunk=chunk)

    whole, whole_grads, whole_logs = loss_and_grads(student, make(None), batch)
    for chunk in (7, 1000):  # a ragged last chunk; one chunk holding every scored position
        loss, grads, logs = loss_and_grads(student, make(chunk), batch)
        torch.testing.assert_close(loss, whole, rtol=1e-5, atol=1e-7)
        assert grads.keys() == whole_grads.keys() and len(grads) == len(list(student.parameters()))
        for name, g in grads.items():
            torch.testing.assert_close(
                g, whole_grads[name], rtol=1e-4, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
            )
        assert logs.keys() == whole_logs.keys()
        assert ("kd/ce" in logs) == bool(ce_weight) and ("parcae/mean_depth" in logs) == (arch == "parcae")
    assert whole > 1e-3


class LargestStorage(TorchDispatchMode):
    """Records the largest storage (bytes) any operator returns, forward and backward, and the operators run."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("arch", ["llama", "parcae"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_chunked_kd_never_holds_batch_by_positions_by_vocabulary(chunk, arch):
    from parcae.training import training_forward_kwargs

    teacher, student, batch = teacher_model(), student_model(arch), windows_batch()
    depths = (lambda model, b: training_forward_kwargs(model, b, 0)) if arch == "parcae" else None
    loss_fn = kd_loss_fn(teacher, "jsd", 0.5, 1.0, 0.3, depths, chunk=chunk)
    with LargestStorage() as seen:
        loss, _ = loss_fn(student, batch)
        loss.backward()
    assert "_log_softmax_backward_data" in seen.ops  # the backward ran under the mode
    whole = B * L * V * 4  # one [B, L, V] fp32 tensor
    if chunk is None:
        assert seen.largest >= whole
    else:
        assert seen.largest < whole, (
            seen.largest,
            whole,
        )  # here the largest are the head weight's gradient and a chunk's


def test_chunked_kd_of_a_batch_with_nothing_scored_is_zero_with_gradients():
    teacher, student, batch = teacher_model(), student_model(), windows_batch()
    batch.loss_mask.zero_()
    loss, grads, _ = loss_and_grads(student, kd_loss_fn(teacher, "jsd", 0.5, 1.0, 0.3, chunk=8), batch)
    assert loss == 0 and student.lm_head.weight.grad is not None and all(g.abs().max() == 0 for g in grads.values())


def test_chunked_kd_refuses_a_model_that_changes_its_logits_after_the_head():
    teacher, student, batch = teacher_model(), student_model(), windows_batch()

    def soft_cap(module, args, kwargs, out):  # Gemma's final soft cap, after the head
        out.logits = 30 * torch.tanh(out.logits / 30)
        return out

    cap = student.register_forward_hook(soft_cap, with_kwargs=True)
    with pytest.raises(ValueError, match="cannot be distilled in chunks"):
        kd_loss_fn(teacher, "forward_kl", 0.5, 1.0, 0.0, chunk=8)(student, batch)
    cap.remove()


# ---------------------------------------------------------------------------------------------------
# Held-out evaluation: the same forwards on every rank


class FakeAccelerator:
    """What evaluation reads of an accelerator; ``reduce`` keeps what this rank contributed."""

    def __init__(self, rank: int, world: int):
        self.process_index, self.num_processes, self.device = rank, world, torch.device("cpu")
        self.reduced = []

    def reduce(self, t, op):
        assert op == "sum"
        self.reduced.append(t.clone())
        return t


class HeldOut:
    def __init__(self, n: int):
        self.batch = windows_batch(n, seed=3)

    def __len__(self):
        return len(self.batch)

    def collate(self, idx):
        return Batch(self.batch.input_ids[idx], self.batch.loss_mask[idx])


@pytest.mark.parametrize("kind", ["student", "pard"])
def test_evaluation_runs_the_same_forwards_on_every_rank_and_sums_as_one_process(kind):
    teacher, student, windows = teacher_model(), student_model().eval(), HeldOut(11)
    pard = PardSection(draft_tokens=3, anchors=2)

    def run(rank, world):
        acc, forwards = FakeAccelerator(rank, world), []
        hook = student.register_forward_hook(lambda *_: forwards.append(1))
        if kind == "student":
            evaluate_student(student, teacher, windows, 2, accelerator=acc)
        else:
            evaluate_pard(student, teacher, windows, 2, pard, MASK, accelerator=acc, seed=4)
        hook.remove()
        return len(forwards), acc.reduced[0]

    world = 4  # 6 batches of 2 (the last of 1) over 4 ranks: 2, 2, 1, 1 real batches
    ranks = [run(rank, world) for rank in range(world)]
    assert [count for count, _ in ranks] == [2] * world
    _, single = run(0, 1)
    torch.testing.assert_close(sum(sums for _, sums in ranks), single, rtol=1e-12, atol=1e-9)


# ---------------------------------------------------------------------------------------------------
# FLOPs of mixture-of-experts models


def moe_model(kind: str):
    from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts_per_tok=2,
    )
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32, intermediate_size=128, **common)
    else:
        cfg = GptOssConfig(num_local_experts=8, intermediate_size=32, **common)
    return AutoModelForCausalLM.from_config(cfg)


def active_matmul_params(cfg, experts: int, expert_intermediate: int, visited: int) -> int:
    """Per token: attention q, k, v, o, the router, ``visited`` experts (gate and up [D, 2I], down [I, D])
    a layer, and the untied LM head."""
    D, hd = cfg.hidden_size, cfg.head_dim
    attn = 2 * D * cfg.num_attention_heads * hd + 2 * D * cfg.num_key_value_heads * hd
    router = experts * D
    active = visited * 3 * D * expert_intermediate
    return cfg.num_hidden_layers * (attn + router + active) + cfg.vocab_size * D


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_moe_flops_count_the_experts_a_token_visits(kind):
    model = moe_model(kind)
    cfg = model.config
    experts, inter = (
        (cfg.num_experts, cfg.moe_intermediate_size)
        if kind == "qwen3_moe"
        else (cfg.num_local_experts, cfg.intermediate_size)
    )
    assert not cfg.tie_word_embeddings
    assert matmul_params(model) == active_matmul_params(cfg, experts, inter, cfg.num_experts_per_tok)
    every_weight = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "bias" not in n
    )
    assert every_weight == active_matmul_params(cfg, experts, inter, experts)  # what a dense count would claim
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 128
    assert flops_per_token(model, 128, training=False) == 2 * matmul_params(model) + attn


def test_moe_flops_need_the_routing_fields():
    from types import SimpleNamespace

    model = moe_model("qwen3_moe")
    model.config = SimpleNamespace(num_experts=8)  # a config that does not say how many experts a token visits
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        matmul_params(model)


def test_dense_flops_count_every_matrix():
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    assert matmul_params(model) == sum(p.numel() for p in model.parameters() if p.dim() >= 2) - 300 * 64
