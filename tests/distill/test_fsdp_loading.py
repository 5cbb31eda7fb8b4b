"""A frozen target loads with its checkpoint's weights and buffers on every rank of an FSDP launch.

``accelerate_configs/fsdp.yaml`` sets ``fsdp_cpu_ram_efficient_loading``: under it transformers'
``from_pretrained`` treats a process whose ``LOCAL_RANK`` is not 0 as one that FSDP will fill by
broadcasting rank 0's state (it zeroes the non-persistent buffers, RoPE's ``inv_freq`` among them, and
skips their initialisation). The target is never wrapped by FSDP, so nothing would broadcast: it must
load whole there. The test puts this process where transformers takes that path (the environment
``accelerate launch`` sets for fsdp.yaml, a one-rank gloo world, ``LOCAL_RANK=1``), checks that
transformers' own test says so, and compares every parameter and buffer with a plain load."""

from __future__ import annotations

import pytest
import torch

from distill.config import TargetConfig
from distill.models import load_target

from ..conftest import REPO, launch_env
from ..families import save_family

FAMILIES = ["llama3", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """A tiny saved target per family, with the testbed target's tokenizer."""
    from transformers import AutoTokenizer

    from distill.testbed import SHIPPED_TARGET

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TARGET)
    root = tmp_path_factory.mktemp("fsdp-targets")
    return {name: save_family(name, root / name, tokenizer) for name in FAMILIES}


@pytest.fixture
def fsdp_non_zero_rank(monkeypatch):
    """This process as local rank 1 of an FSDP launch with CPU-RAM-efficient loading: the variables
    ``accelerate launch --config_file accelerate_configs/fsdp.yaml`` sets, a (one-rank) gloo world, and
    ``LOCAL_RANK=1`` / ``RANK=1`` (what transformers reads is the environment, not the group)."""
    import torch.distributed as dist

    _, env = launch_env(REPO / "accelerate_configs/fsdp.yaml")
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    yield
    dist.destroy_process_group()


def state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by name, detached copies."""
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("family", FAMILIES)
def test_target_loads_whole_on_a_non_zero_fsdp_rank(targets, family, fsdp_non_zero_rank, monkeypatch):
    from transformers import modeling_utils
    from transformers.distributed.fsdp import is_fsdp_enabled
    from transformers.distributed.utils import is_local_dist_rank_0

    cfg = TargetConfig(path=str(targets[family]))
    with monkeypatch.context() as plain:  # the reference: the same folder loaded outside any FSDP launch
        for key in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
            plain.delenv(key)
        assert not is_fsdp_enabled()
        expected = state(load_target(cfg)[0])
    assert is_fsdp_enabled() and not is_local_dist_rank_0(), "transformers would not take its non-zero-rank path here"
    answers = []  # what from_pretrained's own rank test answered (it asks only once FSDP loading is on)
    spy = lambda: answers.append(is_local_dist_rank_0()) or answers[-1]  # noqa: E731
    monkeypatch.setattr(modeling_utils, "is_local_dist_rank_0", spy)
    loaded = state(load_target(cfg)[0])
    assert answers and not any(answers), f"from_pretrained did not take the non-zero-rank path: {answers}"
    assert is_fsdp_enabled() and not is_local_dist_rank_0()  # loading left the launch's environment as it was
    assert loaded.keys() == expected.keys() and any(name.endswith("inv_freq") for name in loaded)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), f"{family}: {name} differs from a plain load"
