"""README.md: the DSL example runs as printed (on the session's runtime instead of a new one),
and the README names every program."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

import sgrt

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- example: tested by tests/programs/test_readme.py -->"


def readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    after = text[text.index(MARKER) + len(MARKER):]
    match = re.match(r"\s*```python\n(.*?)```", after, flags=re.S)
    assert match, "the tested example must be the python block right after the marker"
    return match.group(1)


class SharedRuntime:
    """Stands in for ``sgrt.Runtime(...)``: the session's runtime, which the example must not shut down."""

    def __init__(self, runtime):
        self._rt = runtime

    def __call__(self, *args, **kwargs):
        assert not args and not kwargs, "the README example uses the default model"
        return self._rt


def test_readme_example_runs(runtime, monkeypatch, capsys):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 25
    monkeypatch.setattr(sgrt, "Runtime", SharedRuntime(runtime), raising=False)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    state = namespace["state"]
    info = json.loads(state["info"])
    assert state.get_meta_info("info")["finish_reason"]["type"] == "stop"
    jsonschema.validate(info, {"type": "object", "required": ["country", "famous_for"]})
    assert state["beach"] in ("yes", "no")
    assert isinstance(state["tip"], list) and len(state["tip"]) == 2
    assert all(m["cached_tokens"] > 0 for m in state.get_meta_info("tip"))
    out = capsys.readouterr().out
    assert "prompt tokens of a tip came from the cache" in out


def test_readme_lists_every_program_and_the_commands():
    text = README.read_text(encoding="utf-8")
    programs = [p.stem for p in (README.parent / "programs").glob("*.py")
                if not p.name.startswith("_") and p.stem != "echo_summary"]
    for name in programs:
        assert f"| `{name}` |" in text, name
    for section in ("make demo", "make test", "SGRT_CACHE_DIR", "sgrt serve --programs programs/",
                    "--http-port", "RuntimeEndpoint"):
        assert section in text, section


@pytest.mark.parametrize("target", ["demo", "test"])
def test_makefile_targets_exist(target):
    makefile = (README.parent / "Makefile").read_text(encoding="utf-8")
    assert re.search(rf"^{target}:", makefile, flags=re.M)
