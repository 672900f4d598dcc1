"""The text loader builds the model on the meta device and takes the checkpoint's tensors, read straight into the
target dtype, as its weights (issue 37, defect 4): no random init, and no second copy of the weights in fp32.

Peak RSS is read in a fresh process with its high-water mark reset, so nothing else counts. Loading a bf16
checkpoint in bf16 now takes the tensors safetensors reads, whose pages the file backs until touched; building a
randomly initialised fp32 model first and copying into it, as the loader did, allocated 2 W for it and W for its
cast: on this checkpoint (W = 37 MiB of weights) the peak grew 100 MiB before and 10 MiB after (2026-12-07, 2-core
EPYC)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from genserve.services.text.config import from_hf
from genserve.services.text.loader import load_model, save_model
from genserve.services.text.model import LlamaForCausalLM, make_rope

MEASURE = """
import sys
import torch
from genserve.services.text.loader import load_model

def status(key):  # kB
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])

with torch.device("meta"):  # torch imports its meta kernels on first use: that import is no part of a load
    torch.nn.Embedding(2, 2)
with open("/proc/self/clear_refs", "w") as f:  # peak RSS (VmHWM) := RSS now
    f.write("5")
before = status("VmRSS:")
model = load_model(sys.argv[1], "bfloat16")
assert next(model.parameters()).dtype == torch.bfloat16
print((status("VmHWM:") - before) * 1024)
"""


def _checkpoint(directory: Path) -> tuple[Path, int]:
    """A 20M-parameter Llama saved in bf16 (most of it the two 32k-row embeddings) and its weights' bytes."""
    cfg = from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 256,
                   "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 1024})
    model = LlamaForCausalLM(cfg)
    save_model(directory, model, dtype=torch.bfloat16)
    return directory, 2 * sum(p.numel() for p in model.parameters())


def test_loading_in_bf16_holds_the_weights_once(tmp_path: Path) -> None:
    directory, weight_bytes = _checkpoint(tmp_path)
    done = subprocess.run([sys.executable, "-P", "-c", MEASURE, str(directory)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peak = int(done.stdout.split()[-1])
    assert peak <= 1.25 * weight_bytes, f"peak RSS grew {peak / 2**20:.0f} MiB for {weight_bytes / 2**20:.0f} MiB"


def test_the_loaded_model_is_the_checkpoint_and_derives_its_rope_tables(tmp_path: Path) -> None:
    directory, _ = _checkpoint(tmp_path)
    model = load_model(directory, "bfloat16")
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    again = load_model(directory, "float32")
    torch.testing.assert_close(model.model.embed_tokens.weight.float(), again.model.embed_tokens.weight)
    assert model.rope.cos.dtype == torch.bfloat16 and model.rope.cos.shape == (1024, 32)
    torch.testing.assert_close(model.rope.cos, make_rope(model.config).cos.to(torch.bfloat16))
    torch.testing.assert_close(again.rope.sin, make_rope(again.config).sin)
