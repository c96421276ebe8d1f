"""The tuning database: winning tile configurations keyed by what decides the kernel.

A database is one JSON file (schema 2)::

    {"schema": 2, "entries": [{"kernel": "decode", "geometry": "dc512-dr64-page64-bfloat16", "bucket": "m16",
      "arch": "sm90", "gpu": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "config": [32, 4, 3],
      "time_us": 271.7, "default_config": [32, 4, 3], "default_time_us": 271.7,
      "measured_with": [{"spec": "deepseek-v3-tp8", "num_heads": 16, "seqlen_q": 1}], "cases": [...],
      "candidates": [[[32, 4, 3], 271.7], ...], ...}, ...]}

An entry is keyed by (kernel, geometry, bucket, arch, gpu, triton), where

- kernel: "decode" or "prefill";
- geometry: what the kernel's code depends on besides its tile configuration (`kernel_geometry`), so a
  renamed spec, another q_lora_rank or rope scaling, or a new spec field does not lose its entries, and
  specs with the same kernel share them;
- bucket: the launch shape class (decode: the row block `m<block_m>`, `m<block_m>-small` in the latency
  regime, `gluon` for the Hopper backend; prefill: `causal` or `prefix`, `gluon-causal` or `gluon-prefix` for
  the Hopper backend);
- arch: the GPU family, its compute capability (`sm90`); gpu: the `torch.cuda.get_device_name()` it was
  measured on, or `*` for an entry meant for the whole family;
- triton: the Triton release it was measured with.

Merging replaces an entry with the same key. Files are written atomically (temporary file + rename) under
a file lock, with the entries sorted, so a database diffs cleanly and concurrent writers never lose each
other's entries. Schema-1 files (keyed by the whole spec's sha256) are refused with a one-line error;
`mlagen tuning migrate FILE` converts them (`migrate_entries`), re-measuring nothing.

Where the configurations go: at compile time (`mlagen compile`, `mlagen_compiler.load`) the entries for
the spec's kernel geometries are rendered into the generated module (`DECODE_TUNED`, `PREFILL_TUNED`,
keyed by (arch, gpu, bucket)), with one family-wide (arch, "*", bucket) row per arch and bucket: the
recorded `*` entry, else the entry of the family's device whose name sorts first. At launch the module
takes the (arch, device name) row, else its family's row, else the plan's default. Databases consulted,
lowest priority first: the ones shipped with mlagen (`tuning/*.json`), then the user's
(`MLAGEN_TUNING_DB`, else `<cache dir>/tuning.json`). When several triton versions have an entry for the
same (kernel, arch, gpu, bucket), the installed version's wins, else the newest recorded one (its
configuration is still valid, only possibly not the best). Entries whose configuration is not in the
spec's current autotune space (a stale database, or tiles pinned by the spec) are ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from .launch_policy import DECODE_GLUON_BUCKET, PREFILL_GLUON_BUCKETS
from .paths import atomic_write_text, cache_dir, shipped_tuning_dir
from .plan import KernelPlan, lower
from .registry import resolve_spec
from .spec import MLASpec, unique_json_keys
from .triton_support import triton_version

__all__ = [
    "FAMILY_WIDE",
    "MARGIN",
    "PREFILL_BUCKETS",
    "SCHEMA_VERSION",
    "TUNING_DB_ENV",
    "TuningDBError",
    "default_db_paths",
    "entry_key",
    "gpu_arch",
    "kernel_geometry",
    "merge_entries",
    "migrate_db",
    "migrate_entries",
    "read_db",
    "select_entries",
    "shipped_db_paths",
    "triton_version",
    "tuned_for_spec",
    "user_db_path",
    "write_db",
]

SCHEMA_VERSION = 2
TUNING_DB_ENV = "MLAGEN_TUNING_DB"
KEY_FIELDS = ("kernel", "geometry", "bucket", "arch", "gpu", "triton")
REQUIRED_FIELDS = (*KEY_FIELDS, "config")
#: the `gpu` of an entry that serves every device of its arch
FAMILY_WIDE = "*"
#: prefill launches: new tokens among themselves (causal) and against a cached prefix (prefix)
PREFILL_BUCKETS = ("causal", "prefix")
#: a configuration replaces the default only if it is faster by more than this fraction (the tuner's
#: rule, also applied when the migration pools several measurements of one key)
MARGIN = 0.01
LOCK_TIMEOUT_S = 120.0
#: the fields of a schema-1 entry (the key was kernel, spec_hash, gpu, triton, bucket)
V1_FIELDS = ("kernel", "spec", "spec_hash", "gpu", "triton", "bucket", "config")

#: GPU family of schema-1 entries, which recorded only the device name: (name prefix, arch)
GPU_ARCH_BY_NAME_PREFIX = (
    ("NVIDIA H100", "sm90"),
    ("NVIDIA H200", "sm90"),
    ("NVIDIA H800", "sm90"),
    ("NVIDIA H20", "sm90"),
    ("NVIDIA A100", "sm80"),
    ("NVIDIA A800", "sm80"),
    ("interpreter", "interpreter"),
)


class TuningDBError(ValueError):
    """A tuning database that cannot be read or written (reported as one line by the CLI)."""


# ---- the key --------------------------------------------------------------------------------------------
def kernel_geometry(kernel: str, spec: MLASpec) -> str:
    """What `kernel`'s code depends on besides its tile configuration and launch bucket, as a key string.

    decode (`templates/decode.py.jinja`): Dc and Dr (tile widths, padding, TMA descriptors), the page size
    (which blocks TMA can fetch, how rows are gathered), the dtype and the cache dtype where it differs (an
    fp8 cache halves the bytes per block, so its best tiles are its own: `...-bfloat16-float8_e4m3fn`; a
    16-bit cache keeps the key it had before caches could differ). The heads H and the query tokens
    Sq enter only through the rows H * Sq, and those only through the row block they choose (the bucket,
    `m<block_m>`); Dn, Dv, q_lora_rank, the softmax scale (a runtime argument) and the name do not count.
    prefill (`templates/prefill.py.jinja` and its Hopper backend `prefill_gluon.py.jinja`, prefill and chunked
    prefill): Dn, Dr and Dv (the nope / rope score dots and the value width) and the dtype; H only sizes the
    grid, the page size, Dc and the cache dtype only the prefix expansion (PyTorch gather, dequantisation and
    GEMMs, not the tuned kernel), and causal or prefix (on either backend) is the bucket.
    """
    if kernel == "decode":
        cache = f"-{spec.cache_dtype}" if spec.cache_dtype != spec.dtype else ""
        return f"dc{spec.kv_lora_rank}-dr{spec.qk_rope_head_dim}-page{spec.page_size}-{spec.dtype}{cache}"
    if kernel == "prefill":
        return f"dn{spec.qk_nope_head_dim}-dr{spec.qk_rope_head_dim}-dv{spec.v_head_dim}-{spec.dtype}"
    raise ValueError(f"kernel {kernel!r}: no tuning key (choose decode or prefill)")


def gpu_arch(major: int, minor: int) -> str:
    """The GPU family key of a compute capability: (9, 0) -> "sm90" (what generated modules compute)."""
    return f"sm{major}{minor}"


def entry_key(entry: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(entry[k]) for k in KEY_FIELDS)


# ---- where databases live ----------------------------------------------------------------------------
def shipped_db_paths() -> list[Path]:
    """Databases shipped with mlagen (`tuning/*.json` in the repository, `_data/tuning` in the wheel)."""
    return sorted(shipped_tuning_dir().glob("*.json"))


def user_db_path() -> Path:
    """`MLAGEN_TUNING_DB`, else `tuning.json` in the mlagen cache directory (where `mlagen tune` writes)."""
    env = os.environ.get(TUNING_DB_ENV)
    if env:
        return Path(env).expanduser()
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
def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise TuningDBError(f"{where}: an entry must be an object, got {type(entry).__name__}")
    if "spec_hash" in entry and "geometry" not in entry:
        raise TuningDBError(
            f"{where}: a schema-1 entry keyed by spec hash ({entry.get('spec', '?')} {entry.get('bucket', '?')}); "
            "convert the file with `mlagen tuning migrate FILE`"
        )
    missing = [k for k in REQUIRED_FIELDS if k not in entry]
    if missing:
        raise TuningDBError(f"{where}: entry is missing {', '.join(missing)}")
    for key in ("kernel", "geometry", "bucket", "arch", "gpu", "triton"):
        if key in entry and not isinstance(entry[key], str):
            raise TuningDBError(f"{where}: {key} must be a string, got {entry[key]!r}")
    config = entry["config"]
    # (whether a launch takes it is checked where it is rendered into a module: render's _checked_tuned)
    if not (isinstance(config, list) and config and all(type(v) is int for v in config)):
        raise TuningDBError(f"{where}: config must be a list of integers, got {config!r}")
    return entry


def _read_entries(path: Path, schema: int) -> list[Any]:
    """The raw entries of a database file of the given schema; a missing file is an empty database."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise TuningDBError(f"{path}: cannot read tuning database ({error.strerror})") from None
    try:
        data = json.loads(text, object_pairs_hook=unique_json_keys)
    except json.JSONDecodeError as error:
        raise TuningDBError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    except ValueError as error:  # a key given twice
        raise TuningDBError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise TuningDBError(f"{path}: not a tuning database (expected an object with an 'entries' list)")
    if data.get("schema") != schema:
        hint = "; convert it with `mlagen tuning migrate FILE`" if data.get("schema") == 1 else ""
        raise TuningDBError(f"{path}: tuning database schema {data.get('schema')!r}, expected {schema}{hint}")
    return data["entries"]


def read_db(path: str | Path) -> list[dict[str, Any]]:
    """Entries of one database file; a missing file is an empty database."""
    path = Path(path)
    return [_check_entry(e, f"{path}: entries[{i}]") for i, e in enumerate(_read_entries(path, SCHEMA_VERSION))]


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


def _valid_configs(spec: MLASpec, plan: KernelPlan | None = None) -> dict[str, dict[str, set[tuple[int, ...]]]]:
    """kernel -> bucket -> configurations of the spec's current autotune space.

    The bucket names mirror `decode_bucket(block_m, small)` of the generated module (tests check they
    agree): "m<block_m>" and, for the latency regime, "m<block_m>-small", over the same space, and "gluon"
    for the Hopper backend's (block_n, consumer_regs, num_stages); prefill has one space for both of its
    buckets ("causal", "prefix"), and the Hopper backend one (block_n, stages) space for both of its own
    ("gluon-causal", "gluon-prefix").
    """
    plan = lower(spec) if plan is None else plan
    out: dict[str, dict[str, set[tuple[int, ...]]]] = {}
    if plan.decode is not None:
        out["decode"] = {}
        for m, cfgs in plan.decode.space:
            configs = {(c.block_n, c.num_warps, c.num_stages) for c in cfgs}
            out["decode"][f"m{m}"] = out["decode"][f"m{m}-small"] = configs
        if plan.decode.gluon.eligible:
            out["decode"][DECODE_GLUON_BUCKET] = set(plan.decode.gluon.space)
    if plan.prefill is not None:
        configs = {c.as_tuple() for c in plan.prefill.space}
        out["prefill"] = {bucket: configs for bucket in PREFILL_BUCKETS}
        if plan.prefill.gluon.eligible:
            gluon_configs = set(plan.prefill.gluon.space)
            out["prefill"].update({bucket: gluon_configs for bucket in PREFILL_GLUON_BUCKETS.values()})
    return out


def select_entries(
    spec: MLASpec, entries: Iterable[Mapping[str, Any]], *, plan: KernelPlan | None = None
) -> list[dict[str, Any]]:
    """The entries that apply to `spec`: a kernel it emits, that kernel's geometry, a configuration of its
    space; one per (kernel, arch, gpu, bucket): the installed triton version's, else the newest one's.
    plan: the spec's plan where the caller has lowered it already."""
    valid = _valid_configs(spec, plan)
    geometry = {kernel: kernel_geometry(kernel, spec) for kernel in valid}
    installed = triton_version()

    def rank(e: Mapping[str, Any]) -> tuple[bool, tuple[int, ...]]:
        return (e["triton"] == installed, _version_tuple(e["triton"]))

    best: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for entry in entries:
        kernel = entry["kernel"]
        if kernel not in valid or entry["geometry"] != geometry[kernel]:
            continue
        if tuple(entry["config"]) not in valid[kernel].get(entry["bucket"], set()):
            continue  # stale: the space changed since this entry was recorded (or the spec pins tiles)
        slot = (kernel, entry["arch"], entry["gpu"], entry["bucket"])
        if slot not in best or rank(entry) > rank(best[slot]):
            best[slot] = dict(entry)
    return [best[k] for k in sorted(best)]


def tuned_for_spec(
    spec: MLASpec, db_paths: Iterable[str | Path] | None = None, *, plan: KernelPlan | None = None
) -> dict[str, dict[str, list[int]]]:
    """What `render_module(plan, tuned)` takes: {kernel: {"<arch>|<gpu>|<bucket>": config}} for this spec,
    with a family-wide "<arch>|*|<bucket>" row for every arch and bucket that has an entry.

    db_paths: databases to consult, lowest priority first (default: `default_db_paths()`).
    plan: the spec's plan where the caller has lowered it already.
    """
    paths = default_db_paths() if db_paths is None else [Path(p) for p in db_paths]
    entries = merge_entries(*(read_db(p) for p in paths))
    tuned: dict[str, dict[str, list[int]]] = {}
    for entry in select_entries(spec, entries, plan=plan):  # sorted: "*" before device names, names in order
        table = tuned.setdefault(entry["kernel"], {})
        arch, bucket, config = entry["arch"], entry["bucket"], list(entry["config"])
        table[f"{arch}|{entry['gpu']}|{bucket}"] = config
        table.setdefault(f"{arch}|{FAMILY_WIDE}|{bucket}", config)
    return tuned


# ---- schema 1 -> 2 ----------------------------------------------------------------------------------------
def _arch_of_name(name: str, gpu_archs: Mapping[str, str], where: str) -> str:
    if name in gpu_archs:
        return gpu_archs[name]
    for prefix, arch in GPU_ARCH_BY_NAME_PREFIX:
        if name.startswith(prefix):
            return arch
    raise TuningDBError(f"{where}: unknown GPU {name!r}: give its family, e.g. --gpu-arch '{name}=sm90'")


def _pooled(group: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """One schema-2 entry from schema-1 entries that now share a key (e.g. deepseek-v2 and deepseek-v3-tp1,
    or one geometry measured through several specs): their measurements are pooled, each candidate scored
    by the geometric mean of its times over the entries that measured it (all of them), and the tuner's
    rule chooses: the fastest, unless the default is within MARGIN of it. A single entry keeps its config."""
    first = group[0]
    defaults = {tuple(e.get("default_config") or ()) for e in group}
    if len(defaults) != 1:
        raise TuningDBError(f"{where}: entries for one key disagree on the default configuration: {sorted(defaults)}")
    default = list(first.get("default_config") or [])
    if len(group) == 1:
        config, time_us, default_us = first["config"], first.get("time_us"), first.get("default_time_us")
        candidates = first.get("candidates", [])
    else:
        times: dict[tuple[int, ...], list[float]] = {}
        for entry in group:
            for cfg, t in entry.get("candidates", []):
                times.setdefault(tuple(cfg), []).append(float(t))
        scores = {
            cfg: round(math.exp(sum(map(math.log, ts)) / len(ts)), 2)
            for cfg, ts in times.items()
            if len(ts) == len(group)
        }
        if not scores:
            raise TuningDBError(f"{where}: the entries for one key share no measured candidate")
        best = min(scores, key=lambda cfg: (scores[cfg], cfg))
        default_us = scores.get(tuple(default))
        if default_us is not None and scores[best] > default_us * (1 - MARGIN):
            best = tuple(default)
        config, time_us = list(best), scores[best]
        candidates = [[list(cfg), scores[cfg]] for cfg in sorted(scores, key=lambda cfg: (scores[cfg], cfg))]
    return {
        "config": list(config),
        "time_us": time_us,
        "default_config": default,
        "default_time_us": default_us,
        "candidates": candidates,
    }


def migrate_entries(
    entries: Iterable[Mapping[str, Any]],
    resolve: Callable[[str], MLASpec],
    *,
    gpu_archs: Mapping[str, str] | None = None,
    where: str = "tuning database",
) -> list[dict[str, Any]]:
    """Schema-1 entries (keyed by spec hash and GPU name) as schema-2 entries; nothing is re-measured.

    Each old entry's key is derived from the spec it names (`resolve(name)`, which must still hash to the
    recorded spec_hash: otherwise its geometry is unknown) and the GPU family of its device name
    (`gpu_archs` {name: arch}, else GPU_ARCH_BY_NAME_PREFIX). Old entries that land on one key are pooled
    (see `_pooled`); `measured_with` lists the specs, head counts and Sq each new entry was measured with.
    """
    gpu_archs = dict(gpu_archs or {})
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for i, old in enumerate(entries):
        here = f"{where}: entries[{i}]"
        if not isinstance(old, dict) or not {"kernel", "spec", "spec_hash", "gpu", "triton", "bucket", "config"} <= set(
            old
        ):
            raise TuningDBError(
                f"{here}: not a schema-1 entry (needs kernel, spec, spec_hash, gpu, triton, bucket, config)"
            )
        try:
            spec = resolve(old["spec"])
        except ValueError as error:
            raise TuningDBError(f"{here}: spec {old['spec']!r}: {str(error).splitlines()[0]}") from None
        if spec.content_hash() != old["spec_hash"]:
            raise TuningDBError(
                f"{here}: spec {old['spec']!r} has changed since (hash {old['spec_hash'][:12]}...): geometry unknown"
            )
        new_key = {
            "kernel": old["kernel"],
            "geometry": kernel_geometry(old["kernel"], spec),
            "bucket": old["bucket"],
            "arch": _arch_of_name(old["gpu"], gpu_archs, here),
            "gpu": old["gpu"],
            "triton": old["triton"],
        }
        measured = {"spec": old["spec"], "num_heads": spec.num_heads, "seqlen_q": old.get("seqlen_q")}
        groups.setdefault(entry_key(new_key), []).append({**old, "_key": new_key, "_measured": measured})
    migrated = []
    for key, group in sorted(groups.items()):
        first = group[0]
        where_key = f"{where}: {'/'.join(key)}"
        migrated.append(
            {
                **first["_key"],
                **_pooled(group, where_key),
                "measured_with": [e["_measured"] for e in group],
                "cases": first.get("cases", []),
                "mlagen": first.get("mlagen"),
                "torch": first.get("torch"),
                "tuned_at": max(str(e.get("tuned_at", "")) for e in group),
                "migrated_from": [
                    {"spec": e["spec"], "spec_hash": e["spec_hash"], "config": e["config"]} for e in group
                ],
            }
        )
    return migrated


def migrate_db(
    path: str | Path,
    out: str | Path | None = None,
    *,
    resolve: Callable[[str], MLASpec] | None = None,
    gpu_archs: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Convert the schema-1 database at `path` into a schema-2 one at `out` (default: in place).

    resolve: spec name -> spec (default: the registry). Returns the entries written.
    """
    path = Path(path)
    entries = migrate_entries(_read_entries(path, 1), resolve or resolve_spec, gpu_archs=gpu_archs, where=str(path))
    return write_db(Path(out) if out is not None else path, entries, merge=False)
