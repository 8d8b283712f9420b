"""programs/classify.py: few-shot select; the label is always one of the labels."""
from __future__ import annotations

from programs.classify import DEFAULT_EXAMPLES, DEFAULT_INSTRUCTION, DEFAULT_LABELS, classify
from sgrt.token_ids import common_prefix_len

TEXTS = ["This is the best day of my life!", "The train was late again and I missed my flight.",
         "The library closes at six."]


def test_batch_labels_are_labels_and_share_the_cached_prefix(runtime):
    runtime.flush_cache()
    # NOTE: arguments left at their defaults are placeholders when run_batch traces the program
    # for its constant prefix, so bind them to let the few-shot block be hinted into the cache.
    bound = classify.bind(labels=DEFAULT_LABELS, examples=DEFAULT_EXAMPLES, instruction=DEFAULT_INSTRUCTION)
    states = bound.run_batch([{"text": t} for t in TEXTS])
    prefix = bound.trace().prefix
    assert prefix.startswith(DEFAULT_INSTRUCTION) and prefix.endswith("Text: ")
    prefix_ids = runtime.encode(prefix)
    for text, st in zip(TEXTS, states):
        assert st.error() is None
        assert st["label"] in DEFAULT_LABELS
        meta = st.get_meta_info("label")
        assert meta["decision"] == st["label"] and meta["choices"] == DEFAULT_LABELS
        assert len(meta["normalized_prompt_logprobs"]) == 3
        assert all(lp <= 0 for lp in meta["normalized_prompt_logprobs"])
        # every option was scored on top of the cached prompt: the few-shot block came from the cache
        shared = common_prefix_len(prefix_ids, runtime.encode(prefix + text))
        assert all(c >= shared for c in meta["cached_tokens"])
        assert st.text().endswith("Text: " + text + "\nLabel: " + st["label"])


def test_custom_labels_and_dict_examples(runtime):
    labels = ["sports", "weather", "cooking"]
    examples = [{"text": "The match ended two all.", "label": "sports"},
                {"text": "Heavy rain is expected tomorrow.", "label": "weather"},
                {"text": "Simmer the sauce for ten minutes.", "label": "cooking"}]
    st = classify.run(text="Bake the bread at 200 degrees.", labels=labels, examples=examples,
                      instruction="Classify each text by topic.")
    assert st["label"] in labels
    text = st.text()
    assert text.startswith("Classify each text by topic.\n\n")
    assert all(f"Text: {e['text']}\nLabel: {e['label']}\n" in text for e in examples)
