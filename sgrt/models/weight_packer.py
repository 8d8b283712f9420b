"""Packing a checkpoint into a weight store: every tensor in the form the model runs it, written
one row chunk at a time.

The loader (:mod:`sgrt.models.loader`) packs a checkpoint once per :class:`Target` (dtype,
quantization and kernel layout) into a store (:mod:`sgrt.models.weight_store`) and maps it on
every load. Packing never holds more than one chunk of rows (:data:`CHUNK_WEIGHTS` weights) of a
tensor in memory, and never a float copy of the model, so a cold load peaks at the packed
weights plus one chunk's working set.

Each fused projection of the model (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up;
``o_proj``; ``down_proj``), the LM head and the input embedding gets one *form*, chosen by
:func:`choose_form` from the quantization, the kernels that run here and the file's tensor
types (the rules the int4 / int8 modes have always followed, :mod:`sgrt.models.quant`):

- ``"dense"``: the weight in the model's dtype (no quantization; or a shape no kernel takes);
- ``"group"``: sgrt's native kernel (:mod:`sgrt.kernels.woq`): 4- or 8-bit codes with a float16
  scale and offset per 32 inputs, laid out as the loaded build reads them (the AVX2 build's one
  stream per weight, ``woq.fuse`` / ``woq.fuse5``; the AVX-512 BF16 build's ``woq.pack``-ed codes
  beside the scales and offsets). Its ``source`` says where the codes come from: ``"blocks"``, a
  GGUF's own codes (:data:`sgrt.models.gguf_raw.BLOCK_READERS`: Q4_0 / Q4_1 / Q4_K as 4-bit,
  Q5_0 / Q5_1 / Q5_K / Q8_0 as 8-bit; no float round trip), or ``"float"``, quantized from the
  rows by min / max (``quantize_groups``; HF checkpoints, and GGUF types without that form such as
  Q6_K, dequantized a chunk at a time);
- ``"int8_torch"`` / ``"int4_torch"``: torch's packed kernels where the native one does not run
  (CUDA; CPUs without AVX2): their codes and scales, device-packed at load.

The fused projections' rows are the parts' rows stacked, and every layout here is a run of
16-row blocks, so a chunk of 16-row blocks is written where its blocks go and no part needs to
be held whole. llama.cpp's rotary row order of q / k is undone per head as rows are read.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from sgrt.errors import ModelLoadError
from sgrt.models import gguf_raw
from sgrt.models.checkpoint import unpermute_rotary
from sgrt.models.config import ModelConfig
from sgrt.models.layers import FUSED_PROJECTIONS, QKV_BIASES
from sgrt.models.weight_files import CheckpointTensors, TensorEntry
from sgrt.models.weight_store import StoreWriter

logger = logging.getLogger("sgrt.models")

# Weights a chunk of rows holds at most (8 MB of float32); at least one 16-row block.
CHUNK_WEIGHTS = 1 << 21
BLOCK_ROWS = 16
GROUP = 32
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Bump when what a store holds for a target changes (its folder name carries it: old ones are not read).
PACK_VERSION = 1


@dataclass(frozen=True)
class Target:
    """What a store is packed for: the model's dtype, its quantization and the kernel layout.

    Attributes:
        dtype: the model's parameter / activation dtype.
        quantization: ``"none"``, ``"int8"`` or ``"int4"``.
        layout: ``"plain"`` (no quantization), ``"avx2"`` / ``"avx2-5bit"`` (the AVX2 build's
            streams; with 5-bit streams for codes below 32 where the CPU reads them),
            ``"avx512-bf16"`` (the opt-in AVX-512 BF16 build) or ``"torch-cpu"`` / ``"torch-cuda"``
            (torch's kernels, whose packing is the device's).
    """

    dtype: torch.dtype
    quantization: str
    layout: str

    @property
    def key(self) -> str:
        """The store's folder name under its checkpoint's cache entry."""
        return f"{DTYPE_NAMES[self.dtype]}-{self.quantization}-{self.layout}-v{PACK_VERSION}"

    @property
    def native(self) -> bool:
        return self.layout in ("avx2", "avx2-5bit", "avx512-bf16")


def target_for(dtype: torch.dtype, quantization: str, device: torch.device) -> Target:
    """The target a load of this dtype and quantization on ``device`` runs (the native kernel's
    build and its 5-bit streams are read off this machine: :mod:`sgrt.kernels.woq`)."""
    from sgrt.kernels import woq
    from sgrt.models import quant

    if quantization == "none":
        return Target(dtype, quantization, "plain")
    if device.type == "cpu" and quant.native_kernel_available():
        if woq.isa() == "avx2":
            return Target(dtype, quantization, "avx2-5bit" if woq.five_bit_streams() else "avx2")
        return Target(dtype, quantization, "avx512-bf16")
    return Target(dtype, quantization, f"torch-{device.type}")


@dataclass(frozen=True)
class Part:
    """Rows of one checkpoint tensor that make up one canonical weight.

    Attributes:
        entry: the tensor. row0, rows: its rows that are this weight (a fused tensor's share).
        heads: undo llama.cpp's rotary row order, per head of ``rows // heads`` rows (GGUF q / k).
        shift: subtracted from the values (llama.cpp stores Gemma's norms as ``1 + w``).
    """

    entry: TensorEntry
    row0: int
    rows: int
    heads: int | None = None
    shift: float = 0.0

    def read(self, tensors: CheckpointTensors, a: int, b: int, blocks: bool) -> Any:
        """Its rows ``a .. b``: the file's blocks (:data:`gguf_raw.BLOCK_READERS`'s weight) if
        ``blocks``, else float32 ``[b - a, cols]``."""
        a0, b0 = a, b
        if self.heads:  # (whole heads are read, unpermuted, then cut)
            hd = self.rows // self.heads
            a0, b0 = a // hd * hd, -(-b // hd) * hd
        lo, hi = self.row0 + a0, self.row0 + b0
        if blocks:
            w = gguf_raw.BLOCK_READERS[self.entry.type].unpack(tensors.read_raw(self.entry, lo, hi), hi - lo,
                                                              self.entry.cols)
            fields = [w.codes, w.d] + ([w.m] if isinstance(w, gguf_raw.Q4_1Weight) else [])
        else:
            fields = [tensors.read_float(self.entry, lo, hi)]
        if self.heads:
            fields = [unpermute_rotary(t, (b0 - a0) // (self.rows // self.heads)) for t in fields]
        fields = [t[a - a0: b - a0] for t in fields]
        if not blocks:
            return fields[0] - self.shift if self.shift else fields[0]
        if isinstance(w, gguf_raw.Q4_1Weight):
            return gguf_raw.Q4_1Weight(*fields)
        return gguf_raw.SymmetricWeight(fields[0], fields[1], w.c)


def canonical_parts(entries: dict[str, TensorEntry], family: Any, config: ModelConfig, gguf: bool
                    ) -> dict[str, Part]:
    """Every canonical weight (Llama names without the ``model.`` prefix: ``layers.0.self_attn.
    q_proj.weight``, ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight``) as a
    :class:`Part` of a checkpoint tensor: fused tensors split by ``family.fused_parts``; for a
    GGUF (``gguf``) q / k rows marked for unpermuting where the family's file permutes them, and
    norms for the family's norm offset."""
    out: dict[str, Part] = {}
    for name, entry in entries.items():
        split = family.fused_parts(name, config) or [(name, 0, entry.rows)]
        for part, row0, rows in split:
            key = part.removeprefix("model.")
            heads = None
            if gguf and family.gguf_unpermute_qk:
                if key.endswith("self_attn.q_proj.weight"):
                    heads = config.num_attention_heads
                elif key.endswith("self_attn.k_proj.weight"):
                    heads = config.num_key_value_heads
            shift = family.gguf_norm_offset if gguf and key.endswith("norm.weight") else 0.0
            out[key] = Part(entry, row0, rows, heads, shift)
    return out


# ---- choosing forms ------------------------------------------------------------------------------

@dataclass
class Form:
    """How one weight is packed (module docstring); stored in the manifest as a dict.

    Attributes:
        form: ``"dense"``, ``"group"``, ``"int8_torch"`` or ``"int4_torch"``.
        rows, cols: the weight's shape. bits: 4 or 8 (quantized forms).
        source: ``"blocks"`` (the file's codes) or ``"float"`` (quantized from the values).
        c: the codes' symmetric zero where every offset is ``-c * scale`` (``Q8_0``: 128,
            ``Q5_0``: 16; the AVX2 build's compact stream), else 0.
        five: the AVX2 build's 5-bit stream of codes below 32 beside the 8-bit one.
        wide: an int4-mode weight kept in int8 because the file holds it in more than 4 bits.
        stream_bits: the kernel's ``bits`` argument (``"group"`` on the AVX2 build).
    """

    form: str
    rows: int
    cols: int
    bits: int = 0
    source: str = "float"
    c: int = 0
    five: bool = False
    wide: bool = False
    stream_bits: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def choose_form(parts: list[Part], method: str, target: Target, gguf: bool, head: bool = False) -> Form:
    """The form of one fused weight (module docstring). ``method``: the quantization; ``head``:
    the LM head, int8 unless the file holds it in 4-bit blocks (an int4 head quantized at load
    cost ~10 points of top-1 agreement on the default model: :mod:`sgrt.models.quant`)."""
    from sgrt.models.quant import GroupLinear, Int4Linear, Int8Linear

    rows, cols = sum(p.rows for p in parts), parts[0].entry.cols
    types = [p.entry.type for p in parts]
    readers = [gguf_raw.BLOCK_READERS.get(t) for t in types] if gguf else [None] * len(parts)
    if method == "none":
        return Form("dense", rows, cols)
    device = torch.device(target.layout.removeprefix("torch-") if target.layout.startswith("torch-") else "cpu")
    four = all(r is not None and r.bits == 4 for r in readers)
    kind = ("int4" if four and method == "int4" else "int8") if head else method
    wide = kind == "int4" and gguf and any(gguf_raw.wider_than_4_bits(t) for t in types)
    if wide:  # a part finer than int4 in the file: keep its precision (int8)
        kind = "int8"
    bits = 8 if kind == "int8" else 4
    if kind == "int4" and four:
        if target.native and GroupLinear.supports(rows, cols, torch.device("cpu")):
            return Form("group", rows, cols, 4, "blocks")
        if Int4Linear.supports(rows, cols, device):
            return Form("int4_torch", rows, cols, 4, "blocks")
    # (8-bit codes hold a 4-bit part exactly too: an int4-mode projection widened by its finer parts
    # keeps its 4-bit ones as they are; int8 mode re-quantizes 4-bit files, as it always has)
    widths = (4, 8) if wide else (8,)
    if kind == "int8" and target.native and all(r is not None and r.bits in widths for r in readers) \
            and GroupLinear.supports(rows, cols, torch.device("cpu")):
        zeros = {_symmetric_zero(t) for t in types}
        if 0 in zeros:
            c = 0  # (an asymmetric part: every group keeps its offset, codes as they are)
        else:
            c = zeros.pop() if len(zeros) == 1 else 128  # (SymmetricWeight.cat's shift to 128)
        unshifted = c == 0 or all(_symmetric_zero(t) == c for t in types)
        five = target.layout == "avx2-5bit" and unshifted and all(
            gguf_raw.BLOCK_READERS[t].max_code <= 31 for t in types)
        return Form("group", rows, cols, 8, "blocks", c, five, wide)
    if target.native:
        if GroupLinear.supports(rows, cols, torch.device("cpu")):
            return Form("group", rows, cols, bits, "float", wide=wide)
    elif (Int8Linear if kind == "int8" else Int4Linear).supports(rows, cols, device):
        return Form(f"{kind}_torch", rows, cols, bits, "float", wide=wide)
    return Form("dense", rows, cols)


def _symmetric_zero(kind: str) -> int:
    """The symmetric zero ``c`` of a GGML type's codes (``Q8_0``: 128, ``Q5_0``: 16), 0 for the
    asymmetric ones."""
    return {"Q8_0": 128, "Q5_0": 16}.get(kind, 0)


# ---- writing -------------------------------------------------------------------------------------

class _Fallback(Exception):
    """This weight cannot take its chosen form (a scale beyond float16); pack it as ``dense``."""


def _chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = max(BLOCK_ROWS, CHUNK_WEIGHTS // max(cols, 1) // BLOCK_ROWS * BLOCK_ROWS)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def read_rows(tensors: CheckpointTensors, parts: list[Part], r0: int, r1: int, blocks: bool) -> list[Any]:
    """Rows ``r0 .. r1`` of the weight the parts stack, as each part's pieces (:meth:`Part.read`)."""
    pieces, at = [], 0
    for p in parts:
        lo, hi = max(r0, at), min(r1, at + p.rows)
        if lo < hi:
            pieces.append(p.read(tensors, lo - at, hi - at, blocks))
        at += p.rows
    return pieces


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
        f = form or choose_form(parts, self.target.quantization, self.target, self.gguf, head)
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

        def chunk(r0: int, r1: int) -> None:
            rows = torch.cat(read_rows(self.tensors, parts, r0, r1, blocks=False))
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
        f.stream_bits = woq.stream_bits(5 if f.five else f.bits, f.c)
        total = woq.stream_bytes(n, k, f.stream_bits, GROUP)
        slot = self.writer.reserve(f"{name}.stream", torch.uint8, (total,))
        hb = 32 if f.c else 64
        full_block = g * (hb + BLOCK_ROWS * GROUP * f.bits // 8)  # bytes of one 16-row block
        five_block = g * (hb + BLOCK_ROWS * GROUP * 5 // 8)
        five_total = n // BLOCK_ROWS * five_block if f.five else 0

        def stream_chunk(r0: int, r1: int) -> None:
            codes, d, m = self._group_chunk(parts, r0, r1, f)
            b0 = r0 // BLOCK_ROWS
            if f.five:
                five, full = woq.split5(woq.fuse5(codes, d, m, GROUP, f.c), r1 - r0, k, GROUP, f.c)
                self.writer.write(slot, b0 * five_block, five)
            else:
                full = woq.fuse(woq.pack(codes, f.bits), d, m, r1 - r0, k, f.bits, GROUP, f.c)
            self.writer.write(slot, five_total + b0 * full_block, full)

        run_chunks(_chunks(n, k), stream_chunk, self.workers)

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
            f = choose_form(embed, self.target.quantization, self.target, self.gguf, head=True)
            if f.form == "group" and f.source == "blocks":
                f.five = False  # (looked up, never multiplied: the 8-bit stream alone)
                self.pack_weight("embed_tokens", embed, form=f)
                embedding = "group"
        if embedding == "dense":
            self._write_dense("embed_tokens.weight", embed, Form("dense", c.vocab_size, hidden))
        if not quantized and not c.tie_word_embeddings:
            self._write_dense("lm_head.weight", head_parts, Form("dense", c.vocab_size, hidden))
        return {"forms": self.forms, "embedding": embedding, "counts": self.counts}
