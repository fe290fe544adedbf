"""A primitive of a user's own, and the per-device rule that lets ``jaxcoll.use`` run it in
a global program: ``double(x) = 2 x``, elementwise.

The primitive is written with JAX's public extension API (``jax.extend.core.Primitive``, a
lowering through ``mlir.lower_fun``); its rule is one declaration, that it runs per device
as an elementwise primitive does (``jaxcoll.extend.register_spmd_rule("double", "sin")``).
"""

from __future__ import annotations

import jax
import jax.extend
from jax.interpreters import mlir

double_p = jax.extend.core.Primitive("double")
double_p.def_impl(lambda x: 2 * x)
double_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(double_p, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))


def double(x):
  return double_p.bind(x)


RULE = ("double", "sin")   # the declaration: runs per device as an elementwise primitive
