"""Sphinx configuration: MyST pages and an API reference from the docstrings (as optax,
flax and chex build theirs). Built in CI with warnings as errors:

  pip install -e '.[docs]' && sphinx-build -W -b html docs docs/_build/html
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

project = "jaxcoll"
author = "jaxcoll developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True   # "Attributes:" as fields: dataclass fields are documented once
html_theme = "alabaster"
# links from the guide to the repository's scripts and modules (examples/, benchmarks/,
# jaxcoll/) point outside the site
suppress_warnings = ["myst.xref_missing"]
