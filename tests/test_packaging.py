"""The wheel's import names: everything installs under ``falcon_jax`` (pyproject.toml lists the packages)."""
from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setuptools():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_and_nothing_else():
    cfg = _setuptools()
    found = set()
    for name, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert sorted(found) == sorted(cfg["packages"])


def test_only_falcon_jax_is_a_top_level_import_name():
    cfg = _setuptools()
    assert {p.split(".")[0] for p in cfg["packages"]} == {"falcon_jax"}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert all(target.startswith("falcon_jax.") for target in scripts.values())
