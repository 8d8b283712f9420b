"""Text to JSON under a JSON Schema with ``programs/extract.py``, three texts in one batch.

    python examples/extract_agent.py [--model PATH]

Shows: ``json_schema=`` constrained decoding (every reply parses and validates, checked here
with ``jsonschema``), jump-forward over the forced keys (``forced`` tokens), and ``run_batch``:
the three extractions run concurrently and the engine batches them.
"""
from __future__ import annotations

import json
import time

import jsonschema
from _common import describe, finish, parse_args, start

from programs.extract import extract

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "place": {"type": "string", "maxLength": 40},
        "known_for": {"type": "string", "maxLength": 60},
    },
    "required": ["name", "year", "place", "known_for"],
}
TEXTS = [
    "Marie Curie was born in Warsaw in 1867. She won two Nobel Prizes for her work on radioactivity.",
    "In 1903 the Wright brothers made the first powered flight at Kitty Hawk, North Carolina.",
    "Ada Lovelace, born in London in 1815, wrote the first published computer program.",
]


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    rt = start(args)
    t0 = time.perf_counter()
    states = extract.run_batch([{"text": t, "schema": SCHEMA, "max_tokens": 64,
                                 "instructions": "Extract the main person or people, the year, the place "
                                                 "and what they are known for."} for t in TEXTS])
    for text, st in zip(TEXTS, states):
        print(f"\ntext: {text}")
        data = st["data"]
        if data is not None:
            jsonschema.validate(data, SCHEMA)
        print("json:", json.dumps(data) if data is not None else f"(cut short) {st['json']}")
        print(f"  ({describe(st.get_meta_info('json'))})")
    finish(rt, t0)


if __name__ == "__main__":
    main()
