"""JSON extraction speed: sgrt with exact / text / no jump-forward vs outlines 1.x (issue 5).

Workload: extract a 6-field object (name, age, email, city, occupation, member) from a short
paragraph, default model, float32, greedy, at most 128 new tokens, one request at a time, same
chat-templated prompt and JSON Schema everywhere.

- **sgrt**: an ``Engine`` with the radix cache off (every run prefills the prompt again, as the
  baseline does), llguidance grammar, ``jump_forward="exact"`` / ``"text"`` / None.
- **outlines** (the baseline, same process): ``outlines.from_transformers`` on a transformers
  ``LlamaForCausalLM`` loaded from the same converted HF folder (``LoadedModel.path``), with
  ``outlines.Generator(model, outlines.json_schema(SCHEMA))`` (its default JSON backend,
  outlines-core, and its default whitespace). Grammar compilation is timed once, apart.

Figures, median of ``--runs`` (default 5) after one warm-up run each. The three sgrt modes are
interleaved (exact, text, none, then again), so drift in a shared machine's load hits them alike;
outlines runs after the engine has shut down, each system alone in the process, because libgomp
throttles the spinning of every OpenMP pool while two threads' pools exist (see
``sgrt/engine/openmp.py``), which would slow both sides:
- ``tok/s``: output tokens / end-to-end seconds (submit to result; prefill included);
- ``decode tok/s``: tokens after the first / time after the first (sgrt: ``Result.output_tok_per_s``;
  outlines: timestamps from a transformers streamer);
- ``e2e s``, output tokens (outlines' include the EOS that ends its output; sgrt stops when the
  grammar terminates), forced (jump-forward) tokens, forwards (model calls), ``step ms`` (engine
  step time per forward), ``fwd1 ms`` / ``fwdk ms`` (mean forward time of a one-token decode step
  and of a step that feeds a draft: what exact jump-forward trades against the steps it saves);
- ``mask share``: time spent filling and applying the grammar's token masks (every
  ``fill_vocab_mask`` and ``apply_token_bitmask_`` call, the exact-mode draft walk included) /
  time of the engine steps, and ``mask ms/token``. For outlines, the time in its logits
  processor (guide advance + fill + apply) / end-to-end time. Timed by wrapping those functions
  in this process; no engine code changes.

Targets: sgrt (exact) >= 2x outlines' tok/s; mask share <= 10%. Noisy on a shared CPU.

NOTE: ``OMP_WAIT_POLICY`` is left as the environment sets it (libgomp's default: short spinning),
the same for both systems. PASSIVE makes every small matmul wake a sleeping worker and slows both.

Run: ``.venv/bin/python bench/json_decode.py [--runs 3] [--threads 2] [--skip-outlines]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, hf_folder, print_table  # noqa: E402

TEXT = (
    "Maria Gonzalez, 34, moved to Lisbon last spring after ten years in Madrid. She works as a "
    "landscape architect at a small studio near the river, and you can reach her at "
    "maria.gonzalez@example.com. She joined the city's cycling club in May and rides every weekend."
)
QUESTION = ("Extract the person's details from this text as JSON with the fields name, age, email, city, "
            "occupation and member (is she a club member?).\n\n" + TEXT)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "city", "occupation", "member"],
    "additionalProperties": False,
}
MAX_TOKENS = 128
MODES = [("exact", "exact"), ("text", "text"), ("none", None)]


class Timers:
    """Accumulated seconds and call counts per key, from wrapped functions (engine thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def wrap(self, owner: Any, name: str, key: str) -> None:
        """Replace ``owner.name`` by a timed version (a class attribute times every instance)."""
        fn = getattr(owner, name)
        timers = self

        def timed_fn(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.seconds[key] += time.perf_counter() - t0
                timers.calls[key] += 1

        setattr(owner, name, timed_fn)


def medians(results: list[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over runs."""
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


class SgrtSystem:
    """One engine (radix cache off) shared by the three jump-forward modes, with timing hooks."""

    def __init__(self, loaded: Any, prompt: str):
        import sgrt.constrained as constrained
        from sgrt.constrained.llguidance_backend import LLGuidanceGrammar
        from sgrt.engine import Engine

        self.prompt = prompt
        self.timers = timers = Timers()
        # NOTE: the sampler and the verifier import apply_token_bitmask_ from sgrt.constrained at
        # call time, so patching the package attribute times both.
        timers.wrap(constrained, "apply_token_bitmask_", "mask")
        timers.wrap(LLGuidanceGrammar, "fill_vocab_mask", "mask")
        for name in ("accept_token", "forced_tokens", "rollback"):
            timers.wrap(LLGuidanceGrammar, name, "grammar")
        self.engine = Engine(model=loaded, max_total_tokens=2048, enable_radix_cache=False)
        timers.wrap(self.engine, "_step", "step")
        self.forwards: list[tuple[int, float]] = []  # (tokens fed, seconds) per forward
        forward = self.engine.runner.forward

        def logged_forward(rows: list, offsets: list) -> Any:
            t0 = time.perf_counter()
            out = forward(rows, offsets)
            self.forwards.append((sum(r.n for r in rows), time.perf_counter() - t0))
            return out

        self.engine.runner.forward = logged_forward
        self.token_ids: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}

    def params(self, mode: str | None) -> Any:
        from sgrt.engine import SamplingParams

        return SamplingParams(max_tokens=MAX_TOKENS, json_schema=SCHEMA, jump_forward=mode)

    def warm_up(self) -> None:
        for label, mode in MODES:
            self.engine.generate(self.prompt, self.params(mode))  # compiles the grammar once (cached)

    def one(self, label: str, mode: str | None) -> dict[str, float]:
        timers = self.timers
        timers.reset()
        self.forwards.clear()
        t0 = time.perf_counter()
        r = self.engine.generate(self.prompt, self.params(mode))
        e2e = time.perf_counter() - t0
        assert r.finish_reason == "stop" and r.matched == "grammar", (r.finish_reason, r.text, r.error)
        json.loads(r.text)
        self.token_ids[label], self.texts[label] = r.token_ids, r.text
        n = r.completion_tokens
        step = timers.seconds["step"]
        decode = self.forwards[1:]  # after the prefill
        one_token = [s for k, s in decode if k == 1]
        multi = [s for k, s in decode if k > 1]
        return {
            "tokens": n, "e2e_s": e2e, "tok_s": n / e2e, "decode_tok_s": r.output_tok_per_s,
            "forced": r.forced_tokens, "forwards": len(self.forwards),
            "step_ms": 1e3 * step / max(len(self.forwards), 1),
            "fwd1_ms": 1e3 * statistics.mean(one_token) if one_token else 0.0,
            "fwdk_ms": 1e3 * statistics.mean(multi) if multi else 0.0,
            "mask_ms_per_token": 1e3 * timers.seconds["mask"] / n,
            "mask_share": timers.seconds["mask"] / step if step else 0.0,
            "grammar_share": (timers.seconds["mask"] + timers.seconds["grammar"]) / step if step else 0.0,
        }

    def close(self) -> None:
        self.engine.shutdown()


class _Streamer:
    """A transformers streamer that timestamps each generated token (the first ``put`` is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class OutlinesSystem:
    """outlines 1.x on a transformers LlamaForCausalLM from the same HF folder."""

    def __init__(self, path: Path, prompt: str):
        import outlines
        import transformers
        from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

        self.prompt = prompt
        hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = outlines.from_transformers(hf, tok)
        t0 = time.perf_counter()
        self.generator = outlines.Generator(model, outlines.json_schema(SCHEMA))
        self.compile_s = time.perf_counter() - t0
        self.timers = Timers()
        self.timers.wrap(OutlinesCoreLogitsProcessor, "process_logits", "mask")
        self.kw = dict(max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
        self.text = ""

    def warm_up(self) -> None:
        with torch.inference_mode():
            self.text = self.generator(self.prompt, **self.kw)

    def one(self) -> dict[str, float]:
        self.timers.reset()
        streamer = _Streamer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.generator(self.prompt, streamer=streamer, **self.kw)
        e2e = time.perf_counter() - t0
        json.loads(out)
        self.text = out
        times = streamer.times
        n = len(times)  # NOTE: counts the EOS that ends a complete value (sgrt's grammar stop has none)
        mask = self.timers.seconds["mask"]
        return {"tokens": n, "e2e_s": e2e, "tok_s": n / e2e,
                "decode_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0,
                "forced": 0, "forwards": n, "step_ms": 1e3 * e2e / n, "fwd1_ms": 0.0, "fwdk_ms": 0.0,
                "mask_ms_per_token": 1e3 * mask / n, "mask_share": mask / e2e, "grammar_share": mask / e2e}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--skip-outlines", action="store_true", help="run sgrt only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.models import load_model

    loaded = load_model(args.model, dtype="float32")
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt_tokens = len(loaded.tokenizer.encode(prompt))
    ours = SgrtSystem(loaded, prompt)
    ours.warm_up()
    # The modes interleaved (one run of each per round), so drift in load spreads over all.
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    try:
        for _ in range(args.runs):
            for label, mode in MODES:
                runs[label].append(ours.one(label, mode))
    finally:
        ours.close()  # its engine thread, and that thread's OpenMP pool, end here
    theirs = None if args.skip_outlines else OutlinesSystem(hf_folder(loaded), prompt)
    if theirs:
        theirs.warm_up()
        for _ in range(args.runs):
            runs["outlines"].append(theirs.one())
    results = {name: medians(r) for name, r in runs.items()}

    cols = ["tokens", "forced", "forwards", "e2e_s", "tok_s", "decode_tok_s", "step_ms", "fwd1_ms", "fwdk_ms",
            "mask_ms_per_token", "mask_share", "grammar_share"]
    print(f"JSON extraction, 6 fields, {prompt_tokens}-token prompt, <= {MAX_TOKENS} new tokens, greedy, float32, "
          f"{args.threads} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, median of {args.runs}")
    print_table(["system"] + cols, [[name] + [fig[c] for c in cols] for name, fig in results.items()])
    identical = ours.token_ids["exact"] == ours.token_ids["none"]
    print(f"sgrt (exact): {ours.texts['exact']}   (token-identical to no jump-forward: {identical})")
    print(f"sgrt (text):  {ours.texts['text']}")
    if theirs:
        print(f"outlines:     {theirs.text}   (schema compile {theirs.compile_s:.2f} s, not in the times)")
    figures: dict[str, Any] = {"runs": args.runs, "threads": args.threads, "max_tokens": MAX_TOKENS,
                               "prompt_tokens": prompt_tokens, "exact_identical_to_none": identical,
                               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    for name, fig in results.items():
        for c in cols:
            figures[f"{name}_{c}"] = round(fig[c], 4)
    if "outlines" in results:
        base = results["outlines"]["tok_s"]
        for name, _ in MODES:
            figures[f"{name}_vs_outlines_tok_s"] = round(results[name]["tok_s"] / base, 3)
            # how many times faster the whole extraction finishes (compact JSON needs fewer tokens)
            figures[f"{name}_vs_outlines_e2e"] = round(results["outlines"]["e2e_s"] / results[name]["e2e_s"], 3)
        figures["outlines_compile_s"] = round(theirs.compile_s, 3)
        figures["target_2x_outlines_met"] = figures["exact_vs_outlines_tok_s"] >= 2.0
    figures["target_mask_share_met"] = results["none"]["mask_share"] <= 0.10
    emit_json("json_decode", **figures)


if __name__ == "__main__":
    main()
