"""The opt-in compiled decode step (sgrt/engine/compiled_decode.py) on a tiny random model: same
logits as the eager path, KV pool updated in place, prefill rows left eager."""
from __future__ import annotations

from array import array

import torch

from sgrt.engine.kv_pool import KVPool
from sgrt.engine.model_runner import ModelRunner
from sgrt.engine.request import Req
from sgrt.engine.sampling_params import SamplingParams
from sgrt.engine.scheduler import Row
from sgrt.models import ModelConfig
from sgrt.models.llama import LlamaForCausalLM


def _tiny_model() -> LlamaForCausalLM:
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def _run(runner: ModelRunner, pool: KVPool, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    reqs = [Req(request_id=str(i), prompt_ids=p, params=SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:  # prefill each alone (eager in both runners)
        r.slots = array("q", pool.alloc(len(r.prompt_ids)))  # (as the scheduler keeps them)
        lg = runner.forward([Row(r, 0, len(r.prompt_ids))], [[len(r.prompt_ids) - 1]])[0]
        r.output_ids.append(int(lg[-1].argmax()))
    out = []
    for _ in range(steps):  # decode batches: rows of different lengths, so a padding mask
        rows = []
        for r in reqs:
            r.slots.extend(pool.alloc(1))
            rows.append(Row(r, r.num_fill - 1, 1))
        logits = runner.forward(rows, [[0]] * len(rows))
        for r, lg in zip(reqs, logits):
            r.output_ids.append(int(lg[-1].argmax()))
        out.append(torch.cat(logits))
    return out


def test_compiled_decode_matches_eager():
    model = _tiny_model()
    cfg = model.config
    prompts = [[1, 5, 9, 3, 7], [2, 4, 6]]
    results = {}
    for compile in (False, True):
        pool = KVPool(64, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype, "cpu")
        runner = ModelRunner(model, pool, compile=compile)
        results[compile] = (_run(runner, pool, prompts, 3), pool.k.clone())
    (eager, k_eager), (compiled, k_compiled) = results[False], results[True]
    for a, b in zip(eager, compiled):
        assert a.shape == b.shape == (2, cfg.vocab_size)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    assert torch.allclose(k_eager, k_compiled, atol=1e-5)  # the KV pool written in place
