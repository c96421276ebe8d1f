"""Content-addressed cache of generated modules: `load(spec)` compiles a spec once, then reuses it.

The key is the sha256 of everything that decides the generated source: the spec's canonical JSON (so
YAML key order, comments and whitespace do not matter), the templates' digest, the mlagen version, the
triton version and the tuned configurations rendered in (see `tuning_db.py`). An entry is a directory

    <cache dir>/modules/<module name>-<key[:20]>/
        <module name>.py      the generated module
        manifest.json         the full key, what it was made from, and the sha256 of the module's bytes

written under a per-key file lock (`<cache dir>/locks/`), each file atomically (temporary file +
rename), the manifest last. A reader that finds a complete, intact entry imports it without locking;
otherwise it takes the lock, looks again (another process may have just finished it) and builds it only
if it is still missing. An entry whose module no longer matches the sha256 in its manifest (truncated,
edited) is rebuilt with a `CacheIntegrityWarning`.

Cache directory: `MLAGEN_CACHE_DIR`, else the platform's user cache directory (platformdirs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ._version import __version__
from .module_file import import_module_from_path, module_source
from .paths import CACHE_DIR_ENV, atomic_write_text, cache_dir
from .plan import KernelPlan, lower
from .registry import resolve_spec
from .render import templates_digest
from .spec import MLASpec
from .triton_support import triton_version
from .tuning_db import tuned_for_spec

__all__ = [
    "CACHE_DIR_ENV",
    "CacheEntry",
    "CacheError",
    "CacheIntegrityWarning",
    "cache_dir",
    "cache_key",
    "cached_module_path",
    "check_root",
    "clear_cache",
    "foreign_paths",
    "list_entries",
    "load",
]

#: bump when the layout of an entry or the composition of the key changes
CACHE_FORMAT = 1
LOCK_TIMEOUT_S = 300.0
MANIFEST = "manifest.json"


class CacheError(OSError):
    """The cache cannot be used (lock timeout, unwritable directory); reported as one line by the CLI."""


class CacheIntegrityWarning(UserWarning):
    """A cache entry did not match its recorded hash and was rebuilt."""


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def key_inputs(spec: MLASpec, tuned: Mapping[str, Any] | None, *, triton: str | None = None) -> dict[str, Any]:
    """Everything the key covers, as plain data (also recorded in the manifest)."""
    return {
        "format": CACHE_FORMAT,
        "spec": spec.canonical_json(),
        "templates": templates_digest(),
        "mlagen": __version__,
        "triton": triton if triton is not None else triton_version(),
        "tuned": _canonical(tuned or {}),
    }


def cache_key(spec: MLASpec, tuned: Mapping[str, Any] | None = None, *, triton: str | None = None) -> str:
    return hashlib.sha256(_canonical(key_inputs(spec, tuned, triton=triton)).encode()).hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    key: str
    directory: Path
    module_path: Path
    manifest: dict[str, Any]


def _origin(root: Path) -> str:
    return f"{CACHE_DIR_ENV}={root}" if os.environ.get(CACHE_DIR_ENV) else f"the cache directory {root}"


def check_root(root: Path) -> None:
    """A cache root that exists must be a directory: else a CacheError naming MLAGEN_CACHE_DIR (reading a
    file as an empty cache would report 0 modules, and clearing it a raw errno)."""
    if root.exists() and not root.is_dir():
        raise CacheError(f"{_origin(root)} is a file, not a directory: point {CACHE_DIR_ENV} at a directory")


def _root_dir(root: Path) -> None:
    """Create the cache root, or say in one line why it cannot be used (naming MLAGEN_CACHE_DIR)."""
    origin = _origin(root)
    check_root(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise CacheError(
            f"{origin} cannot be written ({error.strerror}): set {CACHE_DIR_ENV} to a writable directory"
        ) from None


def _remove(path: Path) -> None:
    """Delete a file or a whole directory tree of the cache's own (something damaged in its place)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _own_dir(path: Path, *, warn: bool = True) -> None:
    """A directory of the cache's own layout (`modules`, `locks`, an entry): whatever else stands there goes."""
    if path.exists() and not path.is_dir():
        if warn:
            warnings.warn(f"mlagen cache: {path} is not a directory; replacing it", CacheIntegrityWarning, stacklevel=4)
        _remove(path)
    path.mkdir(parents=True, exist_ok=True)


def _entry_dir(root: Path, spec: MLASpec, key: str) -> Path:
    return root / "modules" / f"{spec.module_name}-{key[:20]}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_entry(directory: Path, module_file: str, key: str) -> str | None:
    """None when the entry is complete and intact, else why not ('missing' when absent)."""
    module_path = directory / module_file
    manifest_path = directory / MANIFEST
    if not directory.is_dir():
        return "missing" if not directory.exists() else "the entry is a file, not a directory"
    if not module_path.exists() and not manifest_path.exists():
        return "missing"
    for path in (module_path, manifest_path):
        if path.is_dir():
            return f"{path.name} is a directory"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return "manifest.json is missing"
    except (OSError, ValueError) as error:
        return f"manifest.json is unreadable ({error})"
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return "manifest.json does not belong to this key"
    try:
        data = module_path.read_bytes()
    except FileNotFoundError:
        return f"{module_file} is missing"
    if _sha256(data) != manifest.get("sha256"):
        return f"{module_file} does not match its recorded sha256 ({len(data)} bytes, expected {manifest.get('size')})"
    return None


@dataclass(frozen=True)
class LookupResult:
    path: Path
    key: str
    built: bool


def cached_module_path(
    spec: MLASpec,
    tuned: Mapping[str, Any] | None = None,
    *,
    root: str | Path | None = None,
    plan: KernelPlan | None = None,
) -> LookupResult:
    """The path of the cached module for (spec, tuned), building the entry if it is missing or damaged (plan: the
    spec's plan where the caller has lowered it already)."""
    from filelock import FileLock, Timeout

    root = Path(root) if root is not None else cache_dir()
    key = cache_key(spec, tuned)
    directory = _entry_dir(root, spec, key)
    module_file = f"{spec.module_name}.py"
    path = directory / module_file
    if _check_entry(directory, module_file, key) is None:  # fast path: no lock
        return LookupResult(path, key, built=False)

    _root_dir(root)
    locks = root / "locks"
    try:
        _own_dir(locks)
        lock = FileLock(str(locks / f"{directory.name}.lock"), timeout=LOCK_TIMEOUT_S)
        with lock:
            problem = _check_entry(directory, module_file, key)  # re-check: someone may have built it
            if problem is None:
                return LookupResult(path, key, built=False)
            if problem != "missing":
                warnings.warn(
                    f"mlagen cache entry {directory} is damaged ({problem}); rebuilding it",
                    CacheIntegrityWarning,
                    stacklevel=3,
                )
            source = module_source(spec, dict(tuned) if tuned else None, plan=plan)
            data = source.encode()
            inputs = key_inputs(spec, tuned)
            manifest = {
                "key": key,
                "module": module_file,
                "spec_name": spec.name,
                "spec_hash": spec.content_hash(),
                "mlagen": inputs["mlagen"],
                "triton": inputs["triton"],
                "templates": inputs["templates"],
                "tuned": tuned or {},
                "sha256": _sha256(data),
                "size": len(data),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            _own_dir(root / "modules")
            _own_dir(directory, warn=False)  # an entry in the way was reported as damaged above
            _remove(directory / MANIFEST)  # the manifest is written last: it marks completion
            _remove(path)
            atomic_write_text(path, source)
            atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            return LookupResult(path, key, built=True)
    except Timeout:
        raise CacheError(
            f"could not lock the mlagen cache entry for '{spec.name}' within {LOCK_TIMEOUT_S:.0f} s "
            f"({locks}); is another process stuck?"
        ) from None
    except CacheError:
        raise
    except OSError as error:  # something in the entry that could not be replaced (permissions)
        raise CacheError(f"mlagen cache entry {directory}: {error.strerror or error} ({error.filename})") from None


def load(
    spec: str | Path | MLASpec,
    *,
    spec_dirs: Iterable[str | Path] = (),
    tuned: Mapping[str, Any] | None = None,
    tuning_dbs: Iterable[str | Path] | None = None,
) -> ModuleType:
    """The generated module for a spec (object, YAML path or registered name), compiled only on a cache miss.

    spec_dirs: extra directories of registered specs (besides the bundled ones and `MLAGEN_SPEC_PATH`).
    tuned: tuned configurations to render in ({kernel: {"<arch>|<gpu>|<bucket>": config}}); default: those the
    tuning databases (`tuning_dbs`, default shipped + user database) record for this spec.
    Loading never tunes: run `mlagen tune` for that.
    """
    resolved = resolve_spec(spec, spec_dirs)
    plan = lower(resolved)  # once: the tuned entries are looked up and the module rendered for this plan
    if tuned is None:
        tuned = tuned_for_spec(resolved, tuning_dbs, plan=plan)
    result = cached_module_path(resolved, tuned, plan=plan)
    return import_module_from_path(result.path, f"mlagen_cache.{resolved.module_name}_{result.key[:16]}")


# ---- inspection (mlagen cache info | clear) -------------------------------------------------------------
def _is_entry(directory: Path) -> bool:
    """A cache entry is a directory holding a manifest.json file; anything else under modules/ is not the
    cache's (a user's folder, a file) and is never listed as an entry nor removed."""
    return directory.is_dir() and not directory.is_symlink() and (directory / MANIFEST).is_file()


def _modules_dir(root: Path) -> Path | None:
    check_root(root)
    modules = root / "modules"
    return modules if modules.is_dir() and not modules.is_symlink() else None


def list_entries(root: str | Path | None = None) -> list[CacheEntry]:
    """The cache's entries (directories with a manifest.json), intact or damaged; see `foreign_paths`."""
    root = Path(root) if root is not None else cache_dir()
    modules = _modules_dir(root)
    entries = []
    for directory in sorted(modules.glob("*")) if modules is not None else ():
        if not _is_entry(directory):
            continue
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
            module_path = directory / manifest["module"]
            key = manifest["key"]
        except (OSError, ValueError, KeyError, TypeError):
            manifest, module_path, key = {}, directory, ""
        entries.append(CacheEntry(key, directory, module_path, manifest))
    return entries


def foreign_paths(root: str | Path | None = None) -> list[Path]:
    """What stands under the cache's modules/ directory without being an entry (no manifest.json): left alone
    by `clear_cache`."""
    root = Path(root) if root is not None else cache_dir()
    modules = _modules_dir(root)
    return [path for path in sorted(modules.glob("*")) if not _is_entry(path)] if modules is not None else []


def entry_is_intact(entry: CacheEntry) -> bool:
    return bool(entry.key) and _check_entry(entry.directory, entry.module_path.name, entry.key) is None


def directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def clear_cache(root: str | Path | None = None) -> int:
    """Remove every cached module (not the tuning database); returns how many entries were removed.

    Only entries go (directories with a manifest.json, see `list_entries`): whatever else stands under
    modules/ is not the cache's and stays. Each entry is removed under its lock, so a process building it at
    the same time is not disturbed.
    """
    from filelock import FileLock, Timeout

    root = Path(root) if root is not None else cache_dir()
    entries = list_entries(root)
    if not entries:
        return 0
    removed = 0
    locks = root / "locks"
    try:
        _own_dir(locks)
        for entry in entries:
            with FileLock(str(locks / f"{entry.directory.name}.lock"), timeout=LOCK_TIMEOUT_S):
                if _is_entry(entry.directory):  # (another process may have removed it meanwhile)
                    shutil.rmtree(entry.directory)
                    removed += 1
    except Timeout:
        raise CacheError(f"could not lock a cache entry within {LOCK_TIMEOUT_S:.0f} s ({locks})") from None
    except OSError as error:
        raise CacheError(f"{_origin(root)}: cannot remove {error.filename} ({error.strerror or error})") from None
    # the lock files stay: deleting one that another process holds would let a third one in beside it
    return removed
