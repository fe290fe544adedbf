"""jaxcoll.tools: what benchmarks and calibration scripts build on.

Each collective's facts (:func:`spec`, :func:`primitives`), how an algorithm is labelled
(:func:`label`) and what the lax collective is priced as (:func:`native_equivalents`),
what one call runs and why, the one decision "auto" makes (:func:`decide` of a
:class:`Call` under a :class:`Pricing`: its :class:`Decision`; :func:`clear_caches` to time
a first one), a
collective on a flat per-device buffer (:func:`flat_call`), the algorithm one call would
run (:func:`algorithm_of`), side-by-side timing
(:func:`interleaved`), calibration's two halves (:func:`measure`, :func:`fit`), and byte
sizes as people write them (:func:`parse_size`, :func:`format_size`). ``jaxcoll-bench``
(:mod:`jaxcoll.bench`) and ``benchmarks/`` use
only these and the ``jaxcoll`` namespace.

The building blocks of an integration (what ``jaxcoll.fsdp``, ``jaxcoll.moe``,
``jaxcoll.optax`` and ``jaxcoll.use`` are written with, besides the collectives): axis
names and sizes inside shard_map (:func:`normalize_axes`, :func:`axis_size`,
:func:`axis_sizes`), varying/invariant typing (:func:`make_varying`,
:func:`check_vma_enabled`; which values of a jaxpr differ between devices: :func:`varying`),
argument checks (:func:`check_op`, :func:`check_choice`, :func:`check_algorithm`,
:func:`check_axis_names`, :func:`check_accumulate`, :func:`check_int`, :func:`check_number`,
:func:`check_flag`, :func:`check_floating`: each error names the argument),
wire formats (:func:`wire_format`, :func:`compresses`), auto's margin over the lax
collective (:data:`NATIVE_MARGIN`), the names of the lax collective and of auto among the
schedules (:data:`NATIVE`, :data:`SCHEDULE`), meshes and their axes outside shard_map
(:func:`mesh_shape`, :func:`axes_in_mesh`), the explanation helper
(:func:`format_seconds`) and a step's report as it is traced (:class:`ReportLine`,
:func:`recording`, :func:`record_paused`, :func:`record_at`, :func:`record_note`,
:func:`record_in_use`).
"""

from jaxcoll._src.algorithms import NATIVE, SCHEDULE, label
from jaxcoll._src.axes import normalize as normalize_axes
from jaxcoll._src.axes import size as axis_size
from jaxcoll._src.axes import sizes as axis_sizes
from jaxcoll._src.calibrate import Measurements, fit, measure
from jaxcoll._src.checks import accumulate as check_accumulate
from jaxcoll._src.checks import algorithm as check_algorithm
from jaxcoll._src.checks import axes_in_mesh, mesh_shape
from jaxcoll._src.checks import axis_tuple as check_axis_names
from jaxcoll._src.checks import flag as check_flag
from jaxcoll._src.checks import floating as check_floating
from jaxcoll._src.checks import integer as check_int
from jaxcoll._src.checks import number as check_number
from jaxcoll._src.collectives import algorithm_of, flat_call
from jaxcoll._src.config import check_choice
from jaxcoll._src.cost import clear_caches, native_equivalents
from jaxcoll._src.dispatch import (
    NATIVE_MARGIN,
    Call,
    Candidate,
    Decision,
    Pricing,
    decide,
    profile_in_use,
)
from jaxcoll._src.extend import unregister
from jaxcoll._src.ops import check_op
from jaxcoll._src.record import Line as ReportLine
from jaxcoll._src.record import at as record_at
from jaxcoll._src.record import in_use as record_in_use
from jaxcoll._src.record import note as record_note
from jaxcoll._src.record import paused as record_paused
from jaxcoll._src.record import recording
from jaxcoll._src.replicas import varying
from jaxcoll._src.replicated import check_vma_enabled, make_varying
from jaxcoll._src.spec import CollectiveSpec, primitives, spec
from jaxcoll._src.timing import interleaved
from jaxcoll._src.units import format_seconds, format_size, parse_size
from jaxcoll._src.wire import compresses, wire_format

__all__ = (
    "NATIVE",
    "NATIVE_MARGIN",
    "SCHEDULE",
    "Candidate",
    "CollectiveSpec",
    "Measurements",
    "Call",
    "Decision",
    "Pricing",
    "ReportLine",
    "algorithm_of",
    "axes_in_mesh",
    "axis_size",
    "axis_sizes",
    "check_accumulate",
    "check_algorithm",
    "check_axis_names",
    "check_choice",
    "check_flag",
    "check_floating",
    "check_int",
    "check_number",
    "check_op",
    "check_vma_enabled",
    "clear_caches",
    "compresses",
    "decide",
    "fit",
    "flat_call",
    "format_seconds",
    "format_size",
    "interleaved",
    "label",
    "make_varying",
    "measure",
    "mesh_shape",
    "native_equivalents",
    "normalize_axes",
    "parse_size",
    "primitives",
    "profile_in_use",
    "record_at",
    "record_in_use",
    "record_note",
    "record_paused",
    "recording",
    "spec",
    "unregister",
    "varying",
    "wire_format",
)
