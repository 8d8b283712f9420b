"""The names each model family answers to, without importing the families (they import torch).

``sgrt models`` and the command line's checks before a load read a GGUF's
``general.architecture`` or an HF config's ``architectures`` against this table; the families
themselves (:mod:`sgrt.models.registry`) declare the same names, and a test keeps the two equal.
"""
from __future__ import annotations

# (family name, HF architectures, GGUF general.architecture values), in registry order.
FAMILY_NAMES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("llama", ("LlamaForCausalLM",), ("llama",)),
    ("mistral", ("MistralForCausalLM",), ()),
    ("qwen2", ("Qwen2ForCausalLM",), ("qwen2",)),
    ("qwen3", ("Qwen3ForCausalLM",), ("qwen3",)),
    ("gemma3", ("Gemma3ForCausalLM",), ("gemma3",)),
    ("phi3", ("Phi3ForCausalLM",), ("phi3",)),
)


def family_of_gguf_arch(arch: str | None) -> tuple[str, str] | None:
    """``(family name, its HF architecture)`` of a GGUF ``general.architecture``, or None."""
    for name, hf, gguf in FAMILY_NAMES:
        if arch in gguf:
            return name, hf[0]
    return None


def supported_architectures() -> dict[str, list[str]]:
    """``{"hf": [...], "gguf": [...]}``: every architecture name a family reads."""
    return {"hf": [a for _, hf, _ in FAMILY_NAMES for a in hf],
            "gguf": [a for _, _, gguf in FAMILY_NAMES for a in gguf]}
