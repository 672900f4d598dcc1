"""A GGUF file's tokenizer as a `tokenizers.Tokenizer`: the BPE vocabulary and merges (`tokenizer.ggml.model` "gpt2",
byte-level), the pre-tokenizer that `tokenizer.ggml.pre` names (llama.cpp's list), the control and user-defined
tokens as added tokens, BOS when `add_bos_token`. Other tokenizer models (e.g. SentencePiece "llama") are refused by
name. The special-token texts come back in a `tokenizer_config.json`-shaped dict for `TextTokenizer`.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

# llama.cpp's token types (llama_token_type)
CONTROL, USER_DEFINED = 3, 4
# Split patterns of the pre-tokenizers that are not plain GPT-2 (llama.cpp's llm_tokenizer_bpe).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer that `tokenizer.ggml.pre` names; an unknown name is refused."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("default", "gpt-2"):
        return gpt2
    if name == "smollm":  # GPT-2's split after every digit on its own (SmolLM's tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if name in ("llama-bpe", "llama3"):
        return _split_then_bytes(LLAMA3_PATTERN)
    if name == "qwen2":
        return _split_then_bytes(QWEN2_PATTERN)
    raise ValueError(f"GGUF pre-tokenizer {name!r} is not supported (supported: default, gpt-2, smollm, "
                     "llama-bpe, qwen2)")


def gguf_tokenizer(metadata: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer_config-like dict with bos_token / eos_token / add_bos_token) from GGUF metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, byte-level BPE)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    bpe = BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types, strict=True) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED])

    def text(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    config = {"bos_token": text("bos"), "eos_token": text("eos"),
              "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False))}
    byte_level = processors.ByteLevel(trim_offsets=False)
    if config["add_bos_token"] and config["bos_token"] is not None:
        bos = (config["bos_token"], metadata["tokenizer.ggml.bos_token_id"])
        template = processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B",
                                                 special_tokens=[bos])
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    return tokenizer, config
