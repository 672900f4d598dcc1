"""Recurrent cells: the vanilla RNN (Def. 10, "Recurrent Neural Network", of the chapter
"Deep Learning Building Blocks") and the LSTM (Def. 11, "LSTM Cell"), plus an LSTM layer over a sequence.

Sequences are batch-first: x (B, T, input_size).
"""

from __future__ import annotations

import torch
from torch import nn

from genserve.shared.blocks.activations import activation


class RNNCell(nn.Module):
    """h_t = sigma(W_h h_{t-1} + W_x x_t + b), y_t = W_y h_t + b_y (Def. 10, "Recurrent Neural Network"); sigma
    defaults to tanh."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int | None = None, act: str = "tanh") -> None:
        super().__init__()
        self.w_x = nn.Linear(input_size, hidden_size)  # carries b
        self.w_h = nn.Linear(hidden_size, hidden_size, bias=False)
        self.w_y = nn.Linear(hidden_size, output_size or hidden_size)  # carries b_y
        self.act = activation(act)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, input_size), h (B, hidden) -> (y_t, h_t)."""
        h = self.act(self.w_h(h) + self.w_x(x))
        return self.w_y(h), h


class LSTMCell(nn.Module):
    """One LSTM step (Def. 11, "LSTM Cell"). All four gates read [h_{t-1}, x_t] through one matrix `w`
    (4H, H + input_size).

    Rows of `w`/its bias are ordered (input i, forget f, candidate c~, output o), torch.nn.LSTM's order, so its
    weights copy over as w = [weight_hh | weight_ih], b = bias_ih + bias_hh.
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.w = nn.Linear(hidden_size + input_size, 4 * hidden_size)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, input_size), state (h, c) each (B, H) -> (h_t, (h_t, c_t))."""
        h, c = state
        i, f, g, o = self.w(torch.cat((h, x), dim=-1)).chunk(4, dim=-1)  # each (B, H)
        i, f, o = torch.sigmoid(i), torch.sigmoid(f), torch.sigmoid(o)  # input, forget, output gates
        c = f * c + i * torch.tanh(g)  # cell update with the candidate c~ = tanh(g)
        h = o * torch.tanh(c)
        return h, (h, c)


class LSTM(nn.Module):
    """Runs an LSTMCell over a batch-first sequence: x (B, T, in) -> outputs (B, T, H), final (h, c)."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.cell = LSTMCell(input_size, hidden_size)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if state is None:
            zeros = x.new_zeros(x.shape[0], self.cell.hidden_size)
            state = (zeros, zeros)
        outputs = []
        # the sequential dependence that Remark 6 ("From LSTMs to Transformers") names as the LSTM's limit
        for t in range(x.shape[1]):
            h, state = self.cell(x[:, t], state)
            outputs.append(h)
        return torch.stack(outputs, dim=1), state
