"""Decode-only engine steps of an fp32 model on the CPU, one fused kernel call per step.

A decode step reads every weight once; op by op in PyTorch, the small tensor ops around the matrix-vector products
cost about as much again as the products themselves. ``CpuDecoder`` runs the same math as
``LlamaForCausalLM.forward_paged`` for batches without prefill chunks through ``kernels.cpu_decode_step``: the
embedding lookup, every layer, the final norm and the LM head in one call. ``for_model`` returns None where the
kernel does not apply (not CPU fp32, quantised weights, gated attention, the parallel block, MoE, interleaved RoPE,
a biased LM head, or no C compiler), and the engine keeps ``forward_paged``.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_decode_step
from services.text.model import LlamaForCausalLM
from services.text.paged import PagedBatch
from shared.blocks.ffn import SwiGLU


def _weight(linear: nn.Module) -> torch.Tensor:
    return linear.weight.detach()


def _bias(linear: nn.Module) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


class CpuDecoder:
    max_tokens = 16  # the kernel's products are row by row: past this, blocked GEMMs (forward_paged) win

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        cfg = model.config
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(cpu_decode_step.LayerWeights(
                ln1=layer.input_layernorm.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
                wq=_weight(attn.q_proj), wk=_weight(attn.k_proj), wv=_weight(attn.v_proj), wo=_weight(attn.o_proj),
                bq=_bias(attn.q_proj), bk=_bias(attn.k_proj), bv=_bias(attn.v_proj),
                wg=_weight(mlp.gate_proj), wu=_weight(mlp.up_proj), wd=_weight(mlp.down_proj),
                n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, eps=cfg.norm_eps,
                scale=attn.sm_scale, window=cfg.sliding_window))
        self.kernel = cpu_decode_step.StepKernel(
            layers, embed=model.model.embed_tokens.weight.detach(), norm=model.model.norm.weight.detach(),
            eps=model.model.norm.eps, head=_weight(model.lm_head), n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim, ffn=cfg.ffn_hidden)

    @classmethod
    def for_model(cls, model: nn.Module) -> CpuDecoder | None:
        if not isinstance(model, LlamaForCausalLM) or not cpu_decode_step.available():
            return None
        cfg, head = model.config, model.lm_head
        if cfg.gated_attention or cfg.parallel_block or cfg.n_experts:
            return None
        if (not isinstance(head, nn.Linear) or head.bias is not None or head.weight.dtype != torch.float32
                or head.weight.device.type != "cpu" or model.model.embed_tokens.weight.dtype != torch.float32):
            return None
        for layer in model.model.layers:
            attn = layer.self_attn
            projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj,
                           layer.mlp.up_proj, layer.mlp.down_proj) if isinstance(layer.mlp, SwiGLU) else ()
            if (attn.rope_interleaved or attn.o_proj.bias is not None or not projections
                    or any(not isinstance(p, nn.Linear) or p.weight.dtype != torch.float32
                           or p.weight.device.type != "cpu" for p in projections)):
                return None
        return cls(model)

    def __call__(self, batch: PagedBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
                 ) -> torch.Tensor:
        """Next-token logits (S, V) for a batch of decode tokens only (``batch.prefills`` empty)."""
        if batch.prefills:
            raise ValueError("CpuDecoder runs decode-only batches; prefill chunks go through forward_paged")
        cos, sin = self.model.rope.tables()
        logits = self.kernel.run(batch.input_ids, batch.positions, batch.slots, batch.decode_tables, batch.decode_lens,
                                 cos, sin, k_caches, v_caches)  # (M, V): every decode token samples
        return logits if logits.shape[0] == batch.logits_index.numel() else logits[batch.logits_index]

    def greedy(self, batch: PagedBatch, steps: int, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
               ) -> list[list[int]]:
        """``steps`` greedy tokens for every decode token of a decode-only batch, in one kernel call: each row's
        argmax is fed back at its next position. The batch's block tables must already cover ``steps`` positions
        from each token's."""
        if batch.prefills:
            raise ValueError("CpuDecoder runs decode-only batches; prefill chunks go through forward_paged")
        cos, sin = self.model.rope.tables()
        return self.kernel.greedy(steps, batch.input_ids, batch.positions, batch.slots, batch.decode_tables,
                                  batch.decode_lens, cos, sin, k_caches, v_caches).tolist()
