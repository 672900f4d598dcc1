"""A word-level tokenizer over the captioned-shapes vocabulary.

Text is lower-cased, punctuation ``.,;:!?"'`` is dropped and words are split on whitespace. Every sequence starts
with ``<bos>`` and is padded with ``<pad>`` (or truncated) to ``max_length``. A word outside the vocabulary maps to
``<unk>``: the model still runs, it just has no learned meaning for that word. The empty prompt (``<bos>`` then
padding) is the unconditional input of classifier-free guidance.
"""

from __future__ import annotations

import torch

from genserve.services.shapes.dataset import COLOURS, POSITIONS, SHAPES, SIZES

PAD, UNK, BOS = "<pad>", "<unk>", "<bos>"
SPECIAL_TOKENS = (PAD, UNK, BOS)
_PUNCTUATION = str.maketrans("", "", ".,;:!?\"'")


def caption_vocabulary() -> tuple[str, ...]:
    """Every word a dataset caption can contain, sorted, after the special tokens (ids 0, 1, 2)."""
    words = {"a", "an", "at", "in", "the", *SIZES, *COLOURS, *SHAPES}
    for position in POSITIONS:
        words.update(position.split())
    return SPECIAL_TOKENS + tuple(sorted(words))


def normalise(text: str) -> list[str]:
    return text.lower().translate(_PUNCTUATION).split()


class WordTokenizer:
    """Maps prompts to fixed-length id tensors; the vocabulary travels in the checkpoint's config.json."""

    def __init__(self, vocabulary: tuple[str, ...], max_length: int) -> None:
        if vocabulary[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
            raise ValueError(f"vocabulary must start with {SPECIAL_TOKENS}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        self.vocabulary = vocabulary
        self.max_length = max_length
        self._ids = {word: i for i, word in enumerate(vocabulary)}
        self.pad_id, self.unk_id, self.bos_id = (self._ids[t] for t in SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        ids = [self.bos_id] + [self._ids.get(word, self.unk_id) for word in normalise(text)]
        ids = ids[: self.max_length]
        return ids + [self.pad_id] * (self.max_length - len(ids))

    def __call__(self, texts: list[str]) -> torch.Tensor:
        """(B,) prompts -> (B, max_length) int64 ids."""
        return torch.tensor([self.encode(t) for t in texts], dtype=torch.int64)

    def unknown_words(self, text: str) -> list[str]:
        """Words of ``text`` the vocabulary lacks (what a service may warn about)."""
        return [w for w in normalise(text) if w not in self._ids]
