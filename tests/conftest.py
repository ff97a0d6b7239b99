"""Test session set-up; runs before JAX is imported.

* Eight simulated CPU devices for every test.
* A persistent XLA compilation cache for this session (also used by the subprocesses tests start):
  many tests compile the same programs (a run, then its resumption on the same mesh), and a
  cache hit takes a fraction of a compile on this 2-core machine. Fresh per session, removed at exit.
* XLA:CPU's LLVM backend at optimisation level 0 (``--xla_backend_optimization_level=0``): the tests'
  models are tiny, so a test's time is mostly compilation, and unoptimised machine code compiles in
  about half the time (the fast tier: 178 s -> 97 s). Everything the tests assert on is decided
  before that stage -- the HLO program, its collectives and their order, buffer assignment and so the
  compiled memory -- and numbers are compared to references within tolerances or between runs of the
  same program. Users' runs keep XLA's default.
* XLA:CPU's element-wise IR emitters instead of its MLIR fusion emitters in the first of the two
  sessions ``tests/run_suite.py`` (``make test``) starts, where the jaxlib has the switch
  (``subprocess_env.EMITTERS``): the same HLO program, collectives and buffer sizes, compiled faster.
  The tests marked ``fusion_emitters`` run in the second session with XLA's defaults; a plain
  ``pytest`` run keeps XLA's defaults.
* JAX's CUDA plugin allowed to load without CUDA (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``): the
  ``gpu_compile`` tests compile for compile-only GPU targets (:mod:`meshtron.gpu.targets`); the
  ``gpu_target`` fixture skips them where the plugin (the ``gpu-compile`` extra) is not installed.
"""

import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest
from subprocess_env import OPTIMISATION

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {OPTIMISATION}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

_CACHE = tempfile.mkdtemp(prefix="meshtron-test-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture
def operands():
    """An FP8 projection's operands (tests/test_fp8*.py): activations of a few units, a weight of 0.02 and
    an output gradient of 1e-3, as float32."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 32)).astype(np.float32) * 3.0
    w = (rng.standard_normal((32, 24)) * 0.02).astype(np.float32)
    cotangent = rng.standard_normal((6, 24)).astype(np.float32) * 1e-3
    return x, w, cotangent


@pytest.fixture
def gpu_target() -> str:
    """The GPU target the ``gpu_compile`` tests compile for; skips them (with the reason) where JAX's
    CUDA plugin is not installed: the first stack has no ``gpu-compile`` extra, ``make test-py312``
    installs it."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (the gpu-compile "
                        "extra; make test-py312 installs it): nothing to compile GPU programs with")
    return "h100"
