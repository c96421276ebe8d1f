"""Shared test set-up: interpreter on CPU-only machines, poisoned workspaces, Hypothesis profiles.

Profiles (choose with MLAGEN_HYPOTHESIS_PROFILE): `ci` is derandomized so CI is repeatable, `dev`
(default) is small and random, `fuzz` runs many examples for a long hunt. A failing example prints the
seed it drew; that seed feeds a torch.Generator, so the failure replays.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["MLAGEN_POISON_WORKSPACE"] = "1"
# every index value checked against what it indexes, on the GPU too (on the CPU it is the default)
os.environ["MLAGEN_VALIDATE"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from mlagen_compiler import compile_spec, import_module_from_path, spec_from_dict  # noqa: E402

_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("ci", max_examples=50, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=12, **_common)
settings.register_profile("fuzz", max_examples=2000, **_common)
settings.load_profile(os.environ.get("MLAGEN_HYPOTHESIS_PROFILE", "dev"))

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def pytest_report_header(config):
    """Which Triton and which kernel paths this run exercises (the paths differ between machines)."""
    import triton

    from mlagen_compiler.triton_support import TRITON_REQUIREMENT, triton_supported

    where = (
        f"on {torch.cuda.get_device_name()} (compiled kernels)"
        if torch.cuda.is_available()
        else "in Triton's CPU interpreter (TRITON_INTERPRET=1)"
    )
    inside = "inside" if triton_supported(triton.__version__) else "OUTSIDE"
    return [
        f"mlagen: triton {triton.__version__} ({inside} the supported range {TRITON_REQUIREMENT}), kernels run {where}",
        "mlagen: decode backend: portable Triton; cache / key / value tiles through TMA descriptors and through "
        "pointer loads (both drawn by the property tests)",
    ]


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE


@pytest.fixture(scope="session")
def build_module(tmp_path_factory):
    """Compile and import a generated module for a spec dict; one build per distinct spec."""
    out_dir = tmp_path_factory.mktemp("generated")
    built = {}

    def build(**fields):
        spec = spec_from_dict(fields)
        key = spec.canonical_json()
        if key not in built:
            built[key] = import_module_from_path(compile_spec(spec, out_dir / spec.content_hash()[:12]))
        return built[key]

    return build
