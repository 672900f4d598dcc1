"""The text checkpoints that the session's `models_stack` fixture serves (tests/e2e/conftest.py): tiny random models
of every family of issue 31 (tests/e2e/test_e2e_architectures.py), DeepSeek-V3 as the text app's first model and the
others as its further `models`, with the serve-config args of its text app. The same stack serves
tests/services/diffusion/tiny_sd.py's Stable Diffusion folder as its diffusion model (tests/e2e/test_e2e_sd.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "text"))
from test_text_architectures import COMMON, _configs, _randomise  # noqa: E402
from text_helpers import byte_tokenizer  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The text app's engine settings in the serve config (GetModelInfo reports them); float32 keeps transformers' parity.
# 256 KiB of KV cache: two full contexts of this tiny model.
TEXT_ARGS = {"dtype": "float32", "kv_cache_bytes": 256 * 2**10, "max_running": 7}


# The text app's first model: multi-head latent attention, grouped sigmoid routing, shared experts, YaRN.
FIRST = "deepseek_v3"
# Its further base models, by the name requests give (TextRequest.model, the OpenAI API's `model`).
FURTHER = tuple(sorted(set(_configs()) - {FIRST}))


def family_checkpoint(family: str, folder: Path) -> Any:
    """A random model of `family` (test_text_architectures' configs: 4 layers, every layer kind) saved to `folder`
    with a byte tokenizer and a ChatML template; returns the transformers model."""
    cfg_cls, model_cls, extra = _configs()[family]
    hf = model_cls(cfg_cls(**{**COMMON, **extra}, attn_implementation="eager")).eval()
    _randomise(hf, unit_offset=family.startswith("gemma"))
    hf.save_pretrained(folder)
    byte_tokenizer()._tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return hf
