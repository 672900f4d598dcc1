"""T5's encoder (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", §2.1), the long-prompt encoder of SD3 and Flux, from transformers' ``T5EncoderModel`` folder
(``config.json`` + ``model.safetensors``), and its SentencePiece tokenizer from ``tokenizer.json``.

T5 differs from the BERT/GPT block in four ways, all kept here: the norm is RMS-only (no mean, no bias:
``T5LayerNorm``, in float32), attention logits are not scaled by 1/√d (the scale is folded into the weights'
initialisation), positions enter only as a learned scalar bias per (head, relative-distance bucket), shared by all
layers and computed from block 0's table, and the v1.1 FFN (SD3's and Flux's T5-XXL) is gated:
wo(act(wi_0 x) ⊙ wi_1 x). Module names follow transformers' so the checkpoint loads without renames.

SD3 and Flux run it without an attention mask, so padding tokens attend and are attended to, as here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from genserve.shared.blocks.activations import activation
from genserve.shared.checkpoint import load_state_strict, read_safetensors_dir, supported

CLASS_NAME = "T5EncoderModel"
TOKENIZER_CLASSES = ("T5Tokenizer", "T5TokenizerFast")
# transformers' dense_act_fn names -> ours (gelu_new is the tanh approximation)
_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


@dataclass(frozen=True)
class T5Config:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    n_layers: int
    n_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    gated: bool = True
    act: str = "gelu_tanh"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.d_model, self.d_kv, self.d_ff, self.n_layers, self.n_heads) < 1:
            raise ValueError("vocab_size, d_model, d_kv, d_ff, n_layers and n_heads must be >= 1")
        if self.num_buckets < 4 or self.max_distance <= self.num_buckets // 4:
            raise ValueError(f"num_buckets ({self.num_buckets}) >= 4 and max_distance > num_buckets / 4 are needed")

    @classmethod
    def from_transformers(cls, raw: dict, where: str) -> T5Config:
        supported(raw, "architectures", [CLASS_NAME], ([CLASS_NAME],), where)
        projection = supported(raw, "feed_forward_proj", "relu", ("relu", "gated-gelu", "gated-relu", "gated-silu"),
                               where)
        act_name = raw.get("dense_act_fn") or projection.split("-")[-1]
        act_name = "gelu_new" if projection == "gated-gelu" and "dense_act_fn" not in raw else act_name
        if act_name not in _ACTS and act_name != "silu":
            raise ValueError(f"{where}: dense_act_fn {act_name!r} is not supported (supported: "
                             f"{', '.join([*_ACTS, 'silu'])})")
        return cls(vocab_size=int(raw["vocab_size"]), d_model=int(raw["d_model"]), d_kv=int(raw["d_kv"]),
                   d_ff=int(raw["d_ff"]), n_layers=int(raw["num_layers"]), n_heads=int(raw["num_heads"]),
                   num_buckets=int(raw.get("relative_attention_num_buckets", 32)),
                   max_distance=int(raw.get("relative_attention_max_distance", 128)),
                   gated=projection.startswith("gated-"), act=_ACTS.get(act_name, act_name),
                   eps=float(raw.get("layer_norm_epsilon", 1e-6)))


class T5LayerNorm(nn.Module):
    """x / RMS(x) * weight, in float32 (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(x.dtype)


def relative_buckets(n: int, num_buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """(n, n) bucket of each (query, key) pair's distance k − q, bidirectional (T5 §2.1): half the buckets per sign,
    exact below num_buckets / 4, logarithmic up to max_distance, and the last bucket beyond."""
    position = torch.arange(n, device=device)
    distance = position[None, :] - position[:, None]  # (q, k): key minus query
    half = num_buckets // 2
    buckets = (distance > 0).long() * half
    distance = distance.abs()
    exact = half // 2
    large = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    large = large.clamp(max=half - 1)
    return buckets + torch.where(distance < exact, distance, large)


class T5Attention(nn.Module):
    def __init__(self, c: T5Config, has_bias: bool) -> None:
        super().__init__()
        inner = c.n_heads * c.d_kv
        self.n_heads, self.d_kv = c.n_heads, c.d_kv
        self.q, self.k, self.v = (nn.Linear(c.d_model, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, c.d_model, bias=False)
        if has_bias:
            self.relative_attention_bias = nn.Embedding(c.num_buckets, c.n_heads)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (B, T, d_model), bias (1, H, T, T) -> (B, T, d_model); logits unscaled (T5 has no 1/√d)."""
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.n_heads, self.d_kv).transpose(1, 2) for proj in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=1.0)  # (B, H, T, d_kv)
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


class T5SelfAttentionLayer(nn.Module):
    def __init__(self, c: T5Config, has_bias: bool) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(c, has_bias)
        self.layer_norm = T5LayerNorm(c.d_model, c.eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + self.SelfAttention(self.layer_norm(x), bias)


class T5DenseReluDense(nn.Module):
    """wo(act(wi_0 x) ⊙ wi_1 x) when gated (T5 v1.1), else wo(act(wi x))."""

    def __init__(self, c: T5Config) -> None:
        super().__init__()
        self.gated = c.gated
        if c.gated:
            self.wi_0 = nn.Linear(c.d_model, c.d_ff, bias=False)
            self.wi_1 = nn.Linear(c.d_model, c.d_ff, bias=False)
        else:
            self.wi = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.wo = nn.Linear(c.d_ff, c.d_model, bias=False)
        self.act = activation(c.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h)


class T5FFLayer(nn.Module):
    def __init__(self, c: T5Config) -> None:
        super().__init__()
        self.DenseReluDense = T5DenseReluDense(c)
        self.layer_norm = T5LayerNorm(c.d_model, c.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    def __init__(self, c: T5Config, has_bias: bool) -> None:
        super().__init__()
        self.layer = nn.ModuleList([T5SelfAttentionLayer(c, has_bias), T5FFLayer(c)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.layer[1](self.layer[0](x, bias))


class T5Stack(nn.Module):
    def __init__(self, c: T5Config) -> None:
        super().__init__()
        self.block = nn.ModuleList(T5Block(c, has_bias=i == 0) for i in range(c.n_layers))
        self.final_layer_norm = T5LayerNorm(c.d_model, c.eps)


class T5Encoder(nn.Module):
    """ids (B, T) -> last hidden states (B, T, d_model), after the final norm."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config)

    def position_bias(self, n: int, device: torch.device) -> torch.Tensor:
        """(1, H, T, T): block 0's learned bias per bucket, used by every block."""
        c = self.config
        table = self.encoder.block[0].layer[0].SelfAttention.relative_attention_bias
        return table(relative_buckets(n, c.num_buckets, c.max_distance, device)).permute(2, 0, 1)[None]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.shared(ids)  # (B, T, d_model)
        bias = self.position_bias(ids.shape[1], ids.device)
        for block in self.encoder.block:
            x = block(x, bias)
        return self.encoder.final_layer_norm(x)


def load_t5_encoder(directory: str | Path, device: str | torch.device = "cpu") -> T5Encoder:
    directory = Path(directory)
    where = str(directory / "config.json")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{where} not found")
    model = T5Encoder(T5Config.from_transformers(json.loads((directory / "config.json").read_text()), where))
    state = read_safetensors_dir(directory, ("model",))
    # T5EncoderModel saves the embedding as shared.weight and, in older files, again as encoder.embed_tokens.weight
    state = {k: v.float() for k, v in state.items() if k != "encoder.embed_tokens.weight"}
    load_state_strict(model, state, str(directory))
    return model.to(device).eval()


class T5Tokenizer:
    """prompts -> ids (B, max_length): SentencePiece (unigram) pieces from ``tokenizer.json``, then </s>, truncated
    to max_length with the </s> kept, padded with <pad> (T5TokenizerFast with padding="max_length")."""

    def __init__(self, directory: str | Path, max_length: int) -> None:
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (a T5 tokenizer folder needs tokenizer.json)")
        self.tokenizer = Tokenizer.from_file(str(path))
        pad = self.tokenizer.token_to_id("<pad>")
        if pad is None:
            raise ValueError(f"{path}: no <pad> token")
        self.max_length = max_length
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.enable_padding(length=max_length, pad_id=pad, pad_token="<pad>")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def __call__(self, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([e.ids for e in self.tokenizer.encode_batch(list(prompts))], dtype=torch.long)
