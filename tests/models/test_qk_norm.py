"""q/k norm of the plain-PyTorch layer ops (``LayerOps.qk_norm``: the reference and the CUDA path): one rms_norm over the q and k heads
together, written back into qkv in place, equals norming each part with its own ``RMSNorm``
module and concatenating (what the layer did before), bit for bit."""
from __future__ import annotations

import pytest
import torch

from sgrt.models.config import ModelConfig
from sgrt.models.layers import DecoderLayer, LayerOps

from .test_native_step import FAMILIES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,kv_heads", [("gemma3", 1), ("gemma3", 2), ("qwen3", 2)])
def test_norm_qk_in_place_equals_each_norm_apart(dtype, family, kv_heads):
    cfg = ModelConfig(**dict(FAMILIES[family], num_key_value_heads=kv_heads))
    layer = DecoderLayer(cfg, 0).to(dtype).requires_grad_(False)  # (as CausalLM holds its layers)
    g = torch.Generator().manual_seed(kv_heads)
    with torch.no_grad():
        layer.q_norm.weight.copy_(torch.randn(cfg.head_dim, generator=g) * 0.5 + 1.0)
        layer.k_norm.weight.copy_(torch.randn(cfg.head_dim, generator=g) * 0.5 + 1.0)
    n_h, n_kv = layer.n_heads, layer.n_kv_heads
    for t in (1, 5, 300):
        # rows far apart in scale (one tiny, one large), so that the norm itself varies by row
        qkv = (torch.randn(t, n_h + 2 * n_kv, cfg.head_dim, generator=g) * 3).to(dtype)
        qkv[0] *= 1e-3
        qkv[-1] *= 50
        want = torch.cat((layer.q_norm.forward(qkv[:, :n_h]), layer.k_norm.forward(qkv[:, n_h: n_h + n_kv]),
                          qkv[:, n_h + n_kv:]), dim=1)
        got = qkv.clone()
        LayerOps().qk_norm(layer, got.view(t, -1))
        assert torch.equal(got, want), (t, (got.float() - want.float()).abs().max().item())
        # the norm really ran (a value that did nothing would equal qkv)
        assert not torch.equal(got[:, :n_h], qkv[:, :n_h])
