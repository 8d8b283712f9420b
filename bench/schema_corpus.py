"""JSON Schema validity corpus: llguidance vs outlines-core, side by side (issue 5).

Every schema of ../shared/data/jsonschemabench (313, MaskBench format) and, with
``--corpus all``, the JSON Schema Test Suite (draft 2020-12) is compiled with each backend; every
labelled instance is serialized compactly (keys in the grammar's order), tokenized with the
default model's tokenizer and fed token by token. Reported per backend: schemas compiled and
refused, valid instances accepted / rejected / rejected as a chosen departure (closed objects,
string caps, enforced formats), invalid instances rejected / accepted (must be 0), mask-vs-accept
mismatches (a token the mask allows but the grammar rejects; must be 0), compile time p50 / p99 and mask time per token p50 / p99.

Baseline: the outlines-core backend (same process, same tokenizer, same options). Targets for
llguidance: 0 invalid accepted, >= 90% of the 313 compiled, <= 2% of valid instances rejected
outside the departures.

    .venv/bin/python bench/schema_corpus.py [--backends llguidance,outlines] [--corpus maskbench|all]
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
from sgrt.constrained.validity import CaseResult, load_maskbench, load_test_suite, run_case  # noqa: E402


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
    ap.add_argument("--backends", default="llguidance,outlines")
    ap.add_argument("--corpus", default="maskbench", choices=["maskbench", "all"])
    ap.add_argument("--limit", type=int, default=None, help="first N schemas of each corpus")
    ap.add_argument("--timeout", type=float, default=10.0, help="compile time limit per schema, s")
    ap.add_argument("--verbose", action="store_true", help="print every refusal and error")
    args = ap.parse_args()

    from sgrt.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    backends = args.backends.split(",")
    corpora = {"jsonschemabench": load_maskbench()}
    if args.corpus == "all":
        corpora["test-suite"] = load_test_suite()
    report: dict = {"bench": "schema_corpus", "model": "smollm2-135m-instruct", "baseline": "outlines"}
    t_start = time.perf_counter()
    for corpus_name, cases in corpora.items():
        cases = cases[: args.limit] if args.limit else cases
        summaries = {}
        for backend in backends:
            compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, backend=backend,
                                       compile_timeout_s=args.timeout, cache_size=8)
            t0 = time.perf_counter()
            results = [run_case(compiler, backend, case) for case in cases]
            summary = summarize(results)
            summary["wall_s"] = time.perf_counter() - t0
            summaries[backend] = summary
            if args.verbose:
                for r in results:
                    if not r.compiled:
                        print(f"[{backend}] refused {r.name}: {r.error[:200]}")
                    for note in r.notes:
                        print(f"[{backend}] {r.name}: {note}")
            close = getattr(compiler.backend_for(backend), "worker", None)
            if close is not None:
                close.close()
        print_table(f"{corpus_name}: {len(cases)} schemas", summaries)
        for backend, summary in summaries.items():
            for key, value in summary.items():
                report[f"{corpus_name}.{backend}.{key}"] = round(value, 3) if isinstance(value, float) else value
    ll = report.get("jsonschemabench.llguidance.compiled_pct")
    if ll is not None:
        report["targets_met"] = bool(
            report["jsonschemabench.llguidance.invalid_accepted"] == 0
            and ll >= 90.0
            and report["jsonschemabench.llguidance.valid_rejected_pct"] <= 2.0
        )
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
