"""CLIP's byte-level BPE tokenizer, built with `tokenizers` the way transformers' CLIPTokenizer builds it, from a
pipeline's ``tokenizer/`` folder: ``vocab.json`` + ``merges.txt`` (released checkpoints) or ``tokenizer.json``
(newer saves). ``tokenizer_config.json`` supplies the length (77) and the special tokens.

Text clean-up as CLIP does it: Unicode NFC, runs of whitespace to one space, lower case; words are letters, single
digits, contractions or punctuation runs; each word's last piece carries ``</w>``. Every sequence is
``<|startoftext|> ... <|endoftext|>``, truncated to 77 ids (so at most 75 of text) and padded with the pad token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
_WORDS = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _token_text(value: object, default: str) -> str:
    """A special token from tokenizer_config.json: a string, an AddedToken dict, or absent."""
    if isinstance(value, dict):
        return str(value.get("content", default))
    return str(value) if value else default


def _from_vocab_merges(directory: Path, unk: str) -> Tokenizer:
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    lines = (directory / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="</w>", fuse_unk=False, unk_token=unk))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_WORDS), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


class CLIPTokenizer:
    """prompts -> ids (B, max_length) int64, exactly as CLIPTokenizer(padding="max_length", truncation=True)."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        unk = _token_text(config.get("unk_token"), EOS)
        bos, eos = _token_text(config.get("bos_token"), BOS), _token_text(config.get("eos_token"), EOS)
        pad = _token_text(config.get("pad_token"), EOS)
        self.max_length = int(config.get("model_max_length", 77))
        if not 2 < self.max_length <= 4096:
            raise ValueError(f"{config_path}: model_max_length must be in 3..4096, got {self.max_length}")
        if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            tok = _from_vocab_merges(directory, unk)
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(
                [unk, bos, eos, pad])])
        elif (directory / "tokenizer.json").is_file():
            tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        else:
            raise FileNotFoundError(f"{directory}: no vocab.json + merges.txt and no tokenizer.json")
        ids = {name: tok.token_to_id(name) for name in (bos, eos, pad)}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"{directory}: special tokens {missing} are not in the vocabulary")
        tok.post_processor = processors.RobertaProcessing((eos, ids[eos]), (bos, ids[bos]), False, False)
        tok.enable_truncation(max_length=self.max_length)
        tok.enable_padding(length=self.max_length, pad_id=ids[pad], pad_token=pad)
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()

    def __call__(self, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([e.ids for e in self._tok.encode_batch(list(prompts))], dtype=torch.int64)
