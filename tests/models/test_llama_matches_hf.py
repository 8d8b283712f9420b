"""Our Llama (sgrt/models/llama.py) against transformers' LlamaForCausalLM on the same weights."""
from __future__ import annotations

import torch

from sgrt.models import LoadedModel, loader

PROMPT = (
    "In the heart of the ancient city, where narrow streets wound between houses of pale stone, "
    "an old clockmaker kept a shop that never seemed to close. Travellers who passed through "
    "at midnight swore they had seen a lamp burning in its window, and children whispered that "
    "the clocks inside ran backwards."
)


def test_float32_logits_match_transformers(loaded_model: LoadedModel):
    from transformers import LlamaForCausalLM as HFLlama

    ids = loaded_model.tokenizer.encode(PROMPT)[:50]
    assert len(ids) == 50
    input_ids = torch.tensor(ids)
    # (transformers reads the GGUF itself: its own dequantization and rotary order)
    gguf = loader.default_gguf_path()
    ref = HFLlama.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                  local_files_only=True).eval()
    with torch.no_grad():
        expected = ref(input_ids[None]).logits[0].float()
        got = loaded_model.model.forward_simple(input_ids)
    assert got.shape == expected.shape == (50, loaded_model.config.vocab_size)
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-3, f"max abs logit difference {diff}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
