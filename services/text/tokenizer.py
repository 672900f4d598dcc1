"""The tokenizer of a model: ``tokenizer.json`` through the ``tokenizers`` library with the ``tokenizer_config.json``
special tokens, or a GGUF file's own (services/text/gguf_tokenizer.py); and the checkpoint's jinja2 chat template.

The chat template is read from ``chat_template.jinja``, ``tokenizer_config.json`` or the GGUF metadata, in that order
(transformers >= 4.43 saves it in the first). A model without one has no chat: ``apply_chat_template`` raises
``NoChatTemplate`` rather than guess a format.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from genserve.services.text.engine.params import NoChatTemplate
from genserve.services.text.gguf import GGUFCheckpoint, find_gguf
from genserve.services.text.gguf_tokenizer import gguf_tokenizer
from genserve.services.text.tools.formats import has_reasoning, tool_format

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_text(value: object) -> str | None:
    """Special tokens in tokenizer_config.json are either strings or AddedToken dicts ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Encode/decode and chat formatting for one checkpoint (``tokenizer.json`` + ``tokenizer_config.json``)."""

    def __init__(self, tokenizer: Tokenizer, config: dict | None = None, eos_token_ids: tuple[int, ...] = (),
                 chat_template: str | list | None = None):
        self._tok = tokenizer
        self.config = dict(config or {})
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        ids = list(eos_token_ids)
        if self.eos_token is not None and (eid := tokenizer.token_to_id(self.eos_token)) is not None:
            ids.insert(0, eid)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        chat_template = chat_template if chat_template is not None else self.config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default", next(iter(named.values())))
        self.chat_template: str | None = chat_template or None
        self._template = _environment().from_string(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, directory: str | Path, eos_token_ids: tuple[int, ...] = ()) -> TextTokenizer:
        """A Hugging Face directory's tokenizer, or a GGUF file's (the file, or a directory holding one)."""
        root = Path(directory)
        gguf_path = find_gguf(root)
        if gguf_path is not None:
            return cls.from_gguf(GGUFCheckpoint.open(gguf_path), eos_token_ids)
        path = root / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: a text model directory needs a tokenizer.json")
        cfg_path = root / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        return cls(Tokenizer.from_file(str(path)), config, eos_token_ids, find_chat_template(root, config))

    @classmethod
    def from_gguf(cls, checkpoint: GGUFCheckpoint, eos_token_ids: tuple[int, ...] = ()) -> TextTokenizer:
        tokenizer, config = gguf_tokenizer(checkpoint.metadata)
        root = checkpoint.path.parent
        template = find_chat_template(root, read_json(root / "tokenizer_config.json"), checkpoint.metadata)
        return cls(tokenizer, config, eos_token_ids, template)

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

    @property
    def tool_format(self) -> str:
        """How tools reach this model and its calls come back (services/text/tools/formats.py)."""
        return tool_format(self.chat_template)

    @property
    def reasoning(self) -> bool:
        """The template has a thinking section (<think>...</think>)."""
        return has_reasoning(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: object) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``, with OpenAI's ``tool_calls`` / ``tool_call_id``
        where set) with the checkpoint's jinja2 chat template. ``tools`` (OpenAI function schemas) and
        ``template_kwargs`` (``enable_thinking``, ``reasoning_effort``) reach the template as transformers'
        ``apply_chat_template`` passes them; ``tools=None`` leaves the variable undefined, as there."""
        if self._template is None:
            raise NoChatTemplate("this model has no chat template (chat_template.jinja, tokenizer_config.json or "
                                 "GGUF metadata); send a plain prompt instead of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        extra = {"tools": tools} if tools is not None else {}
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
            **template_kwargs,
        )


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def find_chat_template(root: Path, tokenizer_config: dict, gguf_metadata: dict | None = None) -> str | list | None:
    """The checkpoint's chat template: chat_template.jinja, then tokenizer_config.json, then the GGUF metadata."""
    path = root / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text()
    return tokenizer_config.get("chat_template") or (gguf_metadata or {}).get("tokenizer.chat_template") or None


def _environment() -> ImmutableSandboxedEnvironment:
    """The same environment settings transformers renders chat templates with, so templates behave alike."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    # transformers' tojson: json.dumps as is, keys in order and no HTML escaping (jinja2's own sorts the keys and
    # escapes `<`, so tool schemas would render differently from the prompt the model was trained on).
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")
