"""Make this tree's mlagen visible to importlib.metadata from a site folder, as `pip install -e .` would: writes
DIR/mlagen-VERSION.dist-info with the entry points pyproject.toml declares (the pytest plugin, vLLM's general
plugin, the console scripts). For machines with no build backend or network (the GPU machine); the folder must be
on sys.path (PYTHONPATH) and this tree importable beside it.

    python3 scripts/editable_metadata.py DIR
"""

import pathlib
import re
import sys

import tomllib

if len(sys.argv) != 2:
    sys.exit("usage: python3 scripts/editable_metadata.py DIR  (DIR: a site folder on PYTHONPATH)")
root = pathlib.Path(__file__).resolve().parent.parent
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
version = re.search(r'__version__\s*=\s*"([^"]+)"', (root / "mlagen_compiler" / "_version.py").read_text())[1]
dist = pathlib.Path(sys.argv[1]) / f"mlagen-{version}.dist-info"
dist.mkdir(parents=True, exist_ok=True)
(dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mlagen\nVersion: {version}\n")
groups = dict(project.get("entry-points", {}))
if "scripts" in project:
    groups["console_scripts"] = project["scripts"]
text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
(dist / "entry_points.txt").write_text(text)
print(f"mlagen {version} from {root}; entry points: {sorted(groups)}")
