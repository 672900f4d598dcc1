"""The tokenizer of a model directory: ``tokenizer.json`` through the ``tokenizers`` library, plus the
``tokenizer_config.json`` special tokens and jinja2 ``chat_template``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# Used when a checkpoint ships no chat template: one "role: content" line per message, then the assistant cue.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(value: object) -> str | None:
    """Special tokens in tokenizer_config.json are either strings or AddedToken dicts ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Encode/decode and chat formatting for one checkpoint (``tokenizer.json`` + ``tokenizer_config.json``)."""

    def __init__(self, tokenizer: Tokenizer, config: dict | None = None, eos_token_ids: tuple[int, ...] = ()):
        self._tok = tokenizer
        self.config = dict(config or {})
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        ids = list(eos_token_ids)
        if self.eos_token is not None and (eid := tokenizer.token_to_id(self.eos_token)) is not None:
            ids.insert(0, eid)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.chat_template = self.config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        if isinstance(self.chat_template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values())))
        # The same environment settings transformers renders chat templates with, so templates behave alike.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(self.chat_template)

    @classmethod
    def from_dir(cls, directory: str | Path, eos_token_ids: tuple[int, ...] = ()) -> TextTokenizer:
        root = Path(directory)
        path = root / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: a text model directory needs a tokenizer.json")
        cfg_path = root / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        return cls(Tokenizer.from_file(str(path)), config, eos_token_ids)

    @property
    def backend(self) -> Tokenizer:
        """The ``tokenizers`` object itself (its vocabulary and serialised form, for the grammar compiler)."""
        return self._tok

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the checkpoint's jinja2 chat template."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")
