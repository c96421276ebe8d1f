"""The tuning database: winning tile configurations per (kernel, spec hash, GPU, triton version, bucket).

A database is one JSON file::

    {"schema": 1, "entries": [{"kernel": "decode", "spec": "deepseek-v3-tp8", "spec_hash": "9b9c...",
      "gpu": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "bucket": "m16", "config": [64, 4, 2],
      "time_us": 401.2, "default_config": [64, 4, 2], "default_time_us": 401.2, "cases": [...],
      "candidates": [[[32, 4, 1], 455.0], ...], ...}, ...]}

Entries are keyed by (kernel, spec_hash, gpu, triton, bucket); merging replaces an entry with the same key.
Files are written atomically (temporary file + rename) under a file lock, with the entries sorted, so a
database diffs cleanly and concurrent writers never lose each other's entries.

Where the configurations go: at compile time (`mlagen compile`, `mlagen_compiler.load`) the entries whose
spec hash matches the spec are rendered into the generated module (`DECODE_TUNED`, keyed by GPU name and
bucket); the module picks the entry for the GPU it runs on at launch and falls back to its defaults
elsewhere. Databases consulted, lowest priority first: the ones shipped with mlagen (`tuning/*.json`, e.g.
`tuning/h100.json`), then the user's (`MLAGEN_TUNING_DB`, else `<cache dir>/tuning.json`).
When several triton versions have an entry for the same (GPU, bucket), the installed version's wins, else
the newest recorded one (its configuration is still valid, only possibly not the best). Entries whose
configuration is not in the spec's current autotune space (a stale database) are ignored.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .compile import atomic_write_text
from .spec import MLASpec
from .triton_support import triton_version

__all__ = [
    "SCHEMA_VERSION",
    "TUNING_DB_ENV",
    "TuningDBError",
    "default_db_paths",
    "entry_key",
    "merge_entries",
    "read_db",
    "shipped_db_paths",
    "triton_version",
    "tuned_for_spec",
    "user_db_path",
    "write_db",
]

SCHEMA_VERSION = 1
TUNING_DB_ENV = "MLAGEN_TUNING_DB"
KEY_FIELDS = ("kernel", "spec_hash", "gpu", "triton", "bucket")
REQUIRED_FIELDS = (*KEY_FIELDS, "config")
LOCK_TIMEOUT_S = 120.0


class TuningDBError(ValueError):
    """A tuning database that cannot be read or written (reported as one line by the CLI)."""


# ---- where databases live ----------------------------------------------------------------------------
def shipped_db_paths() -> list[Path]:
    """Databases shipped with mlagen (`tuning/*.json` in the repository, `_data/tuning` in the wheel)."""
    from .render import _data_dir

    return sorted(_data_dir("tuning").glob("*.json"))


def user_db_path() -> Path:
    """`MLAGEN_TUNING_DB`, else `tuning.json` in the mlagen cache directory (where `mlagen tune` writes)."""
    env = os.environ.get(TUNING_DB_ENV)
    if env:
        return Path(env).expanduser()
    from .cache import cache_dir

    return cache_dir() / "tuning.json"


def default_db_paths(include_user: bool = True) -> list[Path]:
    """Shipped databases, then the user's (later ones win)."""
    paths = shipped_db_paths()
    if include_user:
        user = user_db_path()
        if user.exists() and user not in paths:
            paths.append(user)
    return paths


# ---- reading and writing -------------------------------------------------------------------------------
def entry_key(entry: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(entry[k]) for k in KEY_FIELDS)


def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise TuningDBError(f"{where}: an entry must be an object, got {type(entry).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in entry]
    if missing:
        raise TuningDBError(f"{where}: entry is missing {', '.join(missing)}")
    config = entry["config"]
    if not (isinstance(config, list) and config and all(isinstance(v, int) for v in config)):
        raise TuningDBError(f"{where}: config must be a list of integers, got {config!r}")
    return entry


def read_db(path: str | Path) -> list[dict[str, Any]]:
    """Entries of one database file; a missing file is an empty database."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise TuningDBError(f"{path}: cannot read tuning database ({error.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TuningDBError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise TuningDBError(f"{path}: not a tuning database (expected an object with an 'entries' list)")
    if data.get("schema") != SCHEMA_VERSION:
        raise TuningDBError(f"{path}: tuning database schema {data.get('schema')!r}, expected {SCHEMA_VERSION}")
    return [_check_entry(e, f"{path}: entries[{i}]") for i, e in enumerate(data["entries"])]


def merge_entries(*groups: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Union of entry lists; for the same key a later group's entry replaces an earlier one. Sorted."""
    merged: dict[tuple[str, ...], dict[str, Any]] = {}
    for group in groups:
        for entry in group:
            merged[entry_key(entry)] = dict(entry)
    return [merged[k] for k in sorted(merged)]


def _dump(entries: list[dict[str, Any]]) -> str:
    """One entry per line: readable and diff-friendly, deterministic."""
    lines = [json.dumps(e, sort_keys=True, separators=(", ", ": ")) for e in entries]
    body = ",\n    ".join(lines)
    inner = f"\n    {body}\n  " if lines else ""
    return f'{{\n  "schema": {SCHEMA_VERSION},\n  "entries": [{inner}]\n}}\n'


def write_db(path: str | Path, entries: Iterable[Mapping[str, Any]], *, merge: bool = True) -> list[dict[str, Any]]:
    """Write `entries` into the database at `path` (merged with what is there unless merge=False).

    Holds `<path>.lock` while reading, merging and writing, and writes atomically, so concurrent tuners
    never lose each other's entries and a reader never sees half a file. Returns the entries written.
    """
    from filelock import FileLock, Timeout

    path = Path(path)
    new = [_check_entry(dict(e), f"{path}: new entry") for e in entries]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
            result = merge_entries(read_db(path) if merge else [], new)
            atomic_write_text(path, _dump(result))
    except Timeout:
        raise TuningDBError(f"{path}: could not lock the tuning database within {LOCK_TIMEOUT_S:.0f} s") from None
    return result


# ---- what a spec gets at compile time ----------------------------------------------------------------------
def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:4])


def _valid_configs(spec: MLASpec) -> dict[str, dict[str, set[tuple[int, ...]]]]:
    """kernel -> bucket -> configurations of the spec's current autotune space.

    The bucket names mirror `decode_bucket(block_m, small)` of the generated module (tests check they
    agree): "m<block_m>" and, for the latency regime, "m<block_m>-small", over the same space.
    """
    from .plan import lower

    plan = lower(spec)
    out: dict[str, dict[str, set[tuple[int, ...]]]] = {}
    if plan.decode is not None:
        out["decode"] = {}
        for m, cfgs in plan.decode.space:
            configs = {(c.block_n, c.num_warps, c.num_stages) for c in cfgs}
            out["decode"][f"m{m}"] = out["decode"][f"m{m}-small"] = configs
    prefill = getattr(plan, "prefill", None)
    if prefill is not None and hasattr(prefill, "space"):  # one space for every prefill bucket
        out["prefill"] = {"*": {tuple(c.as_tuple()) for c in prefill.space}}
    return out


def select_entries(spec: MLASpec, entries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The entries that apply to `spec`: its hash, a kernel it emits, a configuration of its space; one per
    (kernel, gpu, bucket): the installed triton version's, else the newest triton version's."""
    spec_hash = spec.content_hash()
    valid = _valid_configs(spec)
    installed = triton_version()
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for entry in entries:
        if entry["spec_hash"] != spec_hash or entry["kernel"] not in spec.kernels:
            continue
        kernel, bucket = entry["kernel"], entry["bucket"]
        allowed = valid.get(kernel, {})
        if allowed and tuple(entry["config"]) not in allowed.get(bucket, allowed.get("*", set())):
            continue  # stale: the space changed since this entry was recorded
        slot = (kernel, entry["gpu"], bucket)
        current = best.get(slot)

        def rank(e: Mapping[str, Any]) -> tuple[bool, tuple[int, ...]]:
            return (e["triton"] == installed, _version_tuple(e["triton"]))

        if current is None or rank(entry) > rank(current):
            best[slot] = dict(entry)
    return [best[k] for k in sorted(best)]


def tuned_for_spec(spec: MLASpec, db_paths: Iterable[str | Path] | None = None) -> dict[str, dict[str, list[int]]]:
    """What `render_module(plan, tuned)` takes: {kernel: {"<gpu>|<bucket>": config}} for this spec.

    db_paths: databases to consult, lowest priority first (default: `default_db_paths()`).
    """
    paths = default_db_paths() if db_paths is None else [Path(p) for p in db_paths]
    entries = merge_entries(*(read_db(p) for p in paths))
    tuned: dict[str, dict[str, list[int]]] = {}
    for entry in select_entries(spec, entries):
        tuned.setdefault(entry["kernel"], {})[f"{entry['gpu']}|{entry['bucket']}"] = list(entry["config"])
    return tuned
