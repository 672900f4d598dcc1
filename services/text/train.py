"""``genserve train text``: train the demo language model on the Python documentation every install carries.

Byte-level BPE (``tokenizers``) over ``genserve.services.text.corpus``, a small Llama-style decoder, AdamW with warmup
and cosine decay over a step or time budget, held-out validation in bits per byte, and an HF-layout checkpoint
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, training.json) that the text service
loads by default. Also runnable as ``python -m genserve.services.text.train``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from genserve.services.text import corpus
from genserve.services.text.config import LlamaConfig
from genserve.services.text.loader import load_model, save_model
from genserve.services.text.model import LlamaForCausalLM

EOS = "<|endoftext|>"
DEFAULT_OUT = Path(__file__).resolve().parent / "weights"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint directory to write")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn-hidden", type=int, default=704)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--minutes", type=float, default=18.0, help="stop after this much training time")
    parser.add_argument("--autocast", choices=("none", "bfloat16"), default="bfloat16",
                        help="mixed precision for the forward/backward (fp32 master weights); bf16 is ~2x on AVX512")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-chars", type=int, default=6_000_000,
                        help="cap on the stdlib docstring text (the pydoc topics are always included)")
    parser.add_argument("--init-from", default=None,
                        help="continue from this checkpoint (its tokenizer and architecture; size flags ignored)")
    parser.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="dtype of the saved weights (bfloat16 keeps the committed file small)")


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every string encodes (no unknown tokens) and decoding is lossless."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one token stream, each followed by the end-of-text token."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(progress: float, base: float, warmup: float = 0.03) -> float:
    """Linear warmup then cosine decay to 10% (progress in [0, 1])."""
    if progress < warmup:
        return base * progress / warmup
    p = (progress - warmup) / (1 - warmup)
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * min(p, 1.0))))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, batch_size: int = 16) -> float:
    """Mean next-token NLL (nats/token) over non-overlapping windows of the validation stream."""
    model.eval()
    n = (stream.numel() - 1) // seq_len
    x = stream[: n * seq_len].view(n, seq_len)
    y = stream[1 : n * seq_len + 1].view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch_size):
        logits = model(x[i : i + batch_size])
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + batch_size].flatten(), reduction="sum").item()
    model.train()
    return total / (n * seq_len)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train_docs, val_docs = corpus.documents(args.corpus_chars)
    tok = Tokenizer.from_file(str(Path(args.init_from) / "tokenizer.json")) if args.init_from else \
        train_tokenizer(train_docs, args.vocab_size)
    train_ids, val_ids = encode_stream(tok, train_docs), encode_stream(tok, val_docs)
    val_bytes = sum(len(d.encode("utf-8")) + len(EOS) for d in val_docs)
    eos = tok.token_to_id(EOS)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden, max_position=1024, tie_embeddings=True,
                      eos_token_ids=(eos,), bos_token_id=None, norm_eps=1e-5)
    if args.init_from:
        model = load_model(args.init_from, "float32")
        cfg = model.config
    else:
        model = LlamaForCausalLM(cfg)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith(("o_proj.weight", "down_proj.weight"))  # GPT-2's residual-branch scaling
                torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers) if scaled else 0.02)
    model.train()
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    print(f"params {model.num_params():,}  train tokens {train_ids.numel():,}  val tokens {val_ids.numel():,}")
    budget_s = args.minutes * 60
    start = time.perf_counter()
    bar = tqdm(range(args.max_steps), desc="train text", unit="step")
    steps = 0
    for step in bar:
        progress = max(step / args.max_steps, (time.perf_counter() - start) / budget_s)
        if progress >= 1:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, args.lr)
        starts = torch.randint(0, train_ids.numel() - args.seq_len - 1, (args.batch_size,))
        x = torch.stack([train_ids[s : s + args.seq_len] for s in starts])
        y = torch.stack([train_ids[s + 1 : s + args.seq_len + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bfloat16"):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
    bar.close()
    train_s = time.perf_counter() - start
    val_nll = evaluate(model, val_ids, args.seq_len)
    bpb = val_nll * val_ids.numel() / val_bytes / math.log(2)
    out = Path(args.out)
    save_model(out, model, dtype=torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "bos_token": None, "model_max_length": cfg.max_position, "chat_template": CHAT_TEMPLATE,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    previous = json.loads((Path(args.init_from) / "training.json").read_text()) if args.init_from else {}
    report = {"command": "genserve train text", "runs": previous.get("runs", 0) + 1,
              "total_steps": previous.get("total_steps", previous.get("steps", 0)) + steps,
              "total_train_seconds": round(previous.get("total_train_seconds", previous.get("train_seconds", 0))
                                           + train_s, 1),
              "params": model.num_params(), "steps": steps,
              "train_seconds": round(train_s, 1), "tokens_seen": steps * args.batch_size * args.seq_len,
              "threads": args.threads, "val_nll_nats_per_token": round(val_nll, 4), "val_bits_per_byte": round(bpb, 4),
              "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(), "val_bytes": val_bytes}
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
