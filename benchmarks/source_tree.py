"""Which source tree a benchmark measures, and how a Python process imports it.

A tree is a checkout (or an extracted ``git archive``) of this repository at some commit.  Two layouts exist:

* the kernels under ``falcon_jax.kernels`` (``pallas_kernels/`` and ``train/`` installed inside the package by
  setuptools' ``package-dir``): a process imports such a tree from a copy of that installed layout, built here
  in a scratch folder (``falcon_jax/``, then ``pallas_kernels/`` as ``falcon_jax/kernels/`` and ``train/`` as
  ``falcon_jax/train/``), so no install is needed;
* the older API, whose ``falcon(impl="pallas")`` imports the kernels as a top-level ``pallas_kernels``: it runs
  from its root.

    python -m benchmarks.source_tree ROOT DEST     # prints the PYTHONPATH entry that imports ROOT's falcon_jax
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys

PACKAGE_FOLDERS = ("falcon_jax", "pallas_kernels", "train")


def uses_impl_pallas(root: str) -> bool:
    """Whether the tree's ``falcon`` takes ``impl="pallas"`` (the older API: kernels imported as top-level
    ``pallas_kernels``), read from its ``falcon_jax/validation.py`` without importing it."""
    path = os.path.join(root, "falcon_jax", "validation.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{root} holds no falcon_jax/validation.py: not a falcon-jax source tree")
    impls = re.search(r"^IMPLS\s*=\s*\(([^)]*)\)", open(path).read(), re.M)
    return bool(impls) and re.search(r"['\"]pallas['\"]", impls.group(1)) is not None


def import_path(root: str, scratch: str) -> str:
    """The ``PYTHONPATH`` entry under which ``import falcon_jax`` imports the tree at ``root``: ``root`` itself
    (the older API, or a tree already in the installed layout), else a copy of the installed layout built in
    ``scratch`` (created; reused if it is there)."""
    root = os.path.abspath(root)
    package = os.path.join(root, "falcon_jax")
    if (uses_impl_pallas(root) or os.path.isdir(os.path.join(package, "kernels"))
            or not os.path.isdir(os.path.join(root, "pallas_kernels"))):
        return root
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    if os.path.exists(scratch):
        shutil.rmtree(scratch)
    shutil.copytree(package, os.path.join(scratch, "falcon_jax"), ignore=ignore)
    shutil.copytree(os.path.join(root, "pallas_kernels"), os.path.join(scratch, "falcon_jax", "kernels"), ignore=ignore)
    if os.path.isdir(os.path.join(root, "train")):
        shutil.copytree(os.path.join(root, "train"), os.path.join(scratch, "falcon_jax", "train"), ignore=ignore)
    return scratch


def git_commit(root: str) -> str | None:
    """The commit checked out at ``root`` (with ``+dirty`` when the package folders differ from it), or None
    where ``root`` is no git checkout (an extracted archive, a copy on another machine)."""
    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        if head.returncode != 0:
            return None
        top = git("rev-parse", "--show-toplevel").stdout.strip()
        if os.path.realpath(top) != os.path.realpath(root):
            return None  # root sits inside another repository, not a checkout of this one
        folders = [f for f in PACKAGE_FOLDERS if os.path.isdir(os.path.join(root, f))]
        dirty = git("status", "--porcelain", "--", *folders).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def fingerprint(root: str) -> str:
    """SHA-1 (12 hex digits) of the tree's Python sources in the package folders, names and contents: equal
    for equal code whatever the checkout, so a result can be matched to its tree without git."""
    digest = hashlib.sha1()
    for folder in PACKAGE_FOLDERS:
        for base, dirs, files in sorted(os.walk(os.path.join(root, folder))):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(base, name)
                digest.update(os.path.relpath(path, root).encode())
                digest.update(open(path, "rb").read())
    return digest.hexdigest()[:12]


def describe(root: str) -> dict:
    """What a result records about the tree it measured."""
    root = os.path.abspath(root)
    return {"path": root, "commit": git_commit(root), "source_sha1": fingerprint(root),
            "api": "impl='pallas' (kernels as top-level pallas_kernels)" if uses_impl_pallas(root)
            else "impl='auto' (falcon_jax.kernels)"}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    print(import_path(sys.argv[1], os.path.abspath(sys.argv[2])))
