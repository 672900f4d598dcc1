"""The Stable Diffusion blocks against diffusers' and transformers' own modules, weights copied by name: GEGLU
feedforward, BasicTransformerBlock, the autoencoder's mid-block attention and CLIP's text transformer."""

from __future__ import annotations

import pytest
import torch

from genserve.shared.blocks.clip_text import CLIPTextConfig, CLIPTextTransformer
from genserve.shared.blocks.ffn import GegluFFN
from genserve.shared.blocks.spatial_attention import SpatialSelfAttention
from genserve.shared.blocks.unet import BasicTransformerBlock


def _copy(ours: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    ours.load_state_dict(state, strict=True)


def test_geglu_ffn_matches_diffusers_feedforward() -> None:
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    ref = FeedForward(24, activation_fn="geglu").eval()
    ours = GegluFFN(24, 4 * 24)
    _copy(ours, ref.state_dict())
    x = torch.randn(2, 7, 24)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("context_dim", [16, None])
def test_basic_transformer_block_matches_diffusers(context_dim: int | None) -> None:
    """norm1/attn1, norm2/attn2 (cross-attention, or none), norm3/ff with GEGLU: diffusers' layout, same values."""
    from diffusers.models.attention import BasicTransformerBlock as RefBlock

    torch.manual_seed(1)
    ref = RefBlock(32, 4, 8, cross_attention_dim=context_dim, activation_fn="geglu", only_cross_attention=False)
    if context_dim is None:  # diffusers keeps a self-attention attn2 without cross_attention_dim; ours drops it
        ref.attn2 = ref.norm2 = None
    ours = BasicTransformerBlock(32, 4, 8, context_dim, ff="geglu")
    _copy(ours, ref.state_dict())
    x, ctx = torch.randn(2, 10, 32), torch.randn(2, 5, context_dim or 32)
    with torch.no_grad():
        expected = ref(x, encoder_hidden_states=ctx if context_dim else None)
        torch.testing.assert_close(ours(x, ctx if context_dim else None), expected, rtol=1e-5, atol=1e-5)


def test_spatial_self_attention_matches_the_autoencoder_mid_attention() -> None:
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(2)
    ref = Attention(16, heads=1, dim_head=16, eps=1e-6, norm_num_groups=8, residual_connection=True, bias=True,
                    upcast_softmax=True, _from_deprecated_attn_block=True).eval()
    ours = SpatialSelfAttention(16, groups=8)
    state = {("group_norm." + k[len("group_norm."):]) if k.startswith("group_norm.") else "attn." + k: v
             for k, v in ref.state_dict().items()}
    _copy(ours, state)
    x = torch.randn(2, 16, 6, 10)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_clip_text_transformer_matches_transformers(act: str) -> None:
    """Causal self-attention, the config's activation and the final LayerNorm: hidden states within 1e-4."""
    from transformers import CLIPTextConfig as RefConfig
    from transformers import CLIPTextModel

    from genserve.services.diffusion.sd_text import _our_name

    torch.manual_seed(3)
    ref = CLIPTextModel(RefConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=20, hidden_act=act)).eval()
    ours = CLIPTextTransformer(CLIPTextConfig(vocab_size=99, dim=32, ffn_hidden_dim=64, n_layers=2, n_heads=4,
                                              max_positions=20, act=act))
    _copy(ours, {_our_name(k): v for k, v in ref.state_dict().items() if not k.endswith("position_ids")})
    ids = torch.randint(0, 99, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).last_hidden_state, rtol=1e-4, atol=1e-4)
        # causal: changing the last token leaves every earlier position as it was
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 99
        torch.testing.assert_close(ours(changed)[:, :-1], ours(ids)[:, :-1], rtol=0, atol=0)
