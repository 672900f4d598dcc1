"""Random PEFT LoRA adapters for the tiny test checkpoints, and their greedy tokens through transformers + peft."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# Three adapters of different ranks and targets: attention only; every projection with rsLoRA; the FFN and o_proj.
ADAPTERS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8": dict(r=8, lora_alpha=16, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "ffn2": dict(r=2, lora_alpha=6, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def save_adapter(base, directory: Path, seed: int, **lora) -> Path:
    """A PEFT LoRA adapter of ``base`` (left unchanged) with every A and B random (PEFT starts B at zero, which would
    make the adapter a no-op), saved in PEFT's format."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(directory)
    return directory


def peft_greedy(base, adapter_dir: Path | None, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from ``base`` with the adapter in ``adapter_dir`` (None: the base)."""
    from peft import PeftModel

    model = base if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def demo_adapter(directory: Path, seed: int, r: int = 4) -> Path:
    """A random rank-``r`` PEFT adapter of q_proj and v_proj for the committed demo text model
    (services/text/weights: 4 layers, width 256, 2 KV heads of 64), written without peft, so a test that only serves
    it needs neither peft nor transformers."""
    import json

    from safetensors.torch import save_file

    config = json.loads((Path(__file__).resolve().parents[3] / "services/text/weights/config.json").read_text())
    width = config["hidden_size"]
    outs = {"q_proj": config["num_attention_heads"] * config["head_dim"],
            "v_proj": config["num_key_value_heads"] * config["head_dim"]}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = 0.15 * torch.randn(r, width, generator=gen)
            tensors[f"{key}.lora_B.weight"] = 0.15 * torch.randn(out, r, generator=gen)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(outs)}))
    return directory
