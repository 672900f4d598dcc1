"""Tiny random Hugging Face checkpoints and a byte-level tokenizer for the text-engine tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.kv_cache import BlockManager
from genserve.services.text.loader import load_model
from genserve.services.text.tokenizer import TextTokenizer

VOCAB = 256


def byte_tokenizer() -> TextTokenizer:
    """Byte-level BPE without merges: token i is byte i, so any id decodes (possibly to a partial UTF-8 char)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = {c: ord(c) if ord(c) < 256 else None for c in alphabet}
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256 + k in byte order.
    shifted = sorted(c for c, b in byte_chars.items() if b is None)
    printable = sorted(b for b in byte_chars.values() if b is not None)
    others = [b for b in range(256) if b not in printable]
    mapping = {chr(b): b for b in printable} | {c: b for c, b in zip(shifted, others, strict=True)}
    tok = Tokenizer(models.BPE(vocab=mapping, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TextTokenizer(tok)


def hf_model(arch: str, **overrides):
    """A random tiny transformers model of ``arch`` ("llama" | "mistral" | "qwen2" | "phi3" | "qwen3_moe" |
    "mixtral" | "gpt_oss" | "deepseek_v3"), every weight non-trivial (DeepSeek-V3's router correction bias too)."""
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[arch]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None, rms_norm_eps=1e-5)
    kwargs.update(overrides)
    model = cls_model(cls_cfg(**kwargs)).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        biases = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in [*model.named_parameters(), *biases]:
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model


def save_hf(model, directory: Path, sharded: bool) -> Path:
    model.save_pretrained(directory, max_shard_size="60KB" if sharded else "1GB")
    return directory


def make_engine(directory: Path, **config) -> LLMEngine:
    return LLMEngine(load_model(directory), byte_tokenizer(), EngineConfig(**config))


def ids(n: int, seed: int) -> list[int]:
    """`n` random token ids of the byte vocabulary, the same for the same seed."""
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def admit(bm: BlockManager, seq_id: str, tokens: list[int]) -> int:
    """What the scheduler and engine do for a whole prompt: match, grow, compute, register; the hit tokens."""
    hit = bm.match_prefix(seq_id, tokens, [])
    bm.grow(seq_id, len(tokens))
    bm.register(seq_id, tokens, [], len(tokens))
    return hit
