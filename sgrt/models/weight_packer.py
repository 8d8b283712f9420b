"""Packing a checkpoint into a weight store: every weight in its form (:mod:`sgrt.models.
weight_forms`), written one chunk of rows at a time.

The loader (:mod:`sgrt.models.loader`) packs a checkpoint once per target (dtype, quantization
and kernel layout) into a store (:mod:`sgrt.models.weight_store`) and maps it on every load.
Packing never holds more than a few chunks of rows (:data:`CHUNK_WEIGHTS` weights each) of a
tensor in memory, and never a float copy of the model, so a cold load peaks at the packed
weights plus those chunks' working sets. The fused projections' rows are their parts' rows
stacked (:class:`~sgrt.models.weight_files.Part`), and every layout here is a run of 16-row
blocks, so a chunk of 16-row blocks is written where its blocks go and no part is held whole.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from sgrt.errors import ModelLoadError
from sgrt.models import gguf_raw
from sgrt.models.config import ModelConfig
from sgrt.models.layers import FUSED_PROJECTIONS, QKV_BIASES
from sgrt.models.weight_files import CheckpointTensors, Part, read_rows
from sgrt.models.weight_forms import DTYPE_NAMES, Form, Target, choose_form
from sgrt.models.weight_store import StoreWriter

logger = logging.getLogger("sgrt.models")

# Weights a chunk of rows holds at most (8 MB of float32); at least one 16-row block.
CHUNK_WEIGHTS = 1 << 21
BLOCK_ROWS = 16
GROUP = 32


class _Fallback(Exception):
    """This weight cannot take its chosen form (a scale beyond float16); pack it as ``dense``."""


def _chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = max(BLOCK_ROWS, CHUNK_WEIGHTS // max(cols, 1) // BLOCK_ROWS * BLOCK_ROWS)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _group_rows(pieces: list[Any], f: Form) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block pieces -> (codes, scales, offsets) of the form's codes (``c``: the compact zero)."""
    if f.c:
        w = gguf_raw.SymmetricWeight.cat(pieces)
        if w.c != f.c:
            w = w.shifted(f.c)
        codes, d, m = w.codes, w.d, w.m
    else:
        ws = [gguf_raw.Q4_1Weight(p.codes, p.d, p.m) for p in pieces]
        codes, d, m = (torch.cat(t) for t in zip(*((w.codes, w.d, w.m) for w in ws)))
    if not bool(torch.isfinite(m).all()):
        raise _Fallback("an offset beyond float16's range")
    return codes, d, m


def run_chunks(chunks: list[tuple[int, int]], work: Callable[[int, int], None], workers: int) -> None:
    """``work(r0, r1)`` for every chunk, on ``workers`` threads (each chunk's reads, shuffles and
    writes touch only its own rows; numpy's and torch's kernels release the GIL). Raises the first
    chunk's exception, after every chunk has ended."""
    if workers <= 1 or len(chunks) == 1:
        for r0, r1 in chunks:
            work(r0, r1)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sgrt-pack") as pool:
        for future in [pool.submit(work, r0, r1) for r0, r1 in chunks]:
            future.result()


@contextmanager
def one_thread_per_op() -> Iterator[int]:
    """torch's ops on one thread while packing, yielding the threads it had for the chunks:
    parallel chunks keep both cores busy with no barrier between threads, where torch's own
    thread pool waits on every op (on a machine with other work, 2-thread ops measured 100x
    slower than 1-thread ones on packing's small shuffles)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


class Packer:
    """Writes one checkpoint's weights into a store (see the module docstring).

    Args:
        tensors: the checkpoint's tensors. parts: :func:`canonical_parts` of them.
        config: the model's shape. target: what to pack for. gguf: the checkpoint is a GGUF (its
            block types are read as they are; int4 keeps its wider types in int8).
        writer: the store being written.
    """

    def __init__(self, tensors: CheckpointTensors, parts: dict[str, Part], config: ModelConfig, target: Target,
                 gguf: bool, writer: StoreWriter) -> None:
        self.tensors, self.parts, self.config = tensors, parts, config
        self.target, self.gguf, self.writer = target, gguf, writer
        self.forms: dict[str, dict[str, Any]] = {}
        self.counts = {"blocks": 0, "quantized": 0, "int8_wide": 0, "float": 0}
        self.workers = 1  # (pack_model sets the threads it runs chunks on)

    def take(self, *names: str) -> list[Part]:
        """The parts named, or ModelLoadError naming the first missing one."""
        for n in names:
            if n not in self.parts:
                raise ModelLoadError(f"model {self.tensors.spec!r}: weight {n!r} missing from the checkpoint")
        return [self.parts[n] for n in names]

    def check_shape(self, name: str, parts: list[Part], rows: int, cols: int) -> None:
        got = (sum(p.rows for p in parts), parts[0].entry.cols)
        if got != (rows, cols) or any(p.entry.cols != cols for p in parts):
            raise ModelLoadError(f"model {self.tensors.spec!r}: weight {name} is {got[0]} x {got[1]} in the "
                                 f"checkpoint; the config makes it {rows} x {cols}")

    # -- one weight ---------------------------------------------------------------------------------
    def pack_weight(self, name: str, parts: list[Part], head: bool = False, form: Form | None = None) -> Form:
        """Write the weight ``name`` (a module path: ``layers.0.qkv_proj``) stacked from ``parts``
        in its form (``form``, else :func:`choose_form`'s); returns the form written."""
        f = form or choose_form([p.entry.type for p in parts], sum(p.rows for p in parts), parts[0].entry.cols,
                                self.target.quantization, self.target, self.gguf, head)
        try:
            if f.form == "group":
                self._write_group(name, parts, f)
            elif f.form == "int8_torch":
                self._write_int8_torch(name, parts, f)
            elif f.form == "int4_torch":
                self._write_int4_torch(name, parts, f)
            else:
                self._write_dense(f"{name}.weight", parts, f)
        except _Fallback as e:
            logger.warning("%s: %s kept in %s (%s)", self.target.quantization, name, DTYPE_NAMES[self.target.dtype], e)
            f = Form("dense", f.rows, f.cols)
            self._write_dense(f"{name}.weight", parts, f)
        if f.form == "dense" and self.target.quantization != "none":
            self.counts["float"] += 1
        elif f.form != "dense":
            self.counts["blocks" if f.source == "blocks" else "quantized"] += 1
            self.counts["int8_wide"] += f.wide
        self.forms[name] = f.to_json()
        return f

    def _write_dense(self, name: str, parts: list[Part], f: Form) -> None:
        dtype = self.target.dtype
        slot = self.writer.reserve(name, dtype, (f.rows, f.cols))
        size = torch.empty(0, dtype=dtype).element_size()

        def chunk(r0: int, r1: int) -> None:  # (a bfloat16 file's rows stay bfloat16 for a bfloat16 target)
            rows = torch.cat(read_rows(self.tensors, parts, r0, r1, blocks=False, bf16=dtype == torch.bfloat16))
            self.writer.write(slot, r0 * f.cols * size, rows.to(dtype))

        run_chunks(_chunks(f.rows, f.cols), chunk, self.workers)

    def _group_chunk(self, parts: list[Part], r0: int, r1: int, f: Form
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from sgrt.models.quant import quantize_groups

        if f.source == "blocks":
            return _group_rows(read_rows(self.tensors, parts, r0, r1, blocks=True), f)
        rows = torch.cat(read_rows(self.tensors, parts, r0, r1, blocks=False))
        try:
            return quantize_groups(rows, f.bits, GROUP)
        except ValueError as e:  # (float16 scales cannot hold these weights)
            raise _Fallback(str(e)) from None

    def _write_group(self, name: str, parts: list[Part], f: Form) -> None:
        from sgrt.kernels import woq

        n, k, g = f.rows, f.cols, f.cols // GROUP
        if self.target.layout == "avx512-bf16":  # (pack()'s codes beside float16 scales and offsets)
            f.stream_bits = f.bits
            codes_slot = self.writer.reserve(f"{name}.stream", torch.uint8, (n * k * f.bits // 8,))
            scales = self.writer.reserve(f"{name}.scales", torch.float16, (n, g))
            offsets = self.writer.reserve(f"{name}.offsets", torch.float16, (n, g))

            def packed_chunk(r0: int, r1: int) -> None:
                codes, d, m = self._group_chunk(parts, r0, r1, f)
                self.writer.write(codes_slot, r0 * k * f.bits // 8, woq.pack(codes, f.bits))
                self.writer.write(scales, r0 * g * 2, d)
                self.writer.write(offsets, r0 * g * 2, m)

            run_chunks(_chunks(n, k), packed_chunk, self.workers)
            return
        if f.kq:
            self._write_kq4(name, parts, f)
            return
        f.stream_bits = woq.stream_bits(5 if f.five else f.bits, f.c)
        total = woq.stream_bytes(n, k, f.stream_bits, GROUP)
        slot = self.writer.reserve(f"{name}.stream", torch.uint8, (total,))
        hb = 32 if f.c else 64
        full_block = g * (hb + BLOCK_ROWS * GROUP * f.bits // 8)  # bytes of one 16-row block
        five_block = g * (hb + BLOCK_ROWS * GROUP * 5 // 8)
        five_total = n // BLOCK_ROWS * five_block if f.five else 0

        # Q4_1 blocks straight into the stream (woq.fuse_q4_1: the same bytes, half the CPU time)
        q4_1 = f.source == "blocks" and f.bits == 4 and not f.five and not f.c \
            and all(p.entry.type == "Q4_1" for p in parts)
        # float rows quantized straight into the stream (woq.quantize_fuse: the same bytes, ~6x faster)
        direct = f.source == "float" and not f.five and not f.c and woq.isa() == "avx2"

        def stream_chunk(r0: int, r1: int) -> None:
            b0 = r0 // BLOCK_ROWS
            if q4_1:
                raw = np.concatenate(read_rows(self.tensors, parts, r0, r1, blocks=True, raw=True))
                if not np.isfinite(raw.reshape(r1 - r0, g, 20)[:, :, 2:4].copy().view(np.float16)).all():
                    raise _Fallback("an offset beyond float16's range")
                self.writer.write(slot, b0 * full_block, woq.fuse_q4_1(raw, r1 - r0, k))
                return
            if direct:
                pieces = read_rows(self.tensors, parts, r0, r1, blocks=False, bf16=True)
                if any(p.shape[0] % BLOCK_ROWS for p in pieces):  # (else each goes where its blocks go)
                    pieces = [torch.cat(pieces)]
                at = b0 * full_block
                for piece in pieces:
                    try:
                        full = woq.quantize_fuse(piece, f.bits)
                    except ValueError as e:  # (float16 scales cannot hold these weights)
                        raise _Fallback(str(e)) from None
                    self.writer.write(slot, at, full)
                    at += full.numel()
                return
            codes, d, m = self._group_chunk(parts, r0, r1, f)
            if f.five:
                five, full = woq.split5(woq.fuse5(codes, d, m, GROUP, f.c), r1 - r0, k, GROUP, f.c)
                self.writer.write(slot, b0 * five_block, five)
            else:
                full = woq.fuse(woq.pack(codes, f.bits), d, m, r1 - r0, k, f.bits, GROUP, f.c)
            self.writer.write(slot, five_total + b0 * full_block, full)

        run_chunks(_chunks(n, k), stream_chunk, self.workers)

    def _write_kq4(self, name: str, parts: list[Part], f: Form) -> None:
        """A ``Q4_K`` weight's super-blocks as they are, in the AVX2 build's K-quant stream
        (:func:`sgrt.kernels.woq.fuse_q4_k`), one chunk of 16-row blocks at a time."""
        from sgrt.kernels import woq

        n, k = f.rows, f.cols
        f.stream_bits = woq.KQ4_BITS
        slot = self.writer.reserve(f"{name}.stream", torch.uint8, (woq.stream_bytes(n, k, woq.KQ4_BITS),))
        block = woq.stream_bytes(BLOCK_ROWS, k, woq.KQ4_BITS)  # bytes of one 16-row block

        def chunk(r0: int, r1: int) -> None:  # (woq.fuse_q4_k: the raw super-blocks in one pass)
            raw = np.concatenate(read_rows(self.tensors, parts, r0, r1, blocks=True, raw=True))
            self.writer.write(slot, r0 // BLOCK_ROWS * block, woq.fuse_q4_k(raw, r1 - r0, k))

        run_chunks(_chunks(n, k), chunk, self.workers)

    def _write_int8_torch(self, name: str, parts: list[Part], f: Form) -> None:
        from sgrt.models.quant import quantize_int8

        q = self.writer.reserve(f"{name}.qweight", torch.int8, (f.rows, f.cols))
        s = self.writer.reserve(f"{name}.scales", torch.bfloat16, (f.rows,))

        def chunk(r0: int, r1: int) -> None:
            codes, scale = quantize_int8(torch.cat(read_rows(self.tensors, parts, r0, r1, blocks=False)))
            self.writer.write(q, r0 * f.cols, codes)
            self.writer.write(s, r0 * 2, scale)

        run_chunks(_chunks(f.rows, f.cols), chunk, self.workers)

    def _write_int4_torch(self, name: str, parts: list[Part], f: Form) -> None:
        from sgrt.models.quant import q4_1_scales_and_zeros, quantize_int4

        g = f.cols // GROUP
        q = self.writer.reserve(f"{name}.codes", torch.uint8, (f.rows, f.cols // 2))
        sz = self.writer.reserve(f"{name}.scales_and_zeros", torch.bfloat16, (f.rows, g, 2))

        def chunk(r0: int, r1: int) -> None:
            if f.source == "blocks":
                codes, d, m = _group_rows(read_rows(self.tensors, parts, r0, r1, blocks=True), f)
                chunk_sz = q4_1_scales_and_zeros(d, m)
            else:
                codes, chunk_sz = quantize_int4(torch.cat(read_rows(self.tensors, parts, r0, r1, blocks=False)))
            self.writer.write(q, r0 * f.cols // 2, codes[:, 0::2] | (codes[:, 1::2] << 4))
            self.writer.write(sz, r0 * g * 4, chunk_sz.transpose(0, 1))  # [G, rows, 2] -> rows first

        run_chunks(_chunks(f.rows, f.cols), chunk, self.workers)

    def add_vector(self, name: str, parts: list[Part], offset: float = 0.0) -> None:
        """Write 1-D weights (norms, a concatenated bias) in the model's dtype, ``offset`` added in
        float32 first (Gemma's ``1 + w`` norms, ``ModelConfig.norm_weight_offset``)."""
        w = torch.cat([p.read(self.tensors, 0, 1, blocks=False).reshape(-1) for p in parts])
        self.writer.add(name, (w + offset if offset else w).to(self.target.dtype))

    # -- the model ----------------------------------------------------------------------------------
    def pack_model(self) -> dict[str, Any]:
        """Write every weight of the model (chunks on as many threads as torch had: see
        :func:`one_thread_per_op`); returns the manifest's ``meta`` for them: ``forms`` (module
        path -> :class:`Form` dict), ``embedding`` (``"dense"``, ``"head"``: the tied LM head's
        table, or ``"group"``: its own table), ``counts``."""
        with one_thread_per_op() as threads:
            self.workers = threads
            return self._pack_model()

    def _pack_model(self) -> dict[str, Any]:
        c = self.config
        hd, hidden, inter = c.head_dim, c.hidden_size, c.intermediate_size
        q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
        shapes = {"qkv_proj": (q + 2 * kv, hidden), "o_proj": (hidden, q), "gate_up_proj": (2 * inter, hidden),
                  "down_proj": (hidden, inter)}
        off = c.norm_weight_offset
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            for fused, names in FUSED_PROJECTIONS.items():
                parts = self.take(*(p + n for n in names))
                self.check_shape(p + fused, parts, *shapes[fused])
                self.pack_weight(p + fused, parts)
            norms = ["input_layernorm", "post_attention_layernorm"]
            if c.sandwich_norms:
                norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            for norm in norms:
                self.add_vector(f"{p}{norm}.weight", self.take(f"{p}{norm}.weight"), off)
            if c.qk_norm:
                self.add_vector(f"{p}q_norm.weight", self.take(p + "self_attn.q_norm.weight"), off)
                self.add_vector(f"{p}k_norm.weight", self.take(p + "self_attn.k_norm.weight"), off)
            if c.attention_bias:
                self.add_vector(f"{p}qkv_bias", self.take(*(p + b for b in QKV_BIASES)))
        self.add_vector("norm.weight", self.take("norm.weight"), off)
        embed = self.take("embed_tokens.weight")
        self.check_shape("embed_tokens", embed, c.vocab_size, hidden)
        head_parts = embed if c.tie_word_embeddings else self.take("lm_head.weight")
        self.check_shape("lm_head", head_parts, c.vocab_size, hidden)
        quantized = self.target.quantization != "none"
        head = self.pack_weight("lm_head", head_parts, head=True) if quantized else None
        embedding = "dense"
        if head is not None and head.form == "group" and head.source == "blocks" and c.tie_word_embeddings:
            embedding = "head"  # (the tied head's own codes: the file's table, read in place)
        elif quantized and self.target.native and not c.tie_word_embeddings:
            f = choose_form([embed[0].entry.type], c.vocab_size, hidden, self.target.quantization, self.target,
                            self.gguf, head=True)
            if f.form == "group" and f.source == "blocks":
                f.five = False  # (looked up, never multiplied: the 8-bit stream alone)
                self.pack_weight("embed_tokens", embed, form=f)
                embedding = "group"
        if embedding == "dense":
            self._write_dense("embed_tokens.weight", embed, Form("dense", c.vocab_size, hidden))
        if not quantized and not c.tie_word_embeddings:
            self._write_dense("lm_head.weight", head_parts, Form("dense", c.vocab_size, hidden))
        return {"forms": self.forms, "embedding": embedding, "counts": self.counts}
