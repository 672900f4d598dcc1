"""Attention masks as boolean tensors (True = may attend), broadcastable to scores of shape (B, H, Nq, Nk).

- causal: the masked-attention equation M_ij = 0 if j <= i else -inf, aligned bottom-right so that the Nq queries
  are the last Nq positions of the Nk keys (chunked prefill, decoding against a KV cache);
- padding: right-padded batches, keys at or past a sequence's length are hidden;
- prefix-bidirectional: GLM's Part A (bidirectional context) / Part B (autoregressive blanks).
"""

from __future__ import annotations

import torch


def causal_mask(n_q: int, n_k: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """(Nq, Nk) bool: query i sees key j iff j <= i + Nk - Nq (bottom-right aligned)."""
    n_k = n_q if n_k is None else n_k
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None, :]
    return cols <= rows + (n_k - n_q)


def padding_mask(lengths: torch.Tensor, n_k: int) -> torch.Tensor:
    """(B, 1, 1, Nk) bool: key j of sequence b is real iff j < lengths[b]."""
    cols = torch.arange(n_k, device=lengths.device)
    return (cols[None, :] < lengths[:, None])[:, None, None, :]


def prefix_bidirectional_mask(prefix_len: int | torch.Tensor, n: int, device: torch.device | str | None = None):
    """GLM mask over n tokens whose first `prefix_len` form Part A.

    Part A tokens attend to all of Part A (and nothing of Part B); Part B tokens attend to all of Part A and to the
    preceding Part B tokens. With an int prefix the result is (n, n); with a (B,) tensor of prefix lengths it is
    (B, 1, n, n).
    """
    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(n, device=device)[None, :]
    if isinstance(prefix_len, torch.Tensor):
        p = prefix_len.to(rows.device)[:, None, None, None]
        return (cols < p) | ((cols <= rows) & (rows >= p))
    return (cols < prefix_len) | ((cols <= rows) & (rows >= prefix_len))


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool keep-mask -> additive mask M with 0 where kept and -inf where hidden (the form used in
    the chapter "Deep Learning Building Blocks")."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~mask, float("-inf"))


def sliding_window_mask(n_q: int, n_k: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(Nq, Nk) bool: causal (bottom-right) and query i sees only the last `window` keys, i - window < j <= i
    in absolute positions (Mistral's sliding window)."""
    rows = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    cols = torch.arange(n_k, device=device)[None, :]
    return (cols <= rows) & (cols > rows - window)
