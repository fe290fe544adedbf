"""Eight CPU devices for every test; set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
hypothesis.settings.load_profile("ci")
