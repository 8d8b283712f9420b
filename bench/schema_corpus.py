"""JSON Schema validity corpora: llguidance vs outlines-core vs xgrammar, side by side
(issues 5 and 20).

Two corpora: ../shared/data/jsonschemabench (313 schemas, MaskBench format) and the JSON Schema
Test Suite draft 2020-12 (../shared/data/json-schema-test-suite, every group of every top-level
file but the remote-reference ones: 368 of its 383 groups; refRemote's 15 need a network). Each
schema is compiled with each engine; every labelled instance is serialized (keys in the
grammar's order) in each of three ways -- compact, Python's default separators (``", "``,
``": "``), pretty-printed (flexible whitespace) -- with the grammar compiled for that whitespace,
tokenized with the default model's tokenizer and fed token by token. Reported per engine:
schemas compiled and refused, valid instances accepted / rejected / rejected as a chosen
departure (closed objects, string and number caps, enforced formats, number spelling), invalid
instances rejected / accepted (must be 0 for sgrt's engines), mask-vs-accept mismatches (must
be 0), compile time p50 / p99 and mask time per token p50 / p99.

Baseline: the outlines-core backend, and xgrammar when it is installed (``pip install
'sgrt[bench]'``), on the same instances in the same invocation. xgrammar gets the schema as
written (its own JSON Schema support, no sgrt normalization); its departures are not counted.
Targets for llguidance: 0 invalid accepted everywhere, >= 90% of the 313 compiled, <= 2% of
valid instances rejected outside the departures, >= 300 test-suite groups compiled (of 383).

    .venv/bin/python bench/schema_corpus.py [--backends llguidance,outlines,xgrammar]
        [--corpus maskbench|suite|all] [--serializations compact,default,flexible]
        [--limit N] [--timeout 10] [--verbose]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgrt.constrained import GrammarCompiler  # noqa: E402
from sgrt.constrained.grammar import CompiledGrammar, Grammar  # noqa: E402
from sgrt.constrained.options import GrammarOptions  # noqa: E402
from bench.validity import (  # noqa: E402
    CaseResult, SERIALIZATIONS, load_maskbench, load_test_suite, run_case,
)
from sgrt.errors import GrammarError  # noqa: E402


class _XGrammar(Grammar):
    """An xgrammar matcher behind the part of sgrt's Grammar interface the corpus runner uses."""

    backend = "xgrammar"

    def __init__(self, matcher, stop_ids):
        super().__init__()
        self._m = matcher
        self._stop = stop_ids

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def is_accepting(self) -> bool:
        return any(self._m.fork().accept_token(t) for t in self._stop) if hasattr(self._m, "fork") else False

    def fill_vocab_mask(self, bitmask, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, k: int) -> None:
        self._m.rollback(k)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def forced_tokens(self) -> list[int]:
        return []

    def copy(self):
        return _XGrammar(self._m.fork(), self._stop)


class _XCompiled(CompiledGrammar):
    def __init__(self, compiled, stop_ids):
        self._c = compiled
        self._stop = stop_ids
        self.warnings = []

    def new_grammar(self) -> _XGrammar:
        import xgrammar

        return _XGrammar(xgrammar.GrammarMatcher(self._c), self._stop)


class XGrammarCompiler:
    """xgrammar's JSON Schema compiler with the interface ``run_case`` uses (``compile_spec``,
    ``vocab``, ``options``). Schemas go in as written (``raw_schemas``); the serialization's
    separators and whitespace map to xgrammar's ``separators`` / ``any_whitespace``."""

    raw_schemas = True

    def __init__(self, tokenizer, vocab):
        import xgrammar

        self.vocab = vocab
        self.options = GrammarOptions()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab.vocab_size,
                                                        stop_token_ids=sorted(vocab.eos_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self._stop = sorted(vocab.eos_token_ids)

    def compile_spec(self, kind: str, spec, backend=None, options: GrammarOptions | None = None) -> _XCompiled:
        ws = (options or self.options).whitespace
        kw = {"any_whitespace": True} if ws == "flexible" else \
            {"any_whitespace": False, "separators": (", ", ": ") if ws == "one_space" else (",", ":")}
        try:
            schema = json.dumps(spec)
            return _XCompiled(self._compiler.compile_json_schema(schema, strict_mode=False, **kw), self._stop)
        except Exception as e:  # xgrammar raises its own types
            raise GrammarError(f"xgrammar: {type(e).__name__}: {str(e)[:200]}", field="json_schema") from None


def have_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except Exception:
        return False
    return True


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(results: list[CaseResult]) -> dict:
    compiled = [r for r in results if r.compiled]
    valid_total = sum(r.valid_accepted + r.valid_rejected + r.departures for r in compiled)
    masks = [t for r in compiled for t in r.mask_times]
    return {
        "schemas": len(results),
        "compiled": len(compiled),
        "refused": len(results) - len(compiled),
        "compiled_pct": 100.0 * len(compiled) / max(1, len(results)),
        "valid": valid_total,
        "valid_accepted": sum(r.valid_accepted for r in compiled),
        "valid_rejected": sum(r.valid_rejected for r in compiled),
        "valid_rejected_pct": 100.0 * sum(r.valid_rejected for r in compiled) / max(1, valid_total),
        "departures": sum(r.departures for r in compiled),
        "invalid": sum(r.invalid_rejected + r.invalid_accepted for r in compiled),
        "invalid_rejected": sum(r.invalid_rejected for r in compiled),
        "invalid_accepted": sum(r.invalid_accepted for r in compiled),
        "mask_mismatch": sum(r.mask_mismatch for r in compiled),
        "mask_stricter": sum(r.mask_stricter for r in compiled),
        "compile_ms_p50": 1e3 * percentile([r.compile_s for r in results], 0.5),
        "compile_ms_p99": 1e3 * percentile([r.compile_s for r in results], 0.99),
        "mask_us_p50": 1e6 * percentile(masks, 0.5),
        "mask_us_p99": 1e6 * percentile(masks, 0.99),
        "mask_us_mean": 1e6 * statistics.fmean(masks) if masks else float("nan"),
        "tokens": len(masks),
    }


ROWS = [
    ("schemas", "{schemas}"),
    ("compiled", "{compiled} ({compiled_pct:.1f}%)"),
    ("refused (GrammarError)", "{refused}"),
    ("valid instances (compiled schemas)", "{valid}"),
    ("  accepted", "{valid_accepted}"),
    ("  rejected: departures", "{departures}"),
    ("  rejected: errors", "{valid_rejected} ({valid_rejected_pct:.1f}%)"),
    ("invalid instances (compiled schemas)", "{invalid}"),
    ("  rejected", "{invalid_rejected}"),
    ("  ACCEPTED (must be 0)", "{invalid_accepted}"),
    ("mask allows, accept rejects (must be 0)", "{mask_mismatch}"),
    ("mask forbids non-canonical split", "{mask_stricter}"),
    ("compile ms p50 / p99", "{compile_ms_p50:.1f} / {compile_ms_p99:.1f}"),
    ("mask us/token p50 / p99", "{mask_us_p50:.0f} / {mask_us_p99:.0f}"),
    ("tokens fed", "{tokens}"),
]


def print_table(title: str, summaries: dict[str, dict]) -> None:
    names = list(summaries)
    print(f"\n{title}")
    print(f"{'':40s}" + "".join(f"{n:>22s}" for n in names))
    for label, fmt in ROWS:
        print(f"{label:40s}" + "".join(f"{fmt.format(**summaries[n]):>22s}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="llguidance,outlines,xgrammar",
                    help="engines; xgrammar is skipped when it is not installed")
    ap.add_argument("--corpus", default="all", choices=["maskbench", "suite", "all"])
    ap.add_argument("--serializations", default=",".join(SERIALIZATIONS))
    ap.add_argument("--limit", type=int, default=None, help="first N schemas of each corpus")
    ap.add_argument("--timeout", type=float, default=10.0, help="compile time limit per schema, s")
    ap.add_argument("--verbose", action="store_true", help="print every refusal and error")
    args = ap.parse_args()

    from sgrt.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    backends = [b for b in args.backends.split(",") if b != "xgrammar" or have_xgrammar()]
    serializations = args.serializations.split(",")
    corpora = {}
    if args.corpus in ("maskbench", "all"):
        corpora["jsonschemabench"] = load_maskbench()
    if args.corpus in ("suite", "all"):
        corpora["test-suite"] = load_test_suite()
    report: dict = {"bench": "schema_corpus", "model": "smollm2-135m-instruct", "baseline": "outlines",
                    "engines": backends, "serializations": serializations}
    t_start = time.perf_counter()
    for corpus_name, cases in corpora.items():
        cases = cases[: args.limit] if args.limit else cases
        for ser in serializations:
            summaries = {}
            for backend in backends:
                if backend == "xgrammar":
                    sgrt_compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, cache_size=8)
                    compiler = XGrammarCompiler(tokenizer, sgrt_compiler.vocab)
                else:
                    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, backend=backend,
                                               compile_timeout_s=args.timeout, cache_size=8)
                t0 = time.perf_counter()
                results = [run_case(compiler, backend, case, serialization=ser) for case in cases]
                summary = summarize(results)
                summary["wall_s"] = time.perf_counter() - t0
                summaries[backend] = summary
                if args.verbose:
                    for r in results:
                        if not r.compiled:
                            print(f"[{backend}/{ser}] refused {r.name}: {r.error[:200]}")
                        for note in r.notes:
                            print(f"[{backend}/{ser}] {r.name}: {note}")
                if backend != "xgrammar":
                    close = getattr(compiler.backend_for(backend), "worker", None)
                    if close is not None:
                        close.close()
            print_table(f"{corpus_name}, {ser} serialization: {len(cases)} schemas", summaries)
            for backend, summary in summaries.items():
                tag = backend if ser == "compact" else f"{backend}@{ser}"
                for key, value in summary.items():
                    report[f"{corpus_name}.{tag}.{key}"] = round(value, 3) if isinstance(value, float) else value
    ll = report.get("jsonschemabench.llguidance.compiled_pct")
    if ll is not None:
        report["targets_met"] = bool(
            all(v == 0 for k, v in report.items() if k.endswith(".invalid_accepted")
                and not k.split(".")[1].startswith("xgrammar"))
            and ll >= 90.0
            and report["jsonschemabench.llguidance.valid_rejected_pct"] <= 2.0
            and report.get("test-suite.llguidance.compiled", 300) >= 300
        )
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
