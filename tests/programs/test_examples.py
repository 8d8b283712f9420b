"""examples/: one agent script per program, each listed in examples/README.md, and the showcase
(``make demo``) run end to end on the session's runtime."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import jsonschema
import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
PROGRAMS = sorted(p.stem for p in (REPO / "programs").glob("*.py") if not p.name.startswith("_"))


@pytest.fixture(scope="module")
def examples_path():
    """``examples/`` on sys.path, as when a script there is run (they import ``_common``)."""
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


def test_every_program_has_an_example_listed_in_the_readme(examples_path):
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    for name in PROGRAMS:
        if name == "echo_summary":  # the session server's test program; ws_agent.py serves programs
            continue
        script = f"{name}_agent.py"
        assert (EXAMPLES / script).is_file(), script
        assert f"`{script}`" in readme, script
        module = importlib.import_module(f"{name}_agent")
        assert callable(module.main) and module.__doc__ and f"programs/{name}.py" in module.__doc__
    for script in ("showcase.py", "ws_agent.py"):
        assert f"`{script}`" in readme


def test_showcase_runs(runtime, examples_path, capsys):
    showcase = importlib.import_module("showcase")
    answer, st = showcase.demo(runtime)
    out = capsys.readouterr().out
    meta = answer.get_meta_info("answer")
    assert meta["completion_tokens"] > 0 and f"[TTFT {1000 * meta['ttft']:.0f} ms" in out
    facts = st.get_meta_info("facts")
    if not facts["incomplete"]:
        jsonschema.validate(json.loads(st["facts"]), showcase.FACTS)
    assert len(st["candidate"]) == 3 and st["best"] in ("1", "2", "3")
    # the passage was prefilled once: the branches and the judge read it from the cache
    assert all(m["cached_tokens"] >= facts["prompt_tokens"] for m in st.get_meta_info("candidate"))
    for heading in ("Facts (JSON under a schema", "Chosen answer:", "TTFT ms", "tok/s", "cached", "forced",
                    "cache hit rate", "speculative acceptance"):
        assert heading in out, heading
