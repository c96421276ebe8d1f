"""The Triton releases mlagen supports: one home for the range, the version check and its message.

Generated modules carry the same bounds (rendered in) and warn once at import when the installed Triton
is outside them; `mlagen env` and `mlagen compile` say so too.
"""

from __future__ import annotations

import re

__all__ = [
    "TRITON_BELOW",
    "TRITON_MIN",
    "TRITON_REQUIREMENT",
    "TRITON_TESTED",
    "release",
    "triton_supported",
    "triton_version",
    "unsupported_message",
]

#: the dependency pyproject.toml declares (a test checks that they agree)
TRITON_REQUIREMENT = ">=3.6,<3.10"
#: (major, minor) bounds of TRITON_REQUIREMENT: the lowest supported release and the first one that is not
TRITON_MIN = (3, 6)
TRITON_BELOW = (3, 10)
#: the releases CI runs the whole test suite on, each in its own environment (requirements/triton-*.txt):
#: the GPU machine's and the newest
TRITON_TESTED = ("3.6.0", "3.9.0")


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '3.6.0' or '3.9.0+git1a2b3c'; None if it has none."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def triton_version() -> str | None:
    """The installed Triton's version (from package metadata, so triton is not imported); None if absent."""
    from importlib import metadata

    for dist in ("triton", "pytorch-triton"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:  # a source build may lack metadata
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def triton_supported(version: str | None) -> bool:
    parsed = release(version) if version else None
    return parsed is not None and TRITON_MIN <= parsed < TRITON_BELOW


def unsupported_message(version: str | None) -> str | None:
    """The one-line warning for a Triton outside the supported range, or None when it is inside."""
    if triton_supported(version):
        return None
    found = f"triton {version}" if version else "no triton installation"
    return (
        f"mlagen supports triton{TRITON_REQUIREMENT} (tested: {', '.join(TRITON_TESTED)}) but found {found}; "
        f"generated kernels may fail to compile or run: pip install 'triton{TRITON_REQUIREMENT}'"
    )
