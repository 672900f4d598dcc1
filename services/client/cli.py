"""`genserve`: call the served models, or run the offline tools (generate, train, serve).

Serving calls go to --address (default 127.0.0.1:9000, or $GENSERVE_ADDRESS) with --api-key (default
$GENSERVE_API_KEY; needed when the server has keys), over TLS with --tls-ca (and --tls-cert/--tls-key for mutual
TLS); these and --timeout go before or after the subcommand. Exit status 1 on a gRPC error (its code and details are
printed on stderr; "no genserve server at ADDR" when nothing answers), 2 when a local input file is missing or
unreadable.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from . import requests
from .errors import GenserveError, Unavailable
from .sync import DEFAULT_ADDRESS, Client
from .tls import CA_ENV, CERT_ENV, KEY_ENV, ClientTls

OFFLINE_TRAIN = ("text", "vae", "gan", "diffusion")
HEALTH = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
SERVICES = {
    "text": "genserve.v1.TextGeneration",
    "gan": "genserve.v1.ImageGan",
    "vae": "genserve.v1.Vae",
    "diffusion": "genserve.v1.Diffusion",
}


def _write_images(images, output: Path, stem: str) -> list[Path]:
    """One image to FILE.png when `output` ends in .png, otherwise DIR/<stem>-<i>.png."""
    if output.suffix.lower() == ".png":
        if len(images) == 1:
            paths = [output]
        else:
            paths = [output.with_name(f"{output.stem}-{i}.png") for i in range(len(images))]
    else:
        paths = [output / f"{stem}-{i}.png" for i in range(len(images))]
    for path, image in zip(paths, images, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(image.png)
        print(path)
    return paths


def cmd_text(client: Client, args: argparse.Namespace) -> int:
    options = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or (), json_schema=args.json_schema, regex=args.regex, adapter=args.adapter,
        model=args.model,
    )
    if args.stream:
        for chunk in client.generate_stream(args.prompt, **options):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            finish = chunk.finish_reason
        print(f"\n[finish_reason: {finish}]" if args.verbose else "")
        return 0
    reply = client.generate(args.prompt, **options)
    if args.json:
        fields = {"text": reply.text, "token_ids": list(reply.token_ids), "finish_reason": reply.finish_reason}
        print(json.dumps(fields))
    else:
        print(reply.text)
        if args.verbose:
            print(f"[finish_reason: {reply.finish_reason}, tokens: {len(reply.token_ids)}]")
    return 0


def _stream_answer(client: Client, messages: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the assistant's answer as it streams in, then each call it made as `call NAME(ARGUMENTS)  [id]`;
    returns the assistant's turn (content and tool_calls) for the history."""
    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                   tools=args.tools, tool_choice=args.tool_choice, adapter=args.adapter, model=args.model)
    parts: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.generate_stream(messages=messages, **options):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        parts.append(chunk.text)
        for piece in chunk.tool_calls:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id
            call["name"] += piece.name
            call["arguments"] += piece.arguments
    if parts and "".join(parts).strip():
        print()
    for call in calls.values():
        print(f"call {call['name']}({call['arguments']})  [{call['id']}]")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
    if calls:
        turn["tool_calls"] = list(calls.values())
    return turn


def _read_tools(path: Path | None) -> list[dict[str, Any]]:
    """`--tools FILE.json`: a JSON list of OpenAI function tools."""
    if path is None:
        return []
    tools = json.loads(path.read_text())
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise SystemExit(f"{path}: --tools needs a JSON list of tools ({{\"type\": \"function\", \"function\": ...}})")
    return tools


def cmd_chat(client: Client, args: argparse.Namespace) -> int:
    """One question (`genserve chat "..."`), or an interactive loop that keeps the history: /reset, Ctrl-D."""
    system = [{"role": "system", "content": args.system}] if args.system else []
    args.tools = _read_tools(args.tools_file)
    if args.question is not None:
        _stream_answer(client, [*system, {"role": "user", "content": args.question}], args)
        return 0
    print(f"chatting with {client.model_info(args.model).model_name} at {client.address}; /reset forgets, Ctrl-D quits",
          file=sys.stderr)
    history = list(system)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        if line == "/reset":
            history = list(system)
            print("(history cleared)", file=sys.stderr)
        elif line:
            history.append({"role": "user", "content": line})
            history.append(_stream_answer(client, history, args))


def cmd_tokenize(client: Client, args: argparse.Namespace) -> int:
    reply = client.tokenize(args.text, model=args.model)
    print(json.dumps({"token_ids": list(reply.token_ids), "tokens": list(reply.tokens)}))
    return 0


def cmd_info(client: Client, args: argparse.Namespace) -> int:
    info = client.model_info(args.model)
    for field in info.DESCRIPTOR.fields:
        print(f"{field.name:16} {getattr(info, field.name)}")
    return 0


def cmd_adapters(client: Client, args: argparse.Namespace) -> int:
    """`genserve adapters list | load NAME PATH | unload NAME`: the text model's LoRA adapters, one name a line."""
    if args.op == "load":
        names = client.load_adapter(args.name, args.path)
    elif args.op == "unload":
        names = client.unload_adapter(args.name)
    else:
        names = list(client.model_info().adapters)
    print("\n".join(names))
    return 0


def cmd_gan(client: Client, args: argparse.Namespace) -> int:
    if args.interpolate_to is not None:
        seed = args.seed if args.seed is not None else 0
        reply = client.gan_interpolate(seed, args.interpolate_to, steps=args.num_images, truncation=args.truncation)
    else:
        reply = client.gan_sample(args.num_images, seed=args.seed, truncation=args.truncation)
    _write_images(reply.images, args.output, "gan")
    print(f"seed: {reply.seed}", file=sys.stderr)
    return 0


def cmd_vae(client: Client, args: argparse.Namespace) -> int:
    if args.op == "decode":
        tensor = json.loads(args.inputs[0].read_text())
        reply = client.vae_decode(tensor["shape"], tensor["values"])
        _write_images(reply.images, args.output, "decoded")
        return 0
    pngs = [path.read_bytes() for path in args.inputs]
    if args.op == "reconstruct":
        _write_images(client.vae_reconstruct(pngs).images, args.output, "reconstructed")
        return 0
    reply = client.vae_encode(pngs, sample=args.sample, seed=args.seed)
    latents = {"shape": list(reply.latents.shape), "values": requests.tensor_values(reply.latents),
               "scaling_factor": reply.scaling_factor}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(latents))
    print(args.output)
    return 0


def cmd_diffuse(client: Client, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    events = client.diffuse_stream(
        args.prompt, negative_prompt=args.negative, num_images=args.num_images, steps=args.steps,
        guidance_scale=args.guidance, seed=args.seed, scheduler=args.scheduler, eta=args.eta, width=args.width,
        height=args.height, guidance=args.guidance_mode, negative_weight=args.negative_weight,
    )
    with tqdm(total=args.steps, unit="step", desc="denoising", file=sys.stderr) as bar:
        for event in events:
            if event.HasField("progress"):
                bar.total = event.progress.total_steps
                bar.update(event.progress.step - bar.n)
            elif event.HasField("result"):
                result = event.result
    _write_images(result.images, args.output, "diffusion")
    print(f"seed: {result.seed}", file=sys.stderr)
    return 0


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    reply = client.status()
    print(f"{'app':10} {'status':14} {'replicas':24} health")
    for app in reply.apps:
        replicas = ", ".join(f"{n} {state.lower()}" for state, n in sorted(app.replicas.items())) or "-"
        health = HEALTH.get(client.health(SERVICES[app.name], application=app.name)) if app.name in SERVICES else ""
        print(f"{app.name:10} {app.status:14} {replicas:24} {health}")
    return 0


def _common_options(defaults: bool) -> argparse.ArgumentParser:
    """--address, --timeout and --api-key; after the subcommand they default to nothing, so those before it still
    count."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--address", default=DEFAULT_ADDRESS if defaults else argparse.SUPPRESS,
                        help="host:port of the gRPC proxy (default $GENSERVE_ADDRESS or 127.0.0.1:9000)")
    parser.add_argument("--timeout", type=float, default=None if defaults else argparse.SUPPRESS,
                        help="per-call deadline in seconds")
    parser.add_argument("--api-key", default=None if defaults else argparse.SUPPRESS,
                        help="the server's API key (default $GENSERVE_API_KEY)")
    for flag, env, what in (("--tls-ca", CA_ENV, "connect over TLS, trusting this CA (PEM)"),
                            ("--tls-cert", CERT_ENV, "client certificate (PEM) for a mutual-TLS server"),
                            ("--tls-key", KEY_ENV, "the client certificate's key (PEM)")):
        parser.add_argument(flag, metavar="FILE", default=os.environ.get(env) if defaults else argparse.SUPPRESS,
                            help=f"{what} (default ${env})")
    return parser


def _tls(args: argparse.Namespace) -> ClientTls | None:
    """None (plaintext) unless a --tls-* flag or GENSERVE_TLS_CA / _CLIENT_CERT / _CLIENT_KEY is given."""
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key)


def _client_parsers(sub: argparse._SubParsersAction) -> None:
    common = [_common_options(defaults=False)]
    p = sub.add_parser("text", help="complete a prompt (TextGeneration.Generate / GenerateStream)", parents=common)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float, help="0 = greedy; default 1.0")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--adapter", help="a loaded LoRA adapter (`genserve adapters list`); default: the base model")
    p.add_argument("--model", help="one of the text app's further base models (`genserve info` lists them); "
                                   "default: its first")
    grammar = p.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", help="a JSON Schema (as JSON text) the output must satisfy")
    grammar.add_argument("--regex", help="a regular expression the whole output must match")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--json", action="store_true", help="print {text, token_ids, finish_reason}")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_text)

    p = sub.add_parser("chat", parents=common,
                       help="chat with the text model: one question, or an interactive loop (streamed answers)")
    p.add_argument("question", nargs="?", help="ask once and exit; without it, an interactive loop")
    p.add_argument("--system", help="a system message to start the conversation with")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--tools", dest="tools_file", type=Path, metavar="FILE.json",
                   help="a JSON list of OpenAI function tools the model may call; its calls are printed")
    p.add_argument("--tool-choice", help="auto (default with --tools), none, required, or a tool's name")
    p.add_argument("--adapter", help="a loaded LoRA adapter (`genserve adapters list`); default: the base model")
    p.add_argument("--model", help="one of the text app's further base models (`genserve info` lists them); "
                                   "default: its first")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("tokenize", help="token ids of a text (TextGeneration.Tokenize)", parents=common)
    p.add_argument("text")
    p.add_argument("--model", help="one of the text app's further base models (`genserve info` lists them); "
                                   "default: its first")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("info", help="the served text model (TextGeneration.GetModelInfo)", parents=common)
    p.add_argument("--model", help="one of the text app's further base models (`genserve info` lists them); "
                                   "default: its first")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("adapters", parents=common,
                       help="the text model's LoRA adapters: list, load NAME PATH, unload NAME (admin key)")
    ops = p.add_subparsers(dest="op", required=True)
    ops.add_parser("list", help="the adapters loaded now", parents=common)  # --address etc. after the op too
    load = ops.add_parser("load", help="load the PEFT folder PATH (under the server's lora.root) as NAME",
                          parents=common)
    load.add_argument("name")
    load.add_argument("path")
    ops.add_parser("unload", help="unload adapter NAME", parents=common).add_argument("name")
    p.set_defaults(func=cmd_adapters)

    p = sub.add_parser("gan", help="sample images from the GAN (ImageGan.Sample / Interpolate)", parents=common)
    p.add_argument("-n", "--num-images", type=int, default=1)
    p.add_argument("--seed", type=int)
    p.add_argument("--truncation", type=float)
    p.add_argument("--interpolate-to", type=int, metavar="SEED", help="walk from --seed to SEED in -n images")
    p.add_argument("-o", "--output", type=Path, default=Path("."), help="a directory, or FILE.png")
    p.set_defaults(func=cmd_gan)

    p = sub.add_parser("vae", help="encode images to latents (JSON), decode latents, or round-trip images",
                       parents=common)
    p.add_argument("op", choices=("encode", "decode", "reconstruct"))
    p.add_argument("inputs", nargs="+", type=Path, help="PNG files (encode, reconstruct) or one latents JSON")
    p.add_argument("-o", "--output", type=Path, required=True, help="latents.json (encode), or a dir / FILE.png")
    p.add_argument("--sample", action="store_true", help="encode: sample the posterior instead of its mean")
    p.add_argument("--seed", type=int)
    p.set_defaults(func=cmd_vae)

    p = sub.add_parser("diffuse", help="text to image, with a progress bar (Diffusion.GenerateStream)",
                       parents=common)
    p.add_argument("prompt")
    p.add_argument("--negative", default="", help="negative prompt")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=3.0, help="guidance scale")
    p.add_argument("--guidance-mode", default="", choices=("", "cfg", "perp_neg"),
                   help="how the negative prompt steers (default: the model's; docs/protocol.md)")
    p.add_argument("--negative-weight", type=float,
                   help="perp_neg's negative weight w_n (default: the model's; demo 0.3, SD folder 1)")
    p.add_argument("--seed", type=int)
    p.add_argument("--scheduler", default="", choices=("", "ddpm", "ddim", "dpmpp_2m", "euler"),
                   help="sampler (default: the model's)")
    p.add_argument("--eta", type=float)
    p.add_argument("--width", type=int, help="pixels, a multiple of 8 (default: the model's native size)")
    p.add_argument("--height", type=int, help="pixels, a multiple of 8 (default: the model's native size)")
    p.add_argument("-n", "--num-images", type=int, default=1)
    p.add_argument("-o", "--output", type=Path, required=True, help="FILE.png (FILE-i.png for several)")
    p.set_defaults(func=cmd_diffuse)

    p = sub.add_parser("status", help="the applications, their replicas and health", parents=common)
    p.set_defaults(func=cmd_status)


def _offline_parsers(sub: argparse._SubParsersAction) -> None:
    """Parsers of the offline tools, filled by their own modules (imported only when one is used)."""
    sub.add_parser("generate", help="run the text engine in-process, no server", add_help=False)
    train = sub.add_parser("train", help="train a demo model", add_help=False)
    train.add_argument("model", choices=OFFLINE_TRAIN)
    sub.add_parser("serve", help="start the local stack (same as `make serve`)", add_help=False)


def _run_offline(module_name: str, prog: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=prog)
    module.add_arguments(parser)
    result = module.run(parser.parse_args(argv))
    # Training commands return their final metrics; finishing at all is success.
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="genserve", description=__doc__.splitlines()[0],
                                     parents=[_common_options(defaults=True)])
    sub = parser.add_subparsers(dest="command", required=True)
    _client_parsers(sub)
    _offline_parsers(sub)
    args, rest = parser.parse_known_args(argv)
    if args.command == "generate":
        return _run_offline("genserve.services.text.generate", "genserve generate", rest)
    if args.command == "serve":
        return _run_offline("genserve.services.serve", "genserve serve", rest)
    if args.command == "train":
        return _run_offline(f"genserve.services.{args.model}.train", f"genserve train {args.model}", rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        with Client(args.address, timeout=args.timeout, api_key=args.api_key, tls=_tls(args)) as client:
            return args.func(client, args)
    except GenserveError as error:
        details = error.details.lower()
        if isinstance(error, Unavailable) and ("handshake" in details or "tsi_" in details):
            print(f"genserve: the TLS handshake with {args.address} failed (a plaintext server, a certificate that "
                  f"--tls-ca does not trust, or a client certificate refused): {error.details}", file=sys.stderr)
        elif isinstance(error, Unavailable) and "socket closed" in details:
            print(f"genserve: {args.address} closed the connection: a TLS server called without --tls-ca, or a "
                  "mutual-TLS one without --tls-cert/--tls-key?", file=sys.stderr)
        elif isinstance(error, Unavailable) and "failed to connect" in details:
            print(f"genserve: no genserve server at {args.address} — start one with `make serve`", file=sys.stderr)
        else:
            print(f"genserve: {error.code.name}: {error.details}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (OSError, ValueError) as error:  # a local file that is missing or not what the command reads
        print(f"genserve: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
