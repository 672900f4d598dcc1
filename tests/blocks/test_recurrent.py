"""RNN cell (Def. 10, "Recurrent Neural Network", of the chapter "Deep Learning Building Blocks") and LSTM (Def. 11,
"LSTM Cell") against torch.nn with copied weights."""

from __future__ import annotations

import torch
from torch import nn

from genserve.shared.blocks.recurrent import LSTM, RNNCell


def test_lstm_matches_torch_lstm_with_copied_weights() -> None:
    ref = nn.LSTM(6, 10, batch_first=True)
    ours = LSTM(6, 10)
    with torch.no_grad():
        ours.cell.w.weight.copy_(torch.cat((ref.weight_hh_l0, ref.weight_ih_l0), dim=1))  # W acts on [h_{t-1}, x_t]
        ours.cell.w.bias.copy_(ref.bias_ih_l0 + ref.bias_hh_l0)
    x = torch.randn(3, 7, 6)
    h0, c0 = torch.randn(1, 3, 10), torch.randn(1, 3, 10)
    out_ref, (h_ref, c_ref) = ref(x, (h0, c0))
    out, (h, c) = ours(x, (h0[0], c0[0]))
    assert torch.allclose(out, out_ref, atol=1e-6)
    assert torch.allclose(h, h_ref[0], atol=1e-6) and torch.allclose(c, c_ref[0], atol=1e-6)
    out_zero, _ = ours(x)
    assert torch.allclose(out_zero, ref(x)[0], atol=1e-6)


def test_rnn_cell_follows_definition_10_and_matches_torch() -> None:
    cell = RNNCell(4, 5, output_size=3)
    x, h = torch.randn(2, 4), torch.randn(2, 5)
    y, h_new = cell(x, h)
    expected_h = torch.tanh(h @ cell.w_h.weight.T + x @ cell.w_x.weight.T + cell.w_x.bias)
    assert torch.allclose(h_new, expected_h, atol=1e-6)
    assert torch.allclose(y, h_new @ cell.w_y.weight.T + cell.w_y.bias, atol=1e-6)
    ref = nn.RNNCell(4, 5, nonlinearity="tanh")
    with torch.no_grad():
        ref.weight_ih.copy_(cell.w_x.weight)
        ref.bias_ih.copy_(cell.w_x.bias)
        ref.weight_hh.copy_(cell.w_h.weight)
        ref.bias_hh.zero_()
    assert torch.allclose(ref(x, h), h_new, atol=1e-6)
