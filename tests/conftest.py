"""Eight CPU devices for every test; set before JAX is imported. One persistent compilation
cache for the run, shared by the xdist workers and removed at the end, so that a program
compiled again (``jaxcoll.explain_step`` after the step it explains, the same program in two
tests) is read back instead of compiled twice; an entry is keyed by the program, the jax
version and the flags, so a hit is the very executable a compile would give."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402
import jax  # noqa: E402

hypothesis.settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
hypothesis.settings.load_profile("ci")

_CACHE = "JAXCOLL_TEST_COMPILATION_CACHE"


def pytest_configure(config):
  if not hasattr(config, "workerinput") and _CACHE not in os.environ:   # the run's first process
    os.environ[_CACHE] = tempfile.mkdtemp(prefix="jaxcoll-test-compiles-")
    config._jaxcoll_cache = os.environ[_CACHE]   # the workers it starts inherit the variable
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_unconfigure(config):
  if getattr(config, "_jaxcoll_cache", None):
    shutil.rmtree(config._jaxcoll_cache, ignore_errors=True)
    del os.environ[_CACHE]
