"""A GGUF's cache entry: its config, tensor table and tokenizer, read from the file once.

Parsing a GGUF's metadata takes seconds (a tokenizer's 100k-260k strings; ~27 s and ~700 MB of
parsed fields for Gemma 3's vocabulary on the 2-core EPYC), so :func:`ensure_gguf_source` does it
once per file and keeps what a load needs under ``<cache root>/gguf/<stem>-<key>/`` (``key``: a
digest of the file's contents, :func:`gguf_cache_key`):

- ``source.json``: the HF-style config the family reads, the tokenizer facts, and the tensor
  table (name, type, shape, byte offset of every tensor: :class:`~sgrt.models.weight_files.
  TensorEntry`, without the file's path, which is the spec's);
- ``tokenizer/``: the tokenizer built by transformers from the GGUF (``tokenizer.json``,
  ``tokenizer_config.json`` with the chat template, ``generation_config.json`` with the stop ids;
  :mod:`sgrt.models.gguf_tokenizer`), and ``tokenizer-snapshot/``, sgrt's reading of it.

The weights are not converted here: each load target's packed store (:mod:`sgrt.models.
weight_packer`) is a folder inside the entry, read from the GGUF's blocks. Nothing in an entry
is a model folder other engines would try to load (no ``config.json``, no safetensors).
Entries are built in a temporary sibling and renamed into place (:func:`publish_folder`), so
readers never see a half-written one and two processes building at once keep the first.

:func:`export_hf_folder` writes a GGUF as an HF folder (float32 safetensors) for tools that want
one (benchmarks against other engines, tests); loads never use it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

try:
    import fcntl
except ImportError:  # (Windows: no advisory locks; stale folders are then left alone)
    fcntl = None  # type: ignore[assignment]

import torch

from sgrt.errors import ModelLoadError
from sgrt.models.cache_files import delete_path, set_aside
from sgrt.models.checkpoint import GGUFFile, gguf_hf_config
from sgrt.models.gguf_tokenizer import TOKENIZER_DIR, run_child, write_tokenizer_parts
from sgrt.models.tokenizer_snapshot import SNAPSHOT_DIR
from sgrt.models.weight_files import TensorEntry, gguf_tensor_table
from sgrt.paths import cache_root, python_child

logger = logging.getLogger("sgrt.models")

# Bump when what an entry holds changes, so stale entries are not reused.
CONVERTER_VERSION = 2
SOURCE_FILE = "source.json"
# Files up to this size are hashed whole (sha256 runs at ~0.5 GB/s: 0.2 s for the default model);
# larger ones by size plus SAMPLE_BYTES at 16 evenly spaced offsets and the last SAMPLE_BYTES, their
# entry checked against a hash of the whole metadata (entry_problem).
FULL_HASH_MAX_BYTES = 512 << 20
SAMPLE_BYTES = 1 << 20
_MIB = 1 << 20
# A temporary or set-aside folder in the cache that no live builder holds and that is older than this
# was left by a process that died (a killed load): the next build beside it deletes it.
SWEEP_AFTER_SECONDS = 60.0
# How long a load waits for another process building the entry or store it needs before building
# it too (a pack of an 8B model takes minutes on 2 cores).
WAIT_FOR_BUILDER_SECONDS = 1800.0

# ensure_gguf_source's meanwhile: (the entry folder being built, its HF config, its tensor table)
Meanwhile = Callable[[Path, dict[str, Any], dict[str, TensorEntry]], None]

# GGUF tensors that carry rotary metadata rather than weights (read by the families' gguf_extras
# or gguf_config).
GGUF_ROPE_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def gguf_cache_key(path: Path, cache_dir: str | Path | None = None) -> str:
    """A 16-hex-digit digest naming ``path``'s cache entry.

    sha256 over the converter version, the size and the contents: the whole file up to
    ``FULL_HASH_MAX_BYTES``, so any change to it changes the key; past that, ``SAMPLE_BYTES`` at 16
    evenly spaced offsets plus the last ones, which a change of the same size can miss: such a
    file's entry also holds a hash of the file's whole metadata, checked on every load
    (:func:`entry_problem`: an in-place metadata edit, ``gguf-set-metadata``, is seen).

    The digest is kept under the cache root (``keys/``, :mod:`sgrt.models.file_stamps`) beside the
    file's ``stat`` (path, size, mtime, ctime, inode, device): a later call on the file as it was
    reads it back instead of hashing again (0.2 s for the default model's 100 MB, 0.5 s for 250 MB on a
    busy core). Any write to the file changes its ctime, so it is hashed again.
    """
    from sgrt.models.file_stamps import memo_path, read_memo, stat_stamp, write_memo

    stamp = stat_stamp(path) + [CONVERTER_VERSION, FULL_HASH_MAX_BYTES, SAMPLE_BYTES]
    memo = memo_path(stamp[0], cache_dir)
    key = read_memo(memo, stamp)
    if isinstance(key, str):
        return key
    key = _content_key(path, stamp[1])
    write_memo(memo, stamp, key)  # (a read-only cache: hashed again next time)
    return key


def _content_key(path: Path, size: int) -> str:
    h = hashlib.sha256(f"sgrt-gguf-v{CONVERTER_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_MAX_BYTES:
            while chunk := f.read(8 * _MIB):
                h.update(chunk)
        else:
            offsets = [size * i // 16 for i in range(16)] + [max(0, size - SAMPLE_BYTES)]
            for off in offsets:
                f.seek(off)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def head_digest(path: Path, nbytes: int) -> str:
    """sha256 of the first ``nbytes`` of ``path`` (a GGUF's metadata and tensor table: the bytes
    before its tensor data)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while nbytes > 0 and (chunk := f.read(min(nbytes, 8 * _MIB))):
            h.update(chunk)
            nbytes -= len(chunk)
    return h.hexdigest()


def entry_problem(entry: Path, gguf_path: Path) -> tuple[str | None, bool]:
    """What is wrong with ``entry`` as ``gguf_path``'s cache entry: ``(None, True)`` where nothing
    is, else ``(what, stores_hold)``. Checked: ``source.json`` is one this converter writes, its
    tensors lie inside the file, its size is the file's and (for a file keyed by samples,
    :func:`gguf_cache_key`) its metadata hash the file's; ``tokenizer/`` holds the tokenizer's
    files. ``stores_hold`` is False where the file's metadata is not the one the entry was read
    from (its config, and so its stores, may differ)."""
    try:
        src = json.loads((entry / SOURCE_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"cannot read {SOURCE_FILE}: {e}", True
    if not isinstance(src, dict) or src.get("format") != "sgrt-gguf-source" \
            or src.get("converter_version") != CONVERTER_VERSION:
        return f"{SOURCE_FILE} is not one converter version {CONVERTER_VERSION} writes", True
    if not isinstance(src.get("hf_config"), dict) or not isinstance(src.get("tensors"), list):
        return f"{SOURCE_FILE} lacks its config or tensor table", True
    try:
        size = gguf_path.stat().st_size
    except OSError as e:
        return f"cannot read {gguf_path}: {e}", True
    for v in src["tensors"]:
        try:
            t = TensorEntry.from_json(v)
        except (TypeError, ValueError, IndexError):
            return f"{SOURCE_FILE} has a malformed tensor entry {str(v)[:80]}", True
        if t.offset < 0 or t.offset + t.rows * t.row_bytes > size:
            return f"tensor {t.name!r} runs past the file's {size} bytes", True
    if src.get("size") != size:
        return f"it was read from a file of {src.get('size')} bytes, this one has {size}", False
    if size > FULL_HASH_MAX_BYTES:
        head = src.get("head_bytes")
        if not isinstance(head, int) or not 0 < head <= size or head_digest(gguf_path, head) != src.get("head_sha256"):
            return f"{gguf_path}'s metadata is not the one it was read from (edited in place?)", False
    tok = entry / TOKENIZER_DIR
    missing = [f for f in ("tokenizer.json", "tokenizer_config.json") if not (tok / f).is_file()]
    if missing:
        return f"no {TOKENIZER_DIR}/{missing[0]}", True
    return None, True


def gguf_entry(gguf_path: Path, cache_dir: str | Path | None = None) -> Path:
    """Where ``gguf_path``'s cache entry is (whether or not it exists yet)."""
    return cache_root(cache_dir) / "gguf" / f"{gguf_path.stem}-{gguf_cache_key(gguf_path, cache_dir)}"


def ensure_gguf_source(gguf_path: Path, spec: str, cache_dir: str | Path | None = None,
                       repair: bool = False, meanwhile: Meanwhile | None = None) -> tuple[Path, bool]:
    """``gguf_path``'s cache entry (module docstring), built first if absent: ``(folder,
    built_now)``. An entry with something wrong (:func:`entry_problem`), or any with ``repair``
    (its tokenizer did not load), is read again: its ``source.json`` and ``tokenizer/`` are
    replaced in place and its stores kept, unless the file's metadata is not the one it was read
    from (then the whole entry is replaced).

    This process reads the config and tensor table (arrays stepped over:
    :func:`read_gguf_metadata`) and writes ``source.json``; the tokenizer is built in a child
    process (:mod:`sgrt.models.gguf_tokenizer`): transformers' parse of a vocabulary and its
    imports hold ~160-700 MB, and the allocator keeps much of that after it is freed; in a child
    it leaves nothing in the loading process. A file this process cannot read (big-endian,
    damaged) is read whole by the child (:func:`build_gguf_source`), which reports what is wrong.

    ``meanwhile(folder, hf_config, table)``, where given, runs in this process while the child
    builds a new entry's tokenizer (not while it repairs one): ``folder`` is the entry being built
    (its ``tmp`` folder, published with whatever ``meanwhile`` put in it), ``hf_config`` and
    ``table`` as its ``source.json`` reads back. A load packs its weight store there, on the core
    the child leaves. Where this process cannot read the metadata, ``meanwhile`` is not called; an
    exception it raises is raised after the child has finished and its entry is published (a
    child's error first).

    Raises:
        ModelLoadError: an unreadable file, an architecture or tensor no family reads, a tokenizer
            transformers cannot build, or a cache root that is not writable (the child's message;
            for a damaged entry, what is wrong with it too).
    """
    from sgrt.progress import progress

    final = gguf_entry(gguf_path, cache_dir)

    def check(repair: bool) -> tuple[str | None, bool]:
        if not final.is_dir():
            return None, True
        return ("its tokenizer did not load", True) if repair else entry_problem(final, gguf_path)

    problem, stores_hold = check(repair)
    if problem is None and final.is_dir():
        return final, False
    if wait_for_builders(final, spec):  # (another process built or repaired it meanwhile)
        problem, stores_hold = check(False)
        if problem is None and final.is_dir():
            return final, False
    if problem is not None:
        logger.warning("model %s: GGUF cache entry %s: %s; reading %s again", spec, final, problem, gguf_path)
    try:
        if not stores_hold:
            set_aside(final, spec)
        with building(final, spec) as tmp:
            # (decided once: an entry another process publishes while this one builds is theirs,
            # and this build's folder, with the store its meanwhile packed, loses the rename)
            repairing = final.is_dir()
            with progress(f"reading {gguf_path.name} (once; cached)"):
                proc, late = _run_child(gguf_path, tmp, spec, None if repairing else meanwhile)
            if proc.returncode != 0:
                raise ModelLoadError(_child_error(proc, spec, gguf_path))
            relax_permissions(tmp)
            if repairing:  # (a damaged entry: its stores stay)
                _replace_parts(tmp, final, (TOKENIZER_DIR, SNAPSHOT_DIR, SOURCE_FILE), spec)
                return final, True
            published = publish_folder(tmp, final, SOURCE_FILE)
            if late is not None:
                raise late
            return final, published
    except ModelLoadError as e:
        if problem is None:
            raise
        raise ModelLoadError(f"GGUF cache entry {final} is damaged or stale ({problem}) and was not rebuilt: "
                             f"{e}") from e
    except OSError as e:
        what = f"rebuild the cache entry {final} ({problem})" if problem else f"write the cache entry {final}"
        raise ModelLoadError(f"model {spec!r}: cannot {what}: {e}; delete it, or set SGRT_CACHE_DIR to a "
                             f"writable folder") from e


def _run_child(gguf_path: Path, tmp: Path, spec: str,
               meanwhile: Meanwhile | None) -> tuple[subprocess.CompletedProcess, Exception | None]:
    """Build the entry in ``tmp`` and, while its child runs, ``meanwhile(tmp, hf_config, table)``
    where given (:func:`ensure_gguf_source`): the child's finished process (its output as text)
    and the exception ``meanwhile`` raised, if any.

    The child that builds the tokenizer (:mod:`sgrt.models.gguf_tokenizer`, which imports no
    torch: it is the cold load's critical path) starts first, and imports transformers while this
    process reads the file's metadata (:func:`read_gguf_metadata`, arrays stepped over) and
    writes ``source.json``; it then gets the tokenizer facts on its stdin, and ``meanwhile`` the
    config and table as ``source.json`` reads back. Where this process cannot read the metadata,
    that child is stopped and another reads the whole entry (:func:`build_gguf_source`, with
    gguf's reader; its error is the one reported), and ``meanwhile`` is not called. The children
    write to temporary files, so they never wait on a full pipe while this process works.
    Interrupted (``KeyboardInterrupt``), the child is killed."""
    import threading

    late = None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        cmd, env = python_child("sgrt.models.gguf_tokenizer", str(gguf_path), str(tmp), spec)
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, env=env)
        try:
            try:
                hf_cfg, facts, table, head = read_gguf_metadata(gguf_path, spec, fallback=False)
                write_source(tmp, gguf_path, hf_cfg, facts, table, head)
                hf_cfg, table = read_gguf_source(tmp, gguf_path)
            except Exception:  # (the whole-entry child reads it again and says what is wrong)
                child.kill()
                child.wait()
                child.stdin.close()  # (nothing was written to it)
                (tmp / SOURCE_FILE).unlink(missing_ok=True)
                for f in (out, err):
                    f.seek(0)
                    f.truncate()
                cmd, env = python_child("sgrt.models.gguf_convert", str(gguf_path), str(tmp), spec)
                child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, env=env)
                meanwhile = None
            else:  # (a thread: the child reads its stdin only once transformers is imported)
                given = json.dumps({"facts": facts, "hf_config": hf_cfg})
                threading.Thread(target=_feed, args=(child.stdin, given), daemon=True).start()
            if meanwhile is not None:
                try:
                    meanwhile(tmp, hf_cfg, table)
                except Exception as e:
                    late = e
            child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, child.returncode, out.read(), err.read()), late


def _feed(pipe: Any, text: str) -> None:
    """Write ``text`` to a child's stdin and close it; a child that ended first (its output says
    why) is left alone."""
    try:
        pipe.write(text)
        pipe.close()
    except OSError:  # (BrokenPipeError: it exited)
        pass


def _replace_parts(tmp: Path, final: Path, parts: tuple[str, ...], spec: str) -> None:
    """Move each of ``parts`` (files or folders) from ``tmp`` into ``final`` in turn, in place of
    ``final``'s (a folder is swapped by two renames; another process's fresh one is kept)."""
    for part in parts:
        src, dst = tmp / part, final / part
        if not os.path.lexists(src):  # (a part the child could not write: the tokenizer snapshot)
            continue
        if not src.is_dir():
            os.replace(src, dst)
            continue
        if os.path.lexists(dst):
            set_aside(dst, spec)
        try:
            os.rename(src, dst)
        except OSError:
            if not dst.is_dir():
                raise


def _child_error(proc: subprocess.CompletedProcess, spec: str, gguf_path: Path) -> str:
    """The child's error message (its last stdout line, JSON), else how it ended and what it
    printed."""
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])["error"]
    except (IndexError, ValueError, KeyError, TypeError):
        pass
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        how = f"the process reading it was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    else:
        how = f"exit status {proc.returncode}"
    return f"model {spec!r}: reading {gguf_path} failed ({how}): " + (proc.stderr.strip()[-2000:] or "no message")


def read_gguf_metadata(gguf_path: Path, spec: str, fallback: bool = True) -> tuple[
        dict[str, Any], dict[str, Any], dict[str, TensorEntry], int]:
    """One read of ``gguf_path``'s metadata and tensor descriptions (its arrays stepped over:
    :mod:`sgrt.models.gguf_layout`; ``gguf.GGUFReader`` where that reader leaves the file): its
    HF-style config, tokenizer facts, tensor table, and the bytes before its tensor data (the
    metadata, hashed into the entry). With ``fallback=False``, a file the layout reader leaves
    raises its ``NotReadHere`` instead (no parse by ``gguf``: for the loading process).

    Raises:
        ModelLoadError: a file that is not a whole GGUF (what is wrong: :func:`~sgrt.models.
            gguf_check.gguf_layout_problem`), metadata no family takes (names the key), or a
            tensor no family has or sgrt cannot read (names it).
    """
    from sgrt.models.checkpoint import family_config
    from sgrt.models.gguf_layout import NotReadHere, read_layout

    def parse(reader: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, TensorEntry], int]:
        hf_cfg, family, facts = gguf_hf_config(reader, spec)
        family_config(family, hf_cfg, spec, f"the GGUF metadata of {gguf_path}")  # (refuses what it cannot take, now)
        table = gguf_tensor_table(reader, family, gguf_path, spec, GGUF_ROPE_TENSORS)
        head = int(getattr(reader, "data_offset", 0) or min((e.offset for e in table.values()), default=0))
        return hf_cfg, facts, table, head

    # NOTE: the arrays (the vocabulary) are not parsed here: transformers parses them for the
    # tokenizer. What the layout reader leaves (a big-endian file, a damaged one) goes to gguf's.
    try:
        return parse(read_layout(gguf_path))
    except NotReadHere:
        if not fallback:
            raise
        return parse(GGUFFile(gguf_path, spec).reader())


def build_gguf_source(gguf_path: Path, out: Path, spec: str) -> None:
    """Write ``gguf_path``'s cache entry (module docstring) into the existing folder ``out``: one
    parse of the file for its config and tensor table, one by transformers for the tokenizer.

    Raises:
        ModelLoadError: as :func:`ensure_gguf_source`.
    """
    hf_cfg, facts, table, head = read_gguf_metadata(gguf_path, spec)
    write_tokenizer_parts(gguf_path, out, facts, hf_cfg, spec)
    write_source(out, gguf_path, hf_cfg, facts, table, head)


def write_source(out: Path, gguf_path: Path, hf_cfg: dict[str, Any], facts: dict[str, Any],
                 table: dict[str, TensorEntry], head: int) -> None:
    """Write an entry's ``source.json`` into the folder ``out``: :func:`read_gguf_metadata`'s
    reading of ``gguf_path`` (``hf_cfg``, ``facts``, ``table``, ``head``), and the file's size and
    metadata hash (:func:`entry_problem` checks them)."""
    (out / SOURCE_FILE).write_text(json.dumps({
        "format": "sgrt-gguf-source", "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path), "size": gguf_path.stat().st_size,
        "head_bytes": head, "head_sha256": head_digest(gguf_path, head),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hf_config": hf_cfg, "facts": {k: facts.get(k) for k in ("pre", "add_bos_token")},
        "tensors": [e.to_json() for e in table.values()],
    }))


def read_gguf_source(entry: Path, gguf_path: Path) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
    """An entry's (HF config dict, tensor table), the table's paths set to ``gguf_path``.

    Raises:
        ModelLoadError: ``source.json`` unreadable (names it).
    """
    try:
        src = json.loads((entry / SOURCE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"GGUF cache entry {entry}: cannot read {SOURCE_FILE}: {e}") from e
    table = {}
    for v in src["tensors"]:
        e = TensorEntry.from_json(v)
        table[e.name] = replace(e, path=str(gguf_path))
    return src["hf_config"], table


@contextmanager
def building(final: Path, spec: str) -> Iterator[Path]:
    """A fresh ``.tmp-`` folder beside ``final`` to build it in, locked (``flock``) while the
    block runs and deleted after it unless it was renamed. Folders beside it that a process which
    died left (``.tmp-`` ones no live builder holds, ``.stale-`` ones, each older than
    :data:`SWEEP_AFTER_SECONDS`: a killed load's, which may be a store's size) are deleted first.

    Raises:
        ModelLoadError: the cache folder is not writable (names it and the fix).
    """
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        sweep_dead_builds(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    except OSError as e:
        raise ModelLoadError(f"model {spec!r}: cannot write the cache {final.parent}: {e}"
                             " (set SGRT_CACHE_DIR to a writable folder)") from e
    fd = os.open(tmp, os.O_RDONLY)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def wait_for_builders(final: Path, spec: str, timeout: float | None = None) -> bool:
    """Wait while other processes build ``final`` (each holds its ``.tmp-`` folder beside it
    locked: :func:`building`), up to ``timeout`` seconds (:data:`WAIT_FOR_BUILDER_SECONDS`); True
    if it waited, and the caller looks for ``final`` again. Two processes loading the same
    uncached model so pack it once; where both start building at the same instant, or a builder
    outlasts the wait (a stopped process), both build, and the first rename wins
    (:func:`publish_folder`)."""
    if fcntl is None:
        return False
    deadline = time.monotonic() + (WAIT_FOR_BUILDER_SECONDS if timeout is None else timeout)
    try:
        siblings = [p for p in final.parent.iterdir() if p.name.startswith(f".tmp-{final.name}-")]
    except OSError:
        return False
    waited = False
    for p in siblings:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue  # (finished or swept meanwhile)
        try:
            if _locked(fd):  # (else free: a dead builder's, left to the sweep)
                from sgrt.progress import progress

                logger.info("model %s: waiting for another process that is building %s", spec, final)
                with progress(f"waiting for another process building {final.name}"):
                    while _locked(fd) and time.monotonic() < deadline:
                        time.sleep(0.1)
                waited = True
        finally:
            os.close(fd)
    return waited


def _locked(fd: int) -> bool:
    """Whether another open file holds ``fd``'s ``flock`` (tried, and let go at once)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def sweep_dead_builds(folder: Path) -> list[Path]:
    """Delete the ``.tmp-`` / ``.stale-`` entries of ``folder`` that processes which died left
    (see :func:`building`); returns them. A ``.tmp-`` folder whose builder lives is locked and kept."""
    swept = []
    try:
        candidates = [p for p in folder.iterdir() if p.name.startswith((".tmp-", ".stale-"))]
    except OSError:
        return swept
    for p in candidates:
        try:
            if time.time() - p.lstat().st_mtime < SWEEP_AFTER_SECONDS:
                continue
            if not p.is_dir() or p.is_symlink() or fcntl is None:
                if p.name.startswith(".stale-"):
                    delete_path(p)
                    swept.append(p)
                continue
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # (a live builder holds it)
            os.close(fd)
            continue
        try:
            shutil.rmtree(p, ignore_errors=True)
            swept.append(p)
        finally:
            os.close(fd)
    if swept:
        logger.info("deleted %d folder(s) left in %s by loads that did not finish", len(swept), folder)
    return swept


def relax_permissions(folder: Path) -> None:
    """Give a cache entry's folders and files the usual umask-based modes (``mkdtemp`` makes
    0o700), so a cache shared between users stays readable."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def publish_folder(tmp: Path, final: Path, marker: str = SOURCE_FILE) -> bool:
    """Atomically rename the finished ``tmp`` folder to ``final``.

    Returns True if ours was published, False if another process got there first (``tmp`` is
    then deleted and theirs kept). A stale ``final`` without its ``marker`` file (what a finished
    folder holds: a crash left it half-written) is moved aside first.
    """
    if final.exists() and not (final / marker).is_file():
        try:
            set_aside(final, str(final))
        except ModelLoadError:
            pass  # (cannot be moved: the rename below fails and says so, or finds another's)
    try:
        os.rename(tmp, final)  # atomic on POSIX; fails if final exists and is non-empty
        return True
    except OSError:
        if (final / marker).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise


def export_hf_folder(gguf_path: Path, out: Path, spec: str = "") -> Path:
    """Write ``gguf_path`` as an HF folder at ``out``: ``config.json``, ``generation_config.json``,
    float32 ``model.safetensors`` (each tensor dequantized by ``gguf``, q / k rows in HF's rotary
    order, Gemma's norms without llama.cpp's ``+ 1``; under Llama's split names, so families whose
    HF checkpoints fuse q / k / v, Phi-3, are not written as they would read them) and the
    tokenizer files. For tools that take HF folders (vLLM, transformers); it holds the float32
    model in memory, so meant for small ones.

    Raises:
        ModelLoadError: as :func:`ensure_gguf_source`.
    """
    from safetensors.torch import save_file

    from sgrt.models.checkpoint import family_config
    from sgrt.models.registry import family_for_hf
    from sgrt.models.weight_files import CheckpointTensors
    from sgrt.models.weight_files import canonical_parts

    entry, _ = ensure_gguf_source(gguf_path, spec)
    hf_cfg, table = read_gguf_source(entry, gguf_path)
    family = family_for_hf(hf_cfg)
    config = family_config(family, hf_cfg, spec, "the GGUF metadata")
    tensors = CheckpointTensors(table, spec)
    state: dict[str, torch.Tensor] = {}
    try:
        for name, part in canonical_parts(table, family, config, gguf=True).items():
            w = part.read(tensors, 0, part.rows, blocks=False)
            state[f"model.{name}" if not name.startswith("lm_head") else name] = (
                w.reshape(-1) if len(part.entry.shape) == 1 else w).contiguous()
    finally:
        tensors.close()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    for f in (entry / TOKENIZER_DIR).iterdir():
        shutil.copy(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m sgrt.models.gguf_convert GGUF OUT SPEC``: :func:`build_gguf_source` under
    :func:`~sgrt.models.gguf_tokenizer.run_child` (the child of :func:`ensure_gguf_source` for a
    file the loading process could not read)."""
    args = sys.argv[1:] if argv is None else argv
    path, out, spec = Path(args[0]), Path(args[1]), args[2]
    return run_child(lambda: build_gguf_source(path, out, spec), path, out, spec)


if __name__ == "__main__":
    sys.exit(main())
