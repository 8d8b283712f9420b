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

Compile time against llguidance alone (issue 42), without feeding instances:

    .venv/bin/python bench/schema_corpus.py --compile-only [--repeat 3] [--corpus maskbench]

compiles every schema with sgrt's llguidance backend (``GrammarCompiler.compile_spec``: limits,
normalization, rewrites, llguidance) and with llguidance alone on the schema as written (the
same tokenizer, options and parser limits; a schema llguidance refuses counts with the time it
took to refuse), alternating the two per schema, best of ``--repeat`` for each (the cache is
cleared between tries), and prints p50 / p99 of both, their ratio and the load average. Targets
(JSONSchemaBench, this machine): sgrt p50 <= 5 ms, p99 <= 80 ms. As in the engine, the heap
built at start (the tokenizer) is frozen out of the cyclic GC (``gc.freeze``) before timing
(``--no-gc-freeze``: not, as in a process without an engine).
"""
from __future__ import annotations

import argparse
import gc
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


# The Test Suite's optional files about the semantics issue 42 fixed (ECMA-262 regexes, numbers).
OPTIONAL_FILES = ["optional/ecmascript-regex.json", "optional/non-bmp-regex.json", "optional/bignum.json",
                  "optional/float-overflow.json"]


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


def compile_times(tokenizer, cases, repeat: int, timeout: float) -> dict:
    """Best-of-``repeat`` compile seconds per schema: sgrt (llguidance backend) and llguidance
    alone on the schema as written, alternated per schema."""
    import llguidance

    from sgrt.constrained.llguidance_backend import json_options

    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, compile_timeout_s=timeout, cache_size=8)
    backend = compiler.backend_for("llguidance")
    overrides = json_options(compiler.options)

    def sgrt_once(schema) -> tuple[float, bool]:
        compiler._cache.clear()  # a new schema each time, as an agent sends it
        t0 = time.perf_counter()
        try:
            compiler.compile_spec("json_schema", schema, "llguidance")
            ok = True
        except GrammarError:
            ok = False
        return time.perf_counter() - t0, ok

    def llguidance_once(schema) -> tuple[float, bool]:
        t0 = time.perf_counter()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
            ok = not llguidance.LLMatcher(backend.tokenizer, grammar, log_level=0, limits=backend.limits).is_error()
        except Exception:  # llguidance raises its own types on some schemas
            ok = False
        return time.perf_counter() - t0, ok

    rows = []
    for case in cases:
        s_best = l_best = float("inf")
        for _ in range(repeat):
            (ls, l_ok), (ss, s_ok) = llguidance_once(case.schema), sgrt_once(case.schema)
            s_best, l_best = min(s_best, ss), min(l_best, ls)
        rows.append((case.name, s_best, s_ok, l_best, l_ok))
    return {"rows": rows}


def print_compile_times(name: str, rows: list) -> dict:
    s = [r[1] for r in rows]
    ll = [r[3] for r in rows]
    both = [(r[1], r[3]) for r in rows if r[2] and r[4]]
    out = {
        "schemas": len(rows), "sgrt_compiled": sum(r[2] for r in rows), "llguidance_compiled": sum(r[4] for r in rows),
        "sgrt_ms_p50": 1e3 * percentile(s, 0.5), "sgrt_ms_p99": 1e3 * percentile(s, 0.99),
        "llguidance_ms_p50": 1e3 * percentile(ll, 0.5), "llguidance_ms_p99": 1e3 * percentile(ll, 0.99),
        "both_sgrt_ms_p50": 1e3 * percentile([a for a, _ in both], 0.5),
        "both_sgrt_ms_p99": 1e3 * percentile([a for a, _ in both], 0.99),
        "both_llguidance_ms_p50": 1e3 * percentile([b for _, b in both], 0.5),
        "both_llguidance_ms_p99": 1e3 * percentile([b for _, b in both], 0.99),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    out["ratio_p50"] = out["sgrt_ms_p50"] / out["llguidance_ms_p50"]
    out["ratio_p99"] = out["sgrt_ms_p99"] / out["llguidance_ms_p99"]
    out["targets_met"] = out["sgrt_ms_p50"] <= 5.0 and out["sgrt_ms_p99"] <= 80.0
    print(f"\n{name}: compile time, best of repeats per schema (load average {out['loadavg_1m']})")
    print(f"{'':44s}{'sgrt':>12s}{'llguidance':>12s}{'ratio':>8s}")
    print(f"{'schemas compiled':44s}{out['sgrt_compiled']:>12d}{out['llguidance_compiled']:>12d}")
    for q in ("p50", "p99"):
        print(f"{'compile ms ' + q + ' (all ' + str(len(rows)) + ')':44s}{out['sgrt_ms_' + q]:>12.2f}"
              f"{out['llguidance_ms_' + q]:>12.2f}{out['ratio_' + q]:>8.2f}")
    for q in ("p50", "p99"):
        print(f"{'compile ms ' + q + ' (compiled by both: ' + str(len(both)) + ')':44s}"
              f"{out['both_sgrt_ms_' + q]:>12.2f}{out['both_llguidance_ms_' + q]:>12.2f}")
    print(f"targets (sgrt p50 <= 5 ms, p99 <= 80 ms): {'met' if out['targets_met'] else 'NOT met'}")
    slow = sorted(rows, key=lambda r: -r[1])[:5]
    print("slowest for sgrt: " + ", ".join(f"{r[0]} {1e3 * r[1]:.0f} ms (llguidance {1e3 * r[3]:.0f})" for r in slow))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="llguidance,outlines,xgrammar",
                    help="engines; xgrammar is skipped when it is not installed")
    ap.add_argument("--corpus", default="all", choices=["maskbench", "suite", "optional", "all"],
                    help="optional: the Test Suite's optional ECMA-262 regex, non-BMP regex, bignum and "
                         "float-overflow files (not in 'all')")
    ap.add_argument("--serializations", default=",".join(SERIALIZATIONS))
    ap.add_argument("--limit", type=int, default=None, help="first N schemas of each corpus")
    ap.add_argument("--timeout", type=float, default=10.0, help="compile time limit per schema, s")
    ap.add_argument("--verbose", action="store_true", help="print every refusal and error")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile time only: sgrt against llguidance alone (no instances fed)")
    ap.add_argument("--repeat", type=int, default=3, help="--compile-only: tries per schema (best kept)")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="--compile-only: leave the tokenizer's heap in the cyclic GC (a process without an engine)")
    args = ap.parse_args()

    from sgrt.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    if args.compile_only:
        if not args.no_gc_freeze:
            gc.freeze()  # as the engine does with the heap it starts with (sgrt/engine/engine.py)
        corpora = {}
        if args.corpus in ("maskbench", "all"):
            corpora["jsonschemabench"] = load_maskbench()
        if args.corpus in ("suite", "all"):
            corpora["test-suite"] = load_test_suite()
        report = {"bench": "schema_corpus.compile", "model": "smollm2-135m-instruct", "repeat": args.repeat,
                  "gc_frozen": not args.no_gc_freeze}
        for corpus_name, cases in corpora.items():
            cases = cases[: args.limit] if args.limit else cases
            out = print_compile_times(corpus_name, compile_times(tokenizer, cases, args.repeat, args.timeout)["rows"])
            report.update({f"{corpus_name}.{k}": round(v, 3) if isinstance(v, float) else v for k, v in out.items()})
        print()
        print(json.dumps(report))
        return
    backends = [b for b in args.backends.split(",") if b != "xgrammar" or have_xgrammar()]
    serializations = args.serializations.split(",")
    corpora = {}
    if args.corpus in ("maskbench", "all"):
        corpora["jsonschemabench"] = load_maskbench()
    if args.corpus in ("suite", "all"):
        corpora["test-suite"] = load_test_suite()
    if args.corpus == "optional":
        corpora["test-suite-optional"] = load_test_suite(files=OPTIONAL_FILES)
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
                    compiler.backend_for(backend)  # built once per engine: not a schema's compile time
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
    if "jsonschemabench" in corpora and "llguidance" in backends:
        # compile time beside llguidance alone (as --compile-only prints it)
        cases = corpora["jsonschemabench"][: args.limit] if args.limit else corpora["jsonschemabench"]
        out = print_compile_times("jsonschemabench", compile_times(tokenizer, cases, args.repeat, args.timeout)["rows"])
        report.update({f"jsonschemabench.compile.{k}": round(v, 3) if isinstance(v, float) else v
                       for k, v in out.items()})
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
