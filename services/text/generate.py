"""``genserve generate``: run the text engine in-process (no Ray) on one prompt, or one chat question.

    genserve generate [--model-dir PATH] [--lora ADAPTER_DIR] [--chat] [--max-tokens N --temperature T --seed S
                      --json] [--speculative ngram|draft --num-speculative-tokens K --draft-model-dir DIR] "PROMPT"

Also runnable as ``python -m genserve.services.text.generate``. Without ``--model-dir``: $GENSERVE_TEXT_MODEL, else the
default model once fetched (services/text/default_model.py), else the committed demo model. ``--chat`` sends the
prompt as a user message through the model's chat template and prints only the answer. ``--lora`` runs the request
with the PEFT LoRA adapter in that folder (services/text/lora.py). ``--speculative`` decodes with exact speculative
decoding (services/text/engine/speculative.py): n-gram drafts, or a draft model's (``--draft-model-dir``, a smaller
model with the same tokenizer); the output is the same as without, and ``--json`` adds the acceptance counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from genserve.services.text import default_model
from genserve.services.text.engine.adapters import LoraConfig
from genserve.services.text.engine.async_engine import AsyncLLMEngine
from genserve.services.text.engine.engine import EngineConfig
from genserve.services.text.engine.params import InvalidAdapter, PromptTooLong, SamplingParams
from genserve.services.text.engine.speculative import SpeculativeConfig
from genserve.services.text.tokenizer import NoChatTemplate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="text to continue (with --chat: a question)")
    parser.add_argument("--model-dir", default=None,
                        help="a HF checkpoint directory or a GGUF file (default: $GENSERVE_TEXT_MODEL, else the "
                             "fetched default model, else the demo model)")
    parser.add_argument("--chat", action="store_true", help="ask the prompt as a chat message, print the answer")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "int8"), default="float32",
                        help="int8: int8 weight-only linear layers (fastest CPU decoding)")
    parser.add_argument("--json", action="store_true", help='print {"text", "token_ids", "finish_reason"}')
    parser.add_argument("--lora", default=None, help="a PEFT LoRA adapter folder (adapter_config.json + "
                        "adapter_model.safetensors) to run the prompt with")
    parser.add_argument("--max-lora-rank", type=int, default=64, help="the largest adapter rank --lora accepts")
    parser.add_argument("--speculative", choices=("ngram", "draft"), default=None,
                        help="speculative decoding: n-gram (prompt lookup) drafts, or a draft model's")
    parser.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_tokens,
                        help="tokens drafted per step")
    parser.add_argument("--draft-model-dir", default=None,
                        help="with --speculative draft: the draft model, a HF folder or GGUF file with the "
                             "model's tokenizer")


def run(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                                adapter="lora" if args.lora else "")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lora = spec = None
    if args.lora:  # one adapter, its own folder's parent as the root
        folder = Path(args.lora).resolve()
        lora = LoraConfig(root=str(folder.parent), max_loras=1, max_cpu_loras=1, max_lora_rank=args.max_lora_rank,
                          adapters=(("lora", folder.name),))
    try:
        if args.speculative == "draft" and not args.draft_model_dir:
            raise ValueError("--speculative draft needs --draft-model-dir, the draft model's folder or GGUF file")
        if args.speculative:
            spec = SpeculativeConfig(method=args.speculative, num_tokens=args.num_speculative_tokens,
                                     draft_model_dir=args.draft_model_dir or "")
        elif args.draft_model_dir:
            raise ValueError("--draft-model-dir goes with --speculative draft")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        engine = AsyncLLMEngine.from_dir(default_model.resolve(args.model_dir), dtype=args.dtype,
                                         config=EngineConfig(lora=lora, speculative=spec)).engine
    except (InvalidAdapter, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = engine.tokenizer
    try:
        if args.chat:
            chat = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
            prompt_ids = tokenizer.encode(chat, add_special_tokens=False)
        else:
            prompt_ids = tokenizer.encode(args.prompt)
        text, token_ids, reason = engine.generate_batch([prompt_ids], params)[0]
    except (PromptTooLong, NoChatTemplate) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {"text": text, "token_ids": token_ids, "finish_reason": reason}
        if spec is not None:
            stats = engine.speculation_stats()
            out["speculation"] = {k: stats[k] for k in ("proposed", "accepted", "acceptance_rate")}
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(text if args.chat else args.prompt + text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="genserve generate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
