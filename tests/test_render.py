import ast
import sys
from pathlib import Path

import pytest
from helpers import SMALL_SPEC

from mlagen_compiler import __version__, render
from mlagen_compiler.module_file import module_source
from mlagen_compiler.registry import registered_specs, resolve_spec
from mlagen_compiler.render import templates_digest
from mlagen_compiler.spec import spec_from_dict
from mlagen_compiler.tuning_db import shipped_db_paths, tuned_for_spec

ROOT = Path(__file__).resolve().parent.parent
SPEC = {**SMALL_SPEC, "name": "render-me", "num_heads": 40, "q_lora_rank": 768}


def test_deterministic_and_header():
    spec = spec_from_dict(SPEC)
    first, second = module_source(spec), module_source(spec_from_dict(dict(reversed(list(SPEC.items())))))
    assert first == second
    header = first.splitlines()[0]
    assert "render-me" in header and spec.content_hash() in header and __version__ in header
    assert first.splitlines()[1] == f"# Templates and generator sha256 {templates_digest()}."
    assert first.splitlines()[2] == "# Tuned configurations: none (the plan's untuned defaults)."
    tuned = {"decode": {"sm90|*|m16": [32, 4, 3], "sm90|NVIDIA H100 80GB HBM3|m16": [32, 4, 3]}}
    assert module_source(spec, tuned).splitlines()[2] == (
        "# Tuned configurations: decode 2 (tuning database entries measured on NVIDIA H100 80GB HBM3)."
    )
    assert module_source(spec_from_dict({**SPEC, "page_size": 32})) != first


def test_a_change_to_the_plan_or_a_template_changes_the_digest(tmp_path, monkeypatch):
    """The plan's constants decide generated code as much as the templates do: a cached module built before a
    plan change must not be served after it (one mlagen version, an editable install)."""
    names = {path.name for path in render.generator_sources()}
    runtime = {"launch_policy.py", "runtime.py", "options.py", "cache_format.py"}
    assert {"plan.py", "spec.py", "render.py", "decode_gluon.py.jinja", *runtime} <= names
    copies = []
    for path in render.generator_sources():
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(render, "generator_sources", lambda: copies)
    base = templates_digest()
    plan_copy = next(copy for copy in copies if copy.name == "plan.py")
    plan_copy.write_text(plan_copy.read_text() + "\nMERGE_FANIN = 4\n")
    assert templates_digest() != base


def _imports(tree):
    """(top-level packages, mlagen_compiler modules) a module's source imports."""
    packages, mlagen = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            packages |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            packages.add(module.split(".")[0] if node.level == 0 else "mlagen_compiler")
            if node.level or module.startswith("mlagen_compiler"):
                submodule = module.removeprefix("mlagen_compiler").lstrip(".")
                # (`from mlagen_compiler import runtime`: the names imported are the submodules)
                mlagen |= {submodule} if submodule else {alias.name for alias in node.names}
    return packages, mlagen


def test_generated_imports_only_torch_triton_stdlib_and_mlagen_runtime():
    """A generated module needs torch, triton and mlagen's runtime (runtime.py, launch_policy.py, options.py,
    cache_format.py), which need only torch, triton, the standard library and each other: not the compiler
    (pydantic, jinja2, ...)."""
    packages, mlagen = _imports(ast.parse(module_source(spec_from_dict(SPEC))))
    assert packages - {"torch", "triton", "mlagen_compiler"} <= set(sys.stdlib_module_names), packages
    assert mlagen == {"runtime", "launch_policy", "options", "cache_format"}
    for name in mlagen:
        packages, imported = _imports(ast.parse((ROOT / "mlagen_compiler" / f"{name}.py").read_text()))
        assert packages - {"torch", "triton", "mlagen_compiler"} <= set(sys.stdlib_module_names), (name, packages)
        assert imported <= {"runtime", "launch_policy", "options", "cache_format"}, (name, imported)


def test_spec_dict_round_trips():
    namespace: dict = {}
    source = module_source(spec_from_dict(SPEC))
    start = source.index("\nSPEC = ")
    spec_line = source[start : source.index("\nSPEC_HASH = ", start)]
    exec(spec_line, namespace)  # a plain literal: no imports needed
    assert spec_from_dict(namespace["SPEC"]) == spec_from_dict(SPEC)
    assert {k: namespace["SPEC"][k] for k in SPEC} == SPEC


@pytest.mark.parametrize("name", sorted(registered_specs()))
def test_generated_dir_matches_fresh_compile(name):
    spec = resolve_spec(name)
    committed = ROOT / "generated" / f"{spec.module_name}.py"
    assert committed.exists(), f"generated/{spec.module_name}.py missing: run `mlagen compile --all`"
    shipped = tuned_for_spec(spec, shipped_db_paths())  # what `mlagen compile --tuning shipped` renders in
    assert committed.read_text() == module_source(spec, shipped), (
        f"generated/{committed.name} is stale: run `mlagen compile --all --tuning shipped`"
    )


def test_no_stray_generated_modules():
    expected = {resolve_spec(n).module_name for n in registered_specs()}
    present = {p.stem for p in (ROOT / "generated").glob("*.py") if p.stem != "__init__"}
    assert present == expected


def test_every_kernel_kind_is_complete_and_emitted_as_the_table_says(tmp_path):
    """Each entry of the kind table names a template, a verify function and entry points that exist, and a
    module holds exactly the kinds its spec asks for plus those emitted for every spec."""
    from mlagen_compiler import verify
    from mlagen_compiler.module_file import import_module_from_path
    from mlagen_compiler.plan import KERNEL_KINDS, emitted_kinds, lower
    from mlagen_compiler.registry import resolve_kernel
    from mlagen_compiler.render import template_dir

    for kind in KERNEL_KINDS:
        assert (template_dir() / kind.template).is_file() and callable(getattr(verify, kind.verify))
    for kernels in (["decode"], ["prefill"], ["decode", "prefill"]):
        spec = spec_from_dict({**SPEC, "kernels": kernels})
        names = [k.name for k in emitted_kinds(spec)]
        assert names == [k.name for k in KERNEL_KINDS if k.name in kernels or not k.on_request]
        assert list(lower(spec).kernels) == names
        path = tmp_path / f"{'_'.join(kernels)}.py"
        path.write_text(module_source(spec))
        module = import_module_from_path(path, f"kinds_{'_'.join(kernels)}")
        for kind in KERNEL_KINDS:
            present = [hasattr(module, entry) for entry in kind.entry_points]
            assert present == [kind.name in names] * len(present), (kernels, kind.name)
    assert resolve_kernel("deepseek-v3-tp8/cache_write")[1] == "cache_write"


def test_launch_tables_render_filled_and_read_back():
    """A launch table renders filled (items run on up to 88 columns: with its name in front, within 120) and reads
    back as the same value as the one-item-a-line literal."""
    from mlagen_compiler.plan import lower

    for name in sorted(registered_specs()):
        plan = lower(resolve_spec(name))
        for kind_plan in plan.kernels.values():
            for table, value in kind_plan.template_tables({}).items():
                text = render._table_literal(value)
                assert ast.literal_eval(text) == ast.literal_eval(render._literal(value)), (name, table)
                assert max(len(line) for line in text.splitlines()) <= 88, (name, table, text)
