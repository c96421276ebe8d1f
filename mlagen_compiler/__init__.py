"""mlagen: a kernel-generation compiler for Multi-head Latent Attention.

Pipeline (one module per stage): spec -> plan (lower) -> render -> module file (write / import).
`load(spec_or_path_or_name)` returns a spec's generated module from the content-addressed cache (cache.py),
with the tuned configurations of the tuning databases (tuning_db.py) rendered in.
"""

from ._version import __version__
from .cache import load
from .module_file import compile_spec, import_module_from_path
from .plan import KernelPlan, lower
from .render import render_module
from .spec import MLASpec, SpecError, load_spec, spec_from_dict

__all__ = [
    "KernelPlan",
    "MLASpec",
    "SpecError",
    "__version__",
    "compile_spec",
    "import_module_from_path",
    "load",
    "load_spec",
    "lower",
    "render_module",
    "spec_from_dict",
]
