"""The installed package is the source tree: pyproject.toml lists every folder that holds an
__init__.py, under the name it installs as (passes/ and kernels/ inside autoshard). A folder left out
installs from an editable checkout but vanishes from a wheel (autoshard.train, autoshard.verify and
autoshard.passes.context once did: `autoshard train` and `autoshard verify` failed on import)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["tool"]["setuptools"]


def _packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    found = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            dotted = ".".join((name, *rel))
            if not any(dotted.startswith(other + ".") or dotted == other
                       for other in package_dir if other != name and other.startswith(name + ".")):
                found.add(dotted)
    return found


def test_pyproject_lists_every_package_folder():
    cfg = _config()
    on_disk = _packages_on_disk(cfg["package-dir"])
    listed = set(cfg["packages"])
    assert on_disk - listed == set(), f"folders with __init__.py missing from pyproject's packages: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"pyproject lists packages with no folder: {sorted(listed - on_disk)}"
