"""sgrt's C++ CPU operators, compiled on first use and cached (:mod:`sgrt.kernels.build`).

- :mod:`sgrt.kernels.layer_ops`: a decoder layer's non-matmul steps and decode attention over
  the KV pool, one fused call each (any x86-64 / ARM CPU with a C++ compiler).
- :mod:`sgrt.kernels.woq`: the group-wise int4 / int8 weight-only matmul (AVX-512 BF16 CPUs).
- :mod:`sgrt.kernels.dense`: dense float32 / bfloat16 matmuls at decode sizes (AVX2 + FMA CPUs).

Callers check ``available()`` and keep their PyTorch path where it is False.
"""
