"""Test session set-up; runs before JAX is imported.

* Eight simulated CPU devices for every test.
* A persistent XLA compilation cache for this session (also used by the subprocesses tests start):
  many tests compile the same programs (a run, then its resumption on the same mesh), and a
  cache hit takes a fraction of a compile on this 2-core machine. Fresh per session, removed at exit.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CACHE = tempfile.mkdtemp(prefix="meshtron-test-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
