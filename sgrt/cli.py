"""The ``sgrt`` command: ``generate``, ``chat``, ``serve`` and ``models``.

Defaults match the engine's (DESIGN.md): greedy unless ``--temperature`` is given.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model name (smollm2-135m-instruct, gemma3-270m-q4-k-m), a .gguf file or a local "
                        "HF folder of a supported family (see `sgrt models`; default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the linear layers (use with --dtype bfloat16)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgrt", description="sgrt: a structured-generation runtime")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="stream a completion of TEXT to stdout")
    gen.add_argument("text")
    gen.add_argument("--chat", action="store_true", help="wrap TEXT as a user message (chat template)")
    gen.add_argument("--json-schema", default=None, help="constrain the output to this JSON Schema (JSON text)")
    gen.add_argument("--regex", default=None, help="constrain the output to this regex")
    _model_args(gen)
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat with the chat template applied")
    chat.add_argument("--system", default=None, help="system prompt")
    _model_args(chat)
    _sampling_args(chat)
    models = sub.add_parser("models", help="list the models loadable here (default, packaged, cached, PATHs)")
    models.add_argument("paths", nargs="*", metavar="PATH", help="also check these GGUF files / HF folders")
    serve = sub.add_parser("serve", help="serve WebSocket agent sessions (and the HTTP API)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8765, help="WebSocket sessions port (default: %(default)s)")
    serve.add_argument("--http-port", type=int, default=8000,
                       help="OpenAI-compatible HTTP API port (default: %(default)s; -1 disables it)")
    serve.add_argument("--programs", default=None, help="folder of @sgrt.function programs to register")
    serve.add_argument("--auth-token", default=os.environ.get("SGRT_AUTH_TOKEN"),
                       help="required first-message token (default: $SGRT_AUTH_TOKEN)")
    _model_args(serve)
    return parser


def _params(args: argparse.Namespace, **extra):
    from sgrt.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, **extra)


def _engine(args: argparse.Namespace):
    from sgrt.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization)
    print(f"[sgrt] loaded {args.model} ({args.dtype}, {args.device}) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return engine


def _stream_to_stdout(engine, prompt: str, params) -> None:
    result = None
    for chunk in engine.stream(prompt, params):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        result = chunk.result
    sys.stdout.write("\n")
    if result is not None:
        print(
            f"[sgrt] TTFT {1000 * (result.ttft or 0):.0f} ms, {result.output_tok_per_s:.1f} tok/s, "
            f"{result.completion_tokens} tokens, finish_reason={result.finish_reason}",
            file=sys.stderr,
        )


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _engine(args)
    try:
        prompt = args.text
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.text}])
        _stream_to_stdout(engine, prompt, _params(args, json_schema=args.json_schema, regex=args.regex))
    finally:
        engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("[sgrt] type a message; an empty line or Ctrl-D quits", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            prompt = engine.tokenizer.apply_chat_template(messages)
            result = engine.submit(prompt, _params(args))
            text = []
            for chunk in result:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                text.append(chunk.text)
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(text)})
    finally:
        engine.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from sgrt.server import run_server

    engine = _engine(args)
    try:
        run_server(engine, host=args.host, port=args.port, http_port=None if args.http_port < 0 else args.http_port,
                   programs_dir=args.programs, auth_token=args.auth_token, model_name=args.model)
    finally:
        engine.shutdown()
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from sgrt.models.catalog import list_local_models
    from sgrt.models.registry import supported_names

    entries = list_local_models(args.paths)
    for e in entries:
        print(f"{e.spec}\t{e.where}\t{e.family or 'NOT LOADABLE'}\t{e.detail}")
    names = supported_names()
    print(f"[sgrt] families: HF {', '.join(names['hf'])}; GGUF {', '.join(names['gguf'])}", file=sys.stderr)
    return 0 if all(e.family for e in entries if e.where == "path") else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "models": cmd_models}
    if args.command not in commands:
        parser.print_help()
        return 0 if args.command is None else 2
    from sgrt.errors import SgrtError

    try:
        return commands[args.command](args)
    except SgrtError as exc:
        print(f"sgrt: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
