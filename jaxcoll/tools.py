"""jaxcoll.tools: what benchmarks, calibration scripts and ``jaxcoll-bench`` build on.

Each collective's facts (:func:`spec`, :func:`primitives`), how an algorithm is labelled
(:func:`label`) and what the lax collective is priced as (:func:`native_equivalents`);
what one call runs and why, the one decision "auto" makes (:func:`decide` of a
:class:`Call` under a :class:`Pricing`: its :class:`Decision`; :func:`profile_in_use`;
:func:`clear_caches` to time a first one); a collective on a flat per-device buffer
(:func:`flat_call`) and the algorithm one call would run (:func:`algorithm_of`);
side-by-side timing (:func:`interleaved`); calibration's two halves (:func:`measure`,
:func:`fit`); meshes and their axes (:func:`mesh_shape`, :func:`axes_in_mesh`); byte sizes
and times as people write them (:func:`parse_size`, :func:`format_size`,
:func:`format_seconds`); a compiled program's flops per device (:func:`flops_of`) and what
each of its transfers runs beside (:func:`overlap`); and
:func:`unregister`, the undo of :func:`jaxcoll.register`.
``jaxcoll-bench`` (:mod:`jaxcoll.bench`) and ``benchmarks/`` use only these and the
``jaxcoll`` namespace. What integrations are built with is :mod:`jaxcoll.extend`.
"""

from jaxcoll._src.auto.cost import native_equivalents
from jaxcoll._src.auto.dispatch import (
    NATIVE_MARGIN,
    Call,
    Candidate,
    Decision,
    Pricing,
    clear_caches,
    decide,
    profile_in_use,
)
from jaxcoll._src.calibrate import Measurements, fit, measure
from jaxcoll._src.checks import axes_in_mesh, mesh_shape
from jaxcoll._src.collectives import algorithm_of, flat_call
from jaxcoll._src.overlap import H100_PEAK_FLOPS, Overlap, Transfer, overlap
from jaxcoll._src.register import unregister
from jaxcoll._src.schedules.algorithms import NATIVE, SCHEDULE, label
from jaxcoll._src.spec import CollectiveSpec, primitives, spec
from jaxcoll._src.timing import interleaved
from jaxcoll._src.units import format_seconds, format_size, parse_size
from jaxcoll._src.use.step_report import flops_of

__all__ = (
    "H100_PEAK_FLOPS",
    "Overlap",
    "Transfer",
    "overlap",
    "NATIVE",
    "NATIVE_MARGIN",
    "SCHEDULE",
    "Call",
    "Candidate",
    "CollectiveSpec",
    "Decision",
    "Measurements",
    "Pricing",
    "algorithm_of",
    "axes_in_mesh",
    "clear_caches",
    "decide",
    "fit",
    "flat_call",
    "format_seconds",
    "flops_of",
    "format_size",
    "interleaved",
    "label",
    "measure",
    "mesh_shape",
    "native_equivalents",
    "parse_size",
    "primitives",
    "profile_in_use",
    "spec",
    "unregister",
)
