"""jaxcoll.tools: what benchmarks and calibration scripts build on.

Each collective's facts (:func:`spec`, :func:`primitives`), how an algorithm is labelled
(:func:`label`) and what the lax collective is priced as (:func:`native_equivalents`),
"auto"'s candidates and pick for one call (:func:`clear_caches` to time a first one), a
collective on a flat per-device buffer (:func:`flat_call`), side-by-side timing
(:func:`interleaved`), calibration's two halves (:func:`measure`, :func:`fit`), and byte
sizes as people write them (:func:`parse_size`, :func:`format_size`). ``jaxcoll-bench``
(:mod:`jaxcoll.bench`) and ``benchmarks/`` use
only these and the ``jaxcoll`` namespace.

The building blocks of an integration (what ``jaxcoll.fsdp``, ``jaxcoll.moe``,
``jaxcoll.optax`` and ``jaxcoll.use`` are written with, besides the collectives): axis
names and sizes inside shard_map (:func:`normalize_axes`, :func:`axis_size`,
:func:`axis_sizes`), varying/invariant typing (:func:`make_varying`,
:func:`check_vma_enabled`), argument checks (:func:`check_op`, :func:`check_choice`),
wire formats (:func:`wire_format`, :func:`compresses`), auto's margin over the lax
collective (:data:`NATIVE_MARGIN`) and the explanation helpers (:func:`mesh_shape`,
:func:`format_seconds`).
"""

from jaxcoll._src.algorithms import NATIVE, label
from jaxcoll._src.axes import normalize as normalize_axes
from jaxcoll._src.axes import size as axis_size
from jaxcoll._src.axes import sizes as axis_sizes
from jaxcoll._src.calibrate import Measurements, fit, measure
from jaxcoll._src.collectives import flat_call
from jaxcoll._src.config import check_choice
from jaxcoll._src.cost import clear_caches, native_equivalents
from jaxcoll._src.dispatch import (
    NATIVE_MARGIN,
    Candidate,
    auto_label,
    candidates,
    pick,
    profile_in_use,
)
from jaxcoll._src.explain import mesh_shape
from jaxcoll._src.ops import check_op
from jaxcoll._src.replicated import check_vma_enabled, make_varying
from jaxcoll._src.spec import CollectiveSpec, primitives, spec
from jaxcoll._src.timing import interleaved
from jaxcoll._src.units import format_seconds, format_size, parse_size
from jaxcoll._src.wire import compresses, wire_format

__all__ = ("NATIVE", "NATIVE_MARGIN", "Candidate", "CollectiveSpec", "Measurements",
           "auto_label", "axis_size", "axis_sizes", "candidates", "check_choice", "check_op",
           "clear_caches",
           "check_vma_enabled", "compresses", "fit", "flat_call", "format_seconds",
           "format_size", "interleaved", "label", "make_varying", "measure", "mesh_shape",
           "native_equivalents", "normalize_axes", "parse_size", "pick", "primitives",
           "profile_in_use", "spec", "wire_format")
