"""Packaging only: which folders install under which import names (the metadata is in
pyproject.toml). The repository keeps its top-level folders; the installed tree puts every one
of them under `dataflow`, so a trainer's own `models` or `kernels` package never meets ours."""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
SUBPACKAGES = ("memplan", "kernels", "ring", "models", "bench")


def _packages(folder: str, name: str) -> list[str]:
    """`name` and every package below `folder`, dotted under `name`."""
    found = []
    for init in sorted((ROOT / folder).rglob("__init__.py")):
        rel = init.parent.relative_to(ROOT / folder).parts
        if "records" in rel or "archive" in rel:  # past runs' data and one-off scripts
            continue
        found.append(".".join((name, *rel)))
    return found


packages = _packages("dataflow", "dataflow")
package_dir = {"dataflow": "dataflow"}
for sub in SUBPACKAGES:
    packages += _packages(sub, f"dataflow.{sub}")
    package_dir[f"dataflow.{sub}"] = sub

setup(packages=packages, package_dir=package_dir)
