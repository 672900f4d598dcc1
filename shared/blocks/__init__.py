"""The neural-network building blocks of the seed chapter (../shared/seed/000_6ed500cadf07bab3.txt), one idea per
module; every service builds its models from these. Attention, norm and RoPE compute is dispatched by
`shared.blocks.backend` (reference math, torch SDPA, or the Triton kernels on CUDA).
"""

from shared.blocks.activations import activation
from shared.blocks.attention import MultiHeadAttention
from shared.blocks.backend import get_backend
from shared.blocks.conv import Downsample, Upsample, conv2d_same, conv_out, conv_transpose, pool, transposed_conv_out
from shared.blocks.cross_attention import CrossAttention
from shared.blocks.ffn import MLP, GeluFFN, SwiGLU, swiglu_hidden_dim
from shared.blocks.kv_cache import KVCache, kv_cache_bytes
from shared.blocks.masks import causal_mask, padding_mask, prefix_bidirectional_mask, sliding_window_mask
from shared.blocks.mla import LatentKVCache, MultiHeadLatentAttention
from shared.blocks.moe import MoE, load_balancing_loss
from shared.blocks.norms import RMSNorm, group_norm, norm
from shared.blocks.positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    TimestepEmbedding,
    sinusoidal_positions,
    timestep_embedding,
)
from shared.blocks.recurrent import LSTM, LSTMCell, RNNCell
from shared.blocks.residual import ResBlock
from shared.blocks.rope import RoPE, RopeScaling, apply_rope, rope_2d, rope_cos_sin
from shared.blocks.sdpa import scaled_dot_product_attention
from shared.blocks.tiled_attention import tiled_attention
from shared.blocks.transformer import TransformerBlock, TransformerBlockConfig

__all__ = [
    "CrossAttention",
    "Downsample",
    "GeluFFN",
    "KVCache",
    "LSTM",
    "LSTMCell",
    "LatentKVCache",
    "LearnedPositionalEmbedding",
    "MLP",
    "MoE",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "RNNCell",
    "ResBlock",
    "RoPE",
    "RopeScaling",
    "SinusoidalPositionalEncoding",
    "SwiGLU",
    "TimestepEmbedding",
    "TransformerBlock",
    "TransformerBlockConfig",
    "Upsample",
    "activation",
    "apply_rope",
    "causal_mask",
    "conv2d_same",
    "conv_out",
    "conv_transpose",
    "get_backend",
    "group_norm",
    "kv_cache_bytes",
    "load_balancing_loss",
    "norm",
    "padding_mask",
    "pool",
    "prefix_bidirectional_mask",
    "rope_2d",
    "rope_cos_sin",
    "scaled_dot_product_attention",
    "sinusoidal_positions",
    "sliding_window_mask",
    "swiglu_hidden_dim",
    "tiled_attention",
    "timestep_embedding",
    "transposed_conv_out",
]
