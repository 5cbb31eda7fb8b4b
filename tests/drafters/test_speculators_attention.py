"""Block attention through the speculators format, both ways, against the real library's forward.

Each attention setting a DFlash drafter can have (whole-context layers with bidirectional or causal
blocks, sliding-window layers with causal or bidirectional blocks, all or every other layer) is written
by :func:`drafters.export.write_speculators`, loaded and saved again by ``speculators`` itself, run through the
library's own layers under the library's own masks (``create_anchor_block_mask_mod``, per layer as its
forward picks them), and read back by :func:`drafters.export.read_speculators`: the library's hidden
states equal the drafter's and the read-back drafter's, in training's forward and in decoding's."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import decode_one, tiny_dflash_config

WINDOW = 3
SETTINGS = {
    "bidirectional": {},
    "causal": {"block_attention": "causal"},
    "sliding causal": {"layer_types": ["sliding_attention"] * 2, "sliding_window": WINDOW},
    "sliding bidirectional, alternate": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        "sliding_block_attention": "bidirectional",
    },
}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A tiny random Llama target saved to disk (the library rebuilds embeddings and head from it)."""
    from transformers import AutoModelForCausalLM

    from tests.families import family_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama3", 96, max_position_embeddings=64)).eval()
    folder = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(folder)
    return model, folder


def library_hidden(spec, aux: torch.Tensor, anchor_tokens: torch.Tensor, a: int) -> torch.Tensor:
    """The library's block hidden states for one block anchored at ``a`` over features ``aux`` [1, T, F]:
    its fc / norm, its layers, each under the mask its forward gives that layer."""
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from torch.nn.attention.flex_attention import create_mask

    T, K = aux.shape[1], spec.block_size
    tl = spec.config.transformer_layer_config
    tl._attn_implementation = "eager"
    noise = torch.full((1, K), spec.mask_token_id)
    noise[:, 0] = anchor_tokens
    ctx = spec.hidden_norm(spec.fc(aux))
    pos = torch.cat([torch.arange(T), a + torch.arange(K)])[None]
    h = spec.embed_tokens(noise)
    for idx, layer in enumerate(spec.layers):
        sliding = idx in spec.sliding_window_indices
        mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
            document_ids=torch.zeros(T, dtype=torch.long),
            total_seq_len=T,
            anchor_positions=torch.tensor([a]),
            block_size=K,
            sliding_window=spec.sliding_window if sliding else None,
            sliding_window_non_causal=spec.sliding_window_non_causal,
        )
        visible = create_mask(mask_mod, 1, 1, q_len, kv_len, device="cpu")
        additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
        h = layer(
            hidden_states=h, target_hidden=ctx, attention_mask=additive, position_embeddings=spec.rotary_emb(h, pos)
        )
    return spec.norm(h)


@pytest.mark.parametrize("setting", list(SETTINGS))
@torch.no_grad()
def test_every_attention_setting_round_trips_through_the_library(tmp_path, verifier, setting):
    pytest.importorskip("speculators")
    from speculators import SpeculatorModel

    from distill.base.features import FeatureCapture
    from drafters import DRAFTERS
    from drafters.export import read_speculators, write_speculators

    target, folder = verifier
    config_cls, model_cls = DRAFTERS["dflash"]
    config = config_cls(
        **{
            **tiny_dflash_config().to_dict(),
            "vocab_size": 96,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "target_hidden_size": 64,
            "num_hidden_layers": 2,
            "target_layer_ids": [0, 2],
            "qk_norm": True,
            "mask_token_id": 95,
            "block_size": 4,
            "max_position_embeddings": 64,
            **SETTINGS[setting],
        }
    )
    torch.manual_seed(1)
    drafter = model_cls(config).copy_target_io(target).eval()
    out = tmp_path / "speculators"
    write_speculators(drafter, target.config, str(folder), out)
    spec = SpeculatorModel.from_pretrained(str(out)).eval()
    written = tmp_path / "written_by_the_library"  # a folder as the library itself saves it
    spec.save_pretrained(str(written))
    back, _ = read_speculators(written, target)
    for key in ("block_attention", "layer_types", "sliding_window", "sliding_block_attention"):
        assert getattr(back.config, key) == getattr(drafter.config, key), key
    ids = torch.randint(0, 95, (1, 14), generator=torch.Generator().manual_seed(3))
    aux = FeatureCapture(target, config.target_layer_ids)(ids).aux
    K = config.block_size
    for a in (2, 9):  # a block whose window holds all its context, and one whose window cuts it
        theirs = library_hidden(spec, aux, ids[:, a], a)[0]
        for model in (drafter, back):
            ours = model.block_hidden(aux, ids[:, a], torch.tensor([[a]]))[0, 0]
            assert torch.allclose(ours, theirs, atol=1e-5), (setting, a, (ours - theirs).abs().max())
        # decoding's forward, the context before the anchor arriving at once, gives the same block
        from drafters.cache import ContextCache

        hidden = decode_one(drafter, int(ids[0, a]), a, ContextCache(spare=K), aux[:, :a])
        assert torch.allclose(hidden[0, 0], theirs, atol=1e-5), (setting, a)


def test_sliding_layers_the_format_cannot_hold_are_refused():
    from drafters import DRAFTERS
    from drafters.export import ExportError, check_expressible

    config_cls, _ = DRAFTERS["dflash"]
    mixed = config_cls(
        **{
            **tiny_dflash_config().to_dict(),
            "num_hidden_layers": 2,
            "qk_norm": True,
            "block_attention": "causal",  # a causal whole-context layer beside a bidirectional sliding one
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": WINDOW,
            "sliding_block_attention": "bidirectional",
        }
    )
    with pytest.raises(ExportError, match="share one window and one block attention"):
        check_expressible(mixed, "speculators")
