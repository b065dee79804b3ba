"""Compile discipline: count what JAX compiles, and keep compiled programs across processes.

The counter listens to jax.monitoring events, so it sees every program JAX lowers: our stage
programs, the small helpers and any stray eager op. A lowering happens even when the persistent
cache then supplies the executable, so `lowered` counts compiles the way a user means it
("this shape was traced and compiled in this process"); `cache_hits` says how many of those the
persistent cache served. What the XLA compiler really compiled is `backend - cache_hits`
(`CompileCounts.compiled`): in jax 0.10.2 every compile goes through one call,
pxla._cached_compilation, which records BACKEND_EVENT once around compiler.compile_or_get_cached,
and that records HIT_EVENT exactly when it returns the cache's executable instead of compiling.
(JAX's own '/jax/compilation_cache/cache_misses' counts cache writes, which only process 0 makes.)
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
import uuid
import warnings

import jax
from jax._src import compilation_cache as jax_compilation_cache
from jax._src import compiler as jax_compiler

from sampling.errors import UsageError
from sampling.loop import CompileCounts
from sampling.run_spec import check_path
from sampling.stage_io import check_writable

LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"
HIT_EVENT = "/jax/compilation_cache/cache_hits"

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "dit-feature-cache", "jax")


class _Counter:
    def __init__(self):
        self._lock = threading.Lock()
        self._counts = {LOWER_EVENT: 0, BACKEND_EVENT: 0, HIT_EVENT: 0}
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event, duration, **kwargs):
        self._bump(event)

    def _on_event(self, event, **kwargs):
        self._bump(event)

    def _bump(self, event):
        if event in self._counts:
            with self._lock:
                self._counts[event] += 1

    def snapshot(self) -> CompileCounts:
        with self._lock:
            c = self._counts
            return CompileCounts(c[LOWER_EVENT], c[BACKEND_EVENT], c[HIT_EVENT])


_COUNTER: _Counter | None = None


def compile_counts() -> CompileCounts:
    """Totals since the counter was installed: on first call, which importing `tpu` makes, so
    a command's totals cover its whole run."""
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = _Counter()
    return _COUNTER.snapshot()


def remove_empty_entries(directory: str) -> int:
    """Remove 0-byte cache entries (a write that met a full disk left them before entries were
    written whole, and a JAX of another program may still; JAX then warns about each on every
    later run and never rewrites it), and the temporary files of writes a kill cut short (an
    hour old: a live writer on another host of a shared cache may be writing one now). Returns
    how many went."""
    removed = 0
    stale = time.time() - 3600
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                info = entry.stat()
                if info.st_size == 0 or (entry.name.endswith(_PART) and info.st_mtime < stale):
                    os.remove(entry.path)
                    removed += 1
            except OSError:
                pass
    return removed


# --- whole entries: JAX's local cache writes an entry in place (LRUCache.put -> Path.write_bytes,
# jax 0.10.2): a full disk or a kill leaves a 0-byte or cut entry under its final name, which the
# other hosts of a slice sharing the folder read first. Entries are written to a temporary name
# beside it and renamed in instead. Remove once JAX writes them atomically itself.

_PART = ".part"  # the suffix of an entry being written


class _WholeFiles(type(pathlib.Path())):
    """A path whose write_bytes is whole or nothing (a temporary file renamed in); paths made
    from it (cache_dir / name) are of this kind too."""

    def write_bytes(self, data) -> int:
        part = self.with_name(f".{self.name}.{uuid.uuid4().hex}{_PART}")
        try:
            written = pathlib.Path.write_bytes(part, data)
            os.replace(part, self)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return written


def _write_whole_entries(cache) -> None:
    base = getattr(cache, "_base_cache", cache)  # VerificationCache wraps the LRUCache
    path = getattr(base, "path", None)
    # A bucket's objects appear whole already. With a size limit (jax_compilation_cache_max_size)
    # JAX's eviction reads sizes the way its own path type (etils.epath, where installed) gives
    # them: left as JAX writes it (0-byte entries are removed at the next start).
    if isinstance(path, pathlib.PurePath) and "://" not in str(path) \
            and not getattr(base, "eviction_enabled", True):
        base.path = base._path = _WholeFiles(str(path))


def _whole_entries(get_file_cache):
    def made(path):
        found = get_file_cache(path)
        if found is not None:
            _write_whole_entries(found[0])
        return found
    made.whole_entries = True
    return made


def write_whole_entries() -> None:
    """Make the persistent cache JAX opens (lazily, at the first compile) write its entries
    whole; and the one it has opened already. A JAX without these internals is left as it is."""
    opener = getattr(jax_compilation_cache, "get_file_cache", None)
    if opener is not None and not getattr(opener, "whole_entries", False):
        jax_compilation_cache.get_file_cache = _whole_entries(opener)
    if getattr(jax_compilation_cache, "_cache", None) is not None:
        _write_whole_entries(jax_compilation_cache._cache)


# --- entries only this process can write: JAX writes the persistent cache from process 0 alone
# (compiler._cache_write, jax 0.10.2), so that the hosts of a slice do not all write the same
# entry of a program they share (contention on a bucket). But a program on one process's own
# devices has a key of its own (its device ids are in the compile options; JAX strips them on
# GPU only), and on CPU every key is the process's own (the CPU topology fingerprint in it differs
# per process): no other process ever writes those, so processes other than 0 compiled them again
# on every run. Here each process writes them itself; programs shared across processes are still
# written by process 0 alone. Remove once JAX writes such entries from every process.

_COMPILING = threading.local()  # the devices of the program being compiled on this thread


def _own_key(backend, devices) -> bool:
    """Whether no other process can make this program's cache key."""
    if backend.platform == "cpu":
        return True
    if backend.platform == "gpu" or devices is None:
        return False
    return {d.process_index for d in devices.flat} == {jax.process_index()}


def _noting_devices(compile_or_get_cached):
    def compile_noted(backend, computation, devices, *args, **kwargs):
        _COMPILING.devices = devices
        try:
            return compile_or_get_cached(backend, computation, devices, *args, **kwargs)
        finally:
            _COMPILING.devices = None
    compile_noted.own_entries = True
    return compile_noted


def _writing_own_entries(cache_write):
    def write(cache_key, compile_time_secs, module_name, backend, executable, *rest):
        cache_write(cache_key, compile_time_secs, module_name, backend, executable, *rest)
        # jax <= 0.10 passes host_callbacks last (and skips programs with any); 0.11 dropped the
        # argument and caches those programs too
        host_callbacks = rest[0] if rest else ()
        if jax.process_index() == 0 or host_callbacks \
                or not _own_key(backend, getattr(_COMPILING, "devices", None)):
            return  # written above (process 0), or never (as JAX: host callbacks), or shared
        try:
            jax_compilation_cache.put_executable_and_time(cache_key, module_name, executable,
                                                          backend, int(compile_time_secs))
        except Exception as exc:  # noqa: BLE001 - as JAX: a cache that cannot be written warns
            warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}': "
                          f"{type(exc).__name__}: {exc}", stacklevel=2)
    write.own_entries = True
    return write


def write_own_entries() -> None:
    """Make every process write the cache entries no other process can write for it. A JAX
    without these internals is left as it is."""
    compile_fn = getattr(jax_compiler, "compile_or_get_cached", None)
    cache_write = getattr(jax_compiler, "_cache_write", None)
    if compile_fn is None or cache_write is None or getattr(cache_write, "own_entries", False):
        return
    jax_compiler.compile_or_get_cached = _noting_devices(compile_fn)
    jax_compiler._cache_write = _writing_own_entries(cache_write)


def is_remote(directory: str) -> bool:
    """A bucket URL (gs://bucket/path, ...), which JAX reads and writes through etils.epath,
    rather than a local or mounted folder (file:// counts as local, as in JAX)."""
    return "://" in directory and not directory.startswith("file://")


def check_remote(directory: str) -> str | None:
    """What stops JAX from using the bucket URL `directory` (a missing package), or None."""
    try:
        from etils import epath  # noqa: F401
    except ImportError:
        return (f"{directory} is a bucket URL, which JAX's compilation cache reaches through "
                "etils.epath; expected it installed: pip install 'etils[epath,epath-gcs]' "
                "(in requirements-tpu.txt)")
    return None


FLAG = "--compile_cache_dir"  # the commands' flag (sampling.cli.add_compile_cache_flag)


def cache_dir_of(flag: str | None) -> str | None:
    """The folder or bucket URL --compile_cache_dir names: the default for None, no persistent
    cache (None) for 'none'."""
    if flag is None:
        return DEFAULT_CACHE_DIR
    return None if flag.lower() == "none" else flag


def check_cache_dir(flag: str | None) -> str | None:
    """`cache_dir_of(flag)`, refused (UsageError, StageFileError) before any work where JAX could
    not use it: an empty path, a bucket URL without etils, a folder that cannot be written."""
    check_path(FLAG, flag)
    directory = cache_dir_of(flag)
    if directory is None:
        return None
    if is_remote(directory):  # a bucket: JAX reaches it itself, if it can
        problem = check_remote(directory)
        if problem is not None:
            raise UsageError(f"{FLAG} {problem}")
    else:
        check_writable(directory, FLAG,
                       hint=" (or 'none' to run without the persistent compilation cache)")
    return directory


def enable_compile_cache(directory: str | None) -> str | None:
    """Turn the persistent compilation cache on (None: leave it off). Returns the directory. A
    bucket URL (gs://...) is handed to JAX as it is: every host of a slice then reads the
    entries process 0 wrote, where a per-host folder would make the others compile again."""
    if not directory:
        return None
    if is_remote(directory):
        problem = check_remote(directory)
        if problem is not None:
            raise RuntimeError(problem)
    else:
        os.makedirs(directory, exist_ok=True)
        remove_empty_entries(directory)
    write_whole_entries()
    write_own_entries()
    jax.config.update("jax_compilation_cache_dir", directory)
    # Cache every program, however small or fast to compile: warm-up is the cost we remove, and
    # JAX's default (no entry for a compile under 1 s) skips most programs of the tiny models and
    # every eager helper, which a second run would then compile again.
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return directory
