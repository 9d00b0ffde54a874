"""Shared pytest configuration: fp64 on, the ``slow`` and ``gpu`` markers, a per-test seeded generator.

Compile time: these tests are dominated by XLA compilations of small programs (each
variant x form x option is a new program).  On CPU, LLVM's backend optimization is most of
that time and buys nothing for arrays of a few hundred elements, so the suite runs XLA's CPU
backend at optimization level 0 (about 2.5x faster compiles; numerics are unaffected: the
same HLO, no fast-math either way).  Set FALCON_TESTS_XLA_OPT=1 to keep XLA's defaults, and
an explicit ``--xla_backend_optimization_level`` in XLA_FLAGS always wins.
"""
import os
import zlib

if os.environ.get("FALCON_TESTS_XLA_OPT") != "1" and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: checks the kernels' real GPU lowering (skipped without a GPU; "
                            "run with -m gpu on a GPU machine)")


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id (reproducible, distinct per test)."""
    key = f"{request.node.module.__name__}::{request.node.name}"  # independent of the invocation dir
    return np.random.default_rng(zlib.crc32(key.encode()))
