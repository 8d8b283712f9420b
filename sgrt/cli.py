"""The ``sgrt`` command: ``generate``, ``chat``, ``serve`` and ``models``.

Defaults match the engine's (DESIGN.md): greedy unless ``--temperature`` is given.
``generate`` applies the model's chat template to TEXT unless ``--raw`` (as ``ollama run`` and
``llama-cli`` do) and reads TEXT from stdin when it is ``-`` or missing. Arguments are checked
before the model loads (a bad ``--json-schema``, a chat without a chat template are refused at
once), and nothing heavy (torch, transformers) is imported before it is needed: ``--help``,
``--version``, argument errors and ``sgrt models`` start in a fraction of a second. Every error
is one ``sgrt: error: ...`` line. Long waits show a progress line on a terminal (``--quiet`` or a
non-terminal stderr: none).

Exit statuses (:data:`EXIT_STATUSES`): 0 done; 1 the command failed (a model that does not load,
an aborted request, a server that cannot bind); 2 bad arguments, found before the model loads;
3 a constrained answer cut by ``--max-tokens`` before its constraint was complete (the output
is not valid; a warning on stderr says so); 130 interrupted (Ctrl-C outside a chat answer).

Defaults from the environment (:data:`ENV_DEFAULTS`): a flag given on the command line wins,
then the variable, then the built-in default.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn, Sequence

from sgrt.errors import one_line  # (light: no torch)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INCOMPLETE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_STATUSES = {
    EXIT_OK: "done",
    EXIT_FAILED: "the command failed (model load, aborted request, server start)",
    EXIT_USAGE: "bad arguments (found before the model loads)",
    EXIT_INCOMPLETE: "a constrained answer cut by --max-tokens before its constraint was complete",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}

#: flag destination -> the environment variable that sets its default.
ENV_DEFAULTS = {
    "model": "SGRT_MODEL",
    "dtype": "SGRT_DTYPE",
    "device": "SGRT_DEVICE",
    "quantization": "SGRT_QUANTIZATION",
    "threads": "SGRT_THREADS",
    "max_total_tokens": "SGRT_CTX_SIZE",
    "chat_template": "SGRT_CHAT_TEMPLATE",
}


class _Parser(argparse.ArgumentParser):
    """argparse with one ``sgrt: error: ...`` line (no usage block) and status 2 on bad input;
    an unknown flag is named alone, with the closest known one."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"sgrt: error: {message} (see sgrt {self._command()}--help)\n")

    def _command(self) -> str:
        parts = self.prog.split()[1:]
        return " ".join(parts) + " " if parts else ""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            # NOTE: argparse's own message lists every left-over word: after a mistyped flag
            # that is also the prompt (the flag's value took the prompt's place).
            sub = self._subparser(getattr(ns, "command", None))
            flags = [e for e in extras if e.startswith("-") and e != "-"]
            if flags:
                name = flags[0].split("=", 1)[0]
                known = [s for a in sub._actions for s in a.option_strings]
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                sub.error(f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else ""))
            sub.error(f"unexpected argument {extras[0]!r} (put TEXT that has spaces in quotes)")
        return ns

    def _subparser(self, command: str | None) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
        return self


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (and the environment variable that sets it), once:
    a help text that says its default in words (``(default: the context window)``) keeps its own;
    descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.help and "(default: " in action.help:
            return action.help
        text = super()._get_help_string(action) or ""
        var = ENV_DEFAULTS.get(action.dest)
        if var and action.option_strings and text.endswith("(default: %(default)s)"):
            text = text[:-1] + f"; ${var})"
        return text


class _EnvError:
    """The default of a flag whose environment variable holds a bad value: reported by
    :func:`check_args` unless the flag was given."""

    def __init__(self, var: str, message: str):
        self.var = var
        self.message = message

    def __str__(self) -> str:
        return f"invalid ${self.var}"


def _version() -> str:
    from sgrt import __version__

    return f"sgrt {__version__}"


def _model_args(p: argparse.ArgumentParser) -> None:
    from sgrt.server.serve import positive_int  # (light: argparse and sockets only)

    p.add_argument("-m", "--model", default="smollm2-135m-instruct",
                   help="a model name (smollm2-135m-instruct, gemma3-270m-q4-k-m), a .gguf file or a local "
                        "HF folder of a supported family (see `sgrt models`)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weight and activation dtype; auto: bfloat16 with --quantization int8 / int4 (their "
                        "kernels' activation dtype), float32 otherwise")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the linear layers")
    p.add_argument("--int4-activations", default="int16", choices=["int16", "int8", "int8-prefill"],
                   help="with --quantization int4 on the AVX2 kernel: the int4 layers' activation precision "
                        "(int8: llama.cpp's Q8 blocks, faster prefill, less accurate; int8-prefill: int8 for "
                        "prefill / extend chunks of >= 32 rows only, decode keeps int16)")
    p.add_argument("-c", "--ctx-size", "--max-total-tokens", dest="max_total_tokens", type=int, default=None,
                   metavar="N", help="the context window: KV pool size in tokens (all requests' prompt + output at "
                                     "once); unset: from memory, 4 GiB of K/V or a quarter of the memory available, "
                                     "whichever is less")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="the KV cache's dtype; auto: the model's activation dtype; int8: int8 K/V with a float32 scale "
                        "per token and kv head (about twice the tokens in the same memory, for long contexts)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads a step uses at most (None: torch's default, one per core)")
    _output_args(p)
    _grammar_limit_args(p)


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress lines and no timing lines on stderr")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="level of sgrt's log messages on stderr")


def _chat_template_arg(p: argparse.ArgumentParser) -> None:
    from sgrt.models.chat_templates import NAMED_CHAT_TEMPLATES

    p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help=f"the chat template to use instead of the model's: a name ({', '.join(NAMED_CHAT_TEMPLATES)}), "
                        "a Jinja file or @file (for models whose file has none)")


def _grammar_limit_args(p: argparse.ArgumentParser) -> None:
    from sgrt.constrained.limits import GrammarLimits

    group = p.add_argument_group("grammar limits", "checked before a constraint is compiled (DESIGN.md, "
                                 "\"Grammar compile limits and isolation\")")
    group.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                       help="seconds one grammar compilation may take")
    for f in dataclasses.fields(GrammarLimits):
        group.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default,
                           dest=f"limit_{f.name}", metavar="N", help=_LIMIT_HELP.get(f.name, f.name.replace("_", " ")))


_LIMIT_HELP = {
    "max_schema_bytes": "largest JSON Schema, bytes of JSON text",
    "max_schema_depth": "deepest nesting of a JSON Schema, following $ref",
    "max_ref_depth": "longest chain of $ref hops in a JSON Schema",
    "max_definitions": "most $defs/definitions entries in a JSON Schema",
    "max_properties": "most properties entries in a JSON Schema",
    "max_grammar_bytes": "largest Lark grammar, bytes",
    "max_grammar_rules": "most rules and terminals in a Lark grammar",
    "max_regex_bytes": "largest regex (also schema patterns), bytes",
    "max_repeat": "largest bound of one counted repetition {n,m}",
    "max_repeat_product": "largest product of nested counted repetition bounds in a regex",
    "compile_stack_mb": "stack of the grammar compile thread, MiB",
    "llguidance_max_items_in_row": "llguidance: largest grammar row",
    "llguidance_initial_lexer_fuel": "llguidance: lexer fuel to build a grammar",
    "llguidance_step_lexer_fuel": "llguidance: lexer fuel per mask step",
    "llguidance_step_max_items": "llguidance: Earley items per mask step",
    "llguidance_max_lexer_states": "llguidance: most lexer states",
    "llguidance_max_grammar_size": "llguidance: most grammar symbols",
}


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=256, help="most tokens to generate per answer")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens; -1 = all")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than min-p times the most likely one; 0 = off")
    g.add_argument("--repeat-penalty", dest="repetition_penalty", type=float, default=1.0, metavar="X",
                   help="divide the logits of tokens already in the prompt or output by this; 1 = off")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the answer where this text appears (not printed); repeat for more")
    g.add_argument("-s", "--seed", type=int, default=None, help="sampling seed (reproducible sampling)")


def build_parser() -> argparse.ArgumentParser:
    """The ``sgrt`` argument parser (defaults from :data:`ENV_DEFAULTS` applied)."""
    parser = _Parser(prog="sgrt", formatter_class=_Help, description="sgrt: a structured-generation runtime",
                     epilog=_epilog())
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    gen = sub.add_parser("generate", help="stream an answer to TEXT to stdout", formatter_class=_Help,
                         description="Stream the model's answer to TEXT (as a user message in the\n"
                                     "model's chat template; --raw: a plain completion of TEXT).\n"
                                     "TEXT '-' or none: read it from stdin (echo ... | sgrt generate).")
    gen.add_argument("text", nargs="?", default=None,
                     help="the message (with --raw: the text to complete); '-' or none: stdin")
    gen.add_argument("--raw", action="store_true", help="complete TEXT as is, without the chat template")
    gen.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    gen.add_argument("--system", default=None, help="system prompt (chat template only)")
    gen.add_argument("--json-schema", default=None, metavar="SCHEMA",
                     help="constrain the output to this JSON Schema: JSON text, a file or @file")
    gen.add_argument("--regex", default=None, help="constrain the output to this regex")
    gen.add_argument("--grammar", default=None, help="constrain the output to this Lark grammar: text, a name "
                     "from grammars/, a .lark file or @file")
    gen.add_argument("--json", dest="json_output", action="store_true",
                     help="print one JSON object (text, finish reason, tokens, timings, sampling) instead of "
                          "streaming the text")
    _chat_template_arg(gen)
    _model_args(gen)
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat with the chat template applied", formatter_class=_Help,
                          description="Chat with the model. A paste is one message; \"\"\" opens and closes a\n"
                                      "multi-line message; Ctrl-C stops an answer, Ctrl-D or /bye ends the chat;\n"
                                      "/help lists the commands (/clear, /system, /set, /stats).")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--verbose", action="store_true", help="print stats after every answer (/set verbose)")
    _chat_template_arg(chat)
    _model_args(chat)
    _sampling_args(chat)
    models = sub.add_parser("models", help="list the models loadable here (default, packaged, cached, PATHs)",
                            formatter_class=_Help,
                            description="List the models loadable here, one a line, tab-separated: spec, where,\n"
                                        "family (or NOT LOADABLE), detail, size, path. Reads headers only.")
    models.add_argument("paths", nargs="*", metavar="PATH", help="also check these GGUF files / HF folders")
    _output_args(models)
    serve = sub.add_parser("serve", help="serve WebSocket agent sessions (and the HTTP API)",
                           formatter_class=_Help)
    from sgrt.server.serve import add_limit_args, port_number

    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=port_number, default=8765, help="WebSocket sessions port (default: %(default)s)")
    serve.add_argument("--http-port", type=int, default=8000,
                       help="OpenAI-compatible HTTP API port (-1 disables it)")
    serve.add_argument("--programs", default=None, help="folder of @sgrt.function programs to register")
    serve.add_argument("--auth-token", default=os.environ.get("SGRT_AUTH_TOKEN"),
                       help="required first-message token (default: $SGRT_AUTH_TOKEN)%(default).0s")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model names the HTTP API answers to (the first is reported); a request naming "
                            "another model gets 404 model_not_found (None: the --model value, its file name "
                            "and stem)")
    _chat_template_arg(serve)
    _model_args(serve)
    add_limit_args(serve)
    for p in sub.choices.values():
        _env_defaults(p)
    return parser


def _epilog() -> str:
    statuses = "\n".join(f"  {code:<4} {text}" for code, text in EXIT_STATUSES.items())
    env = ", ".join(f"${v} (--{k.replace('_', '-') if k != 'max_total_tokens' else 'ctx-size'})"
                    for k, v in ENV_DEFAULTS.items())
    return f"exit statuses:\n{statuses}\n\ndefaults from the environment: {env}"


def _env_defaults(p: argparse.ArgumentParser) -> None:
    """Set the defaults of ``p``'s flags from :data:`ENV_DEFAULTS`, each value converted and
    checked as the flag's own would be; a bad one becomes an :class:`_EnvError` default."""
    for action in p._actions:
        var = ENV_DEFAULTS.get(action.dest)
        if var is None or var not in os.environ:
            continue
        text = os.environ[var]
        flag = action.option_strings[-1]
        try:
            value = action.type(text) if action.type else text
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            value = _EnvError(var, f"${var}={text!r} is not a valid {flag}: {e}")
        else:
            if action.choices is not None and value not in action.choices:
                value = _EnvError(var, f"${var}={text!r} is not a valid {flag} (choose from "
                                  f"{', '.join(map(str, action.choices))})")
        action.default = value


def _params(args: argparse.Namespace, **extra: Any) -> Any:
    """The CLI's translator: its sampling flags as one :class:`SamplingParams` (checked when
    built; ``InvalidRequest`` names the field)."""
    from sgrt.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=list(args.stop or []), seed=args.seed, **extra)


def _sampling(args: argparse.Namespace, **extra: Any) -> Any:
    """The params :func:`check_args` built, or built now (a caller that skipped it)."""
    params = getattr(args, "sampling_params", None)
    return params if params is not None else _params(args, **extra)


def _grammar_limits(args: argparse.Namespace) -> Any:
    from sgrt.constrained.limits import GrammarLimits

    return GrammarLimits(**{f.name: getattr(args, f"limit_{f.name}") for f in dataclasses.fields(GrammarLimits)})


def _constraint(args: argparse.Namespace) -> dict[str, Any]:
    found = {k: getattr(args, k, None) for k in ("json_schema", "regex", "grammar")}
    return {k: v for k, v in found.items() if v is not None}


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked without the model, so that a typo fails in a second, not
    after the model load: environment defaults, TEXT (read from stdin where asked), constraint
    files, sampling values, the engine's sizes, the grammar limits, the constraint (parsed,
    checked against the limits and the schema rewrites), whether --int4-activations applies,
    the chat template, and (``chat``) that the model has one.

    Raises:
        InvalidRequest / GrammarError: naming the flag's field.
    """
    from sgrt.errors import InvalidRequest

    for name, value in vars(args).items():
        if isinstance(value, _EnvError):
            raise InvalidRequest(value.message, field=name)
    if args.command == "generate":
        _read_text(args)
    for kind in ("json_schema", "grammar"):
        if getattr(args, kind, None) is not None:
            setattr(args, kind, _constraint_text(kind, getattr(args, kind)))
    if getattr(args, "max_tokens", None) is not None:
        constraint = _constraint(args)
        if len(constraint) > 1:
            raise InvalidRequest("give at most one of --json-schema, --regex and --grammar", field="constraint")
        # NOTE: built (so checked) once, here, before the model loads; the commands reuse it.
        args.sampling_params = _params(args, **constraint)
        if constraint:
            _check_constraint(args, *next(iter(constraint.items())))
    if args.command == "models":
        return  # lists files; no engine, no sampling
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        raise InvalidRequest(f"--max-total-tokens must be >= 1, got {args.max_total_tokens}", field="max_total_tokens")
    if args.grammar_compile_timeout <= 0:
        raise InvalidRequest(f"--grammar-compile-timeout must be > 0, got {args.grammar_compile_timeout}",
                             field="grammar_compile_timeout")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.quantization != "none" else "float32"
    if args.threads is not None and "torch" not in sys.modules:
        # (read by OpenMP when torch loads it; torch.set_num_threads covers an imported torch)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.int4_activations != "int16":  # (the default applies everywhere: no kernel to ask)
        import torch

        from sgrt.models.quant import check_int4_activations, parse_quantization

        check_int4_activations(args.int4_activations, parse_quantization(args.quantization), torch.device(args.device))
    _grammar_limits(args)
    args.chat_template_text = None
    if args.chat_template is not None:
        from sgrt.models.chat_templates import resolve_chat_template

        args.chat_template_text = resolve_chat_template(args.chat_template)
    elif args.command == "chat":
        _check_model_can_chat(args.model)


def _read_text(args: argparse.Namespace) -> None:
    """``generate``'s TEXT: the argument, or stdin when it is ``-`` or missing."""
    from sgrt.errors import InvalidRequest

    if args.text is not None and args.text != "-":
        return
    if args.text is None and sys.stdin.isatty():
        raise InvalidRequest("give TEXT, or pipe it on stdin (echo TEXT | sgrt generate)", field="text")
    text = sys.stdin.read().rstrip()
    if not text:
        raise InvalidRequest("no TEXT: stdin was empty", field="text")
    args.text = text


def _constraint_text(kind: str, value: str) -> str:
    """The text of a ``--json-schema`` / ``--grammar`` value: ``@file``, a file path, or the
    value itself (JSON text; Lark text or a grammar name)."""
    from sgrt.errors import InvalidRequest

    flag = "--" + kind.replace("_", "-")
    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        if not path.is_file():
            raise InvalidRequest(f"{flag} {value!r}: no such file {str(path)!r}", field=kind)
        return _read_file(flag, path, kind)
    path = Path(value).expanduser()
    if kind == "json_schema":
        stripped = value.strip()
        if stripped[:1] in ("{", "[") or stripped in ("true", "false"):
            return value
        if path.is_file():
            return _read_file(flag, path, kind)
        if "/" in value or os.sep in value or stripped.endswith(".json"):
            raise InvalidRequest(f"{flag} {value!r} is neither JSON nor an existing file", field=kind)
        return value  # (the schema check names the JSON error)
    # A grammar: a file where the value looks like one and it exists, else text or a name.
    if ("/" in value or value.endswith(".lark")) and "\n" not in value and path.is_file():
        return _read_file(flag, path, kind)
    return value


def _read_file(flag: str, path: Path, kind: str) -> str:
    from sgrt.errors import InvalidRequest

    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"{flag}: cannot read {path}: {e}", field=kind) from None


def _check_constraint(args: argparse.Namespace, kind: str, spec: str) -> None:
    """The checks of GrammarCompiler.compile_spec that need no tokenizer, then llguidance's own
    validation of the grammar (no tokenizer either; no torch)."""
    import llguidance

    from sgrt.constrained import limits
    from sgrt.constrained.lark_files import load_grammar_text
    from sgrt.constrained.options import GrammarOptions, json_options
    from sgrt.constrained.satisfiable import check_satisfiable
    from sgrt.constrained.schema import normalize_schema
    from sgrt.errors import GrammarError

    lim = _grammar_limits(args)
    if kind == "json_schema":
        limits.check_schema_spec(spec, lim)
        normalized = normalize_schema(spec, GrammarOptions())
        limits.check_schema(normalized.schema, lim)
        check_satisfiable(normalized.schema)
        schema = normalized.schema if isinstance(normalized.schema, dict) else {}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {k: v for k, v in schema.items() if k != "x-guidance"}, overrides=json_options(GrammarOptions()))
    elif kind == "regex":
        limits.check_regex(spec, lim)
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    else:
        text = load_grammar_text(spec)
        limits.check_lark(text, lim)
        grammar = llguidance.LLMatcher.grammar_from_lark(text)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=lim.llguidance_limits())
    if is_error:
        first = one_line(messages[0]) if messages and messages[0].strip() else "invalid"
        raise GrammarError(f"--{kind.replace('_', '-')} is not a valid constraint: {first}", field=kind)


def _check_model_can_chat(spec: str) -> None:
    """Refuse (before the load) a model whose files carry no chat template, naming the fix."""
    from sgrt.errors import InvalidRequest
    from sgrt.models.catalog import chat_template_state
    from sgrt.models.chat_templates import NAMED_CHAT_TEMPLATES, suggested_template

    has_template, family = chat_template_state(spec)
    if has_template is False:
        name = suggested_template(family)
        fix = f"--chat-template {name}" if name else f"--chat-template NAME ({', '.join(NAMED_CHAT_TEMPLATES)})"
        raise InvalidRequest(f"model {spec!r} has no chat template, so sgrt chat cannot turn messages into a "
                             f"prompt; give one: {fix} or a Jinja file (or use sgrt generate --raw)",
                             field="chat_template")


def _setup_output(args: argparse.Namespace) -> None:
    from sgrt.progress import set_progress

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="[sgrt] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("sgrt").setLevel(getattr(logging, args.log_level.upper()))
    if args.quiet:
        set_progress(False)


def _engine(args: argparse.Namespace) -> Any:
    """Load the engine the flags describe (threads set first, the chat template after)."""
    from sgrt.progress import progress

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from sgrt.engine import Engine

    t0 = time.perf_counter()
    with progress(f"loading {args.model}"):
        engine = Engine(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
                        int4_activations=args.int4_activations, max_total_tokens=args.max_total_tokens,
                        kv_cache_dtype=args.kv_cache_dtype,
                        grammar_limits=_grammar_limits(args), grammar_compile_timeout_s=args.grammar_compile_timeout)
    args.load_seconds = time.perf_counter() - t0
    if getattr(args, "chat_template_text", None):
        engine.tokenizer.chat_template = args.chat_template_text
    if not args.quiet:
        print(f"[sgrt] loaded {args.model} in {args.load_seconds:.1f} s: {engine.describe()}", file=sys.stderr)
    return engine


def _has_chat_template(engine: Any) -> bool:
    # (the tokenizer's own property: reading its transformers tokenizer would import transformers)
    tok = engine.tokenizer
    if hasattr(type(tok), "chat_template"):
        return bool(tok.chat_template)
    return bool(getattr(getattr(tok, "hf", None), "chat_template", None))


def cmd_generate(args: argparse.Namespace) -> int:
    from sgrt.errors import RequestAborted
    from sgrt.progress import progress

    engine = _engine(args)
    try:
        prompt = args.text
        if not args.raw and _has_chat_template(engine):
            messages = [{"role": "system", "content": args.system}] if args.system else []
            prompt = engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": args.text}])
        params = _sampling(args, **_constraint(args))
        if params.is_constrained():
            with progress("compiling the constraint"):
                engine.compile_grammar(params)  # cached: the request below finds it compiled
        result = _run(engine, prompt, params, stream=not args.json_output)
    finally:
        engine.shutdown()
    if args.json_output:
        print(json.dumps(_json_report(args, params, result), ensure_ascii=False))
    if result.finish_reason == "abort":
        raise RequestAborted(f"generation aborted: {result.error or 'no reason given'}")
    if not args.quiet:
        print(f"[sgrt] TTFT {1000 * (result.ttft or 0):.0f} ms, {result.output_tok_per_s:.1f} tok/s, "
              f"{result.completion_tokens} tokens, finish_reason={result.finish_reason}", file=sys.stderr)
    if params.is_constrained() and result.incomplete:
        kind = params.constraint()[0].replace("_", "-")
        print(f"sgrt: warning: the answer was cut at --max-tokens {params.max_tokens} before its --{kind} "
              f"constraint was complete, so it is not valid; raise --max-tokens (exit status 3)", file=sys.stderr)
        return EXIT_INCOMPLETE
    return EXIT_OK


def _run(engine: Any, prompt: str, params: Any, stream: bool) -> Any:
    """Run one request; with ``stream``, its text goes to stdout as it comes (then a newline)."""
    result = None
    for chunk in engine.stream(prompt, params):
        if stream and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.finished:
            result = chunk.result
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return result


def _json_report(args: argparse.Namespace, params: Any, result: Any) -> dict[str, Any]:
    """``generate --json``'s object: the answer, how it ended, token counts, timings (seconds)
    and the sampling parameters that ran."""
    sampling = params.to_wire_dict()
    return {
        "model": args.model,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "matched": result.matched,
        "incomplete": result.incomplete,
        "error": result.error,
        "tokens": {"prompt": result.prompt_tokens, "completion": result.completion_tokens,
                   "cached": result.cached_tokens, "ids": list(result.token_ids)},
        "timings": {"load_s": round(getattr(args, "load_seconds", 0.0), 4), "ttft_s": result.ttft,
                    "total_s": result.total_time, "decode_tok_per_s": result.output_tok_per_s},
        "sampling": sampling,
    }


def cmd_chat(args: argparse.Namespace) -> int:
    from sgrt.cli_chat import ChatRepl

    engine = _engine(args)
    try:
        if not _has_chat_template(engine):  # (a model the check before the load could not read)
            from sgrt.errors import InvalidRequest

            raise InvalidRequest(f"model {args.model!r} has no chat template; give one with --chat-template",
                                 field="chat_template")
        if not args.quiet:
            print(f"[sgrt] chatting with {args.model}: /help for commands, \"\"\" for a multi-line message, "
                  "Ctrl-C stops an answer, Ctrl-D or /bye ends the chat", file=sys.stderr)
        return ChatRepl(engine, _sampling(args), system=args.system, verbose=args.verbose).run()
    finally:
        engine.shutdown()


def _served_names(args: argparse.Namespace) -> list[str]:
    """The names the HTTP API answers to: ``--served-model-name``, else the ``--model`` value
    and, for a path, its file name and stem."""
    if args.served_model_name:
        return list(dict.fromkeys(args.served_model_name))
    names = [args.model]
    if "/" in args.model or os.sep in args.model:
        path = Path(args.model.rstrip("/"))
        names += [path.name, path.stem]
    return list(dict.fromkeys(n for n in names if n))


def cmd_serve(args: argparse.Namespace) -> int:
    from sgrt.server.serve import bind_listeners, limits_from_args, run_server

    # NOTE: arguments and ports are checked before the model loads (seconds), not after.
    http_port = None if args.http_port < 0 else args.http_port
    if http_port is not None and http_port > 65535:
        print(f"sgrt: error: --http-port must be in 0..65535 (or -1), got {http_port}", file=sys.stderr)
        return EXIT_USAGE
    if args.programs is not None and not os.path.isdir(args.programs):
        print(f"sgrt: error: --programs {args.programs!r} is not a folder", file=sys.stderr)
        return EXIT_USAGE
    http_limits, ws_limits = limits_from_args(args)
    try:
        listeners = bind_listeners(args.host, args.port, http_port)
    except OSError as exc:
        print(f"sgrt: error: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        engine = _engine(args)
    except BaseException:
        listeners.close()
        raise
    names = _served_names(args)
    if _has_chat_template(engine):
        # A tokenizer read from its snapshot imports transformers on the first chat template it
        # renders (~1 s); do that while the server starts, not inside the first request's TTFT.
        threading.Thread(target=lambda: engine.tokenizer.hf, name="sgrt-warm-template", daemon=True).start()
    try:
        run_server(engine, host=args.host, port=args.port, http_port=http_port, programs_dir=args.programs,
                   auth_token=args.auth_token, model_name=names[0], model_aliases=names[1:],
                   http_limits=http_limits, ws_limits=ws_limits, listeners=listeners)
    finally:
        engine.shutdown()
    return EXIT_OK


def cmd_models(args: argparse.Namespace) -> int:
    from sgrt.models.catalog import list_local_models
    from sgrt.models.family_names import supported_architectures

    entries = list_local_models(args.paths)
    for e in entries:
        print(f"{e.spec}\t{e.where}\t{e.family or 'NOT LOADABLE'}\t{e.detail}\t{e.size / 1e9:.2f} GB\t{e.path}")
    names = supported_architectures()
    if not args.quiet:
        print(f"[sgrt] families: HF {', '.join(names['hf'])}; GGUF {', '.join(names['gguf'])}", file=sys.stderr)
    return EXIT_OK if all(e.family for e in entries if e.where == "path") else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``sgrt`` command; returns the exit status (module docstring: 0 ok, 1 a failed
    command, 2 bad arguments, 3 a cut constrained answer, 130 interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "models": cmd_models}
    if args.command not in commands:
        parser.print_help()
        return EXIT_OK if args.command is None else EXIT_USAGE
    from sgrt.errors import SgrtError

    try:
        _setup_output(args)
        check_args(args)
    except SgrtError as exc:
        print(f"sgrt: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return commands[args.command](args)
    except SgrtError as exc:
        print(f"sgrt: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("sgrt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
