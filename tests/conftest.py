"""Shared test set-up: interpreter on CPU-only machines, poisoned workspaces, Hypothesis profiles.

Both come from `mlagen_compiler.testing` (the pytest plugin uses them too): `prepare_environment` selects
Triton's interpreter without a GPU, NaN-fills workspaces and validates index values; profiles (choose
with MLAGEN_HYPOTHESIS_PROFILE): `ci` is derandomized so CI is repeatable, `dev` (default) is small and
random, `fuzz` runs many examples for a long hunt. A failing example prints the seed it drew; that seed
feeds a torch.Generator, so the failure replays.
"""

from __future__ import annotations

import pytest
import torch

from mlagen_compiler import compile_spec, import_module_from_path, spec_from_dict
from mlagen_compiler.testing import load_hypothesis_profile, prepare_environment

DEVICE = prepare_environment()
load_hypothesis_profile()


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
