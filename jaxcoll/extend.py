"""jaxcoll.extend: the building blocks integrations are written with.

What ``jaxcoll.use``, ``jaxcoll.fsdp``, ``jaxcoll.moe``, ``jaxcoll.optax`` and the gradient
sync use besides the collectives, and what a user writing an integration of their own
needs: axis names, sizes and indices inside shard_map (:func:`normalize_axes`,
:func:`axis_size`, :func:`axis_sizes`, :func:`axis_index`; :func:`as_axes` reads a jaxpr
parameter's or a PartitionSpec entry's axes), varying/invariant typing
(:func:`make_varying`, :func:`varying_axes`, :func:`check_vma_enabled`; which values of a
jaxpr differ between devices: :func:`varying`), argument checks
(:func:`check_op`, :func:`check_choice`, :func:`check_algorithm`, :func:`check_axis_names`,
:func:`check_accumulate`, :func:`check_int`, :func:`check_number`, :func:`check_flag`,
:func:`check_floating`, :func:`check_rounding`, :func:`check_one_of`: each error names the
argument), rounding a
reduction's result (:func:`round_to`, stochastically with a key; :func:`low_precision`:
which dtypes it rounds), wire formats (:func:`wire_format`,
which reads a ``wire_dtype=`` argument once into a :class:`jaxcoll.WireFormat` that the
collectives then take as it is; :func:`compresses`), what one call would run
(:func:`algorithm_of`), auto's margin over the lax collective (:data:`NATIVE_MARGIN`), the
names of the lax collective and of auto among the schedules (:data:`NATIVE`,
:data:`SCHEDULE`), meshes and their axes outside shard_map (:func:`mesh_shape`,
:func:`axes_in_mesh`), sizes and times in words (:func:`format_size`,
:func:`format_seconds`) and a step's report as it is traced (:class:`ReportLine`,
:func:`recording`, :func:`record_paused`, :func:`record_at`, :func:`record_note`,
:func:`record_in_use`, :func:`record_repeated`, :func:`record_where`), and what a compiled
step's transfers run beside (:func:`overlap`, :class:`Overlap`).
"""

from jaxcoll._src.auto.cost import native_equivalents
from jaxcoll._src.auto.dispatch import NATIVE_MARGIN, check_choice, replaces
from jaxcoll._src.auto.dispatch import offered as offered_algorithm
from jaxcoll._src.axes import index as axis_index
from jaxcoll._src.axes import normalize as normalize_axes
from jaxcoll._src.axes import size as axis_size
from jaxcoll._src.axes import sizes as axis_sizes
from jaxcoll._src.checks import accumulate as check_accumulate
from jaxcoll._src.checks import as_axes, axes_in_mesh, mesh_shape
from jaxcoll._src.checks import axis_tuple as check_axis_names
from jaxcoll._src.checks import choice as check_one_of
from jaxcoll._src.checks import flag as check_flag
from jaxcoll._src.checks import floating as check_floating
from jaxcoll._src.checks import integer as check_int
from jaxcoll._src.checks import number as check_number
from jaxcoll._src.collectives import algorithm_of
from jaxcoll._src.config import config_field, remove_config_field, setting
from jaxcoll._src.invariant import check_vma_enabled, make_varying, varying_axes
from jaxcoll._src.ops import check_op
from jaxcoll._src.overlap import Overlap, overlap
from jaxcoll._src.per_device_rules import register_rule as register_spmd_rule
from jaxcoll._src.per_device_rules import unregister_rule as unregister_spmd_rule
from jaxcoll._src.record import Line as ReportLine
from jaxcoll._src.record import at as record_at
from jaxcoll._src.record import in_use as record_in_use
from jaxcoll._src.record import note as record_note
from jaxcoll._src.record import paused as record_paused
from jaxcoll._src.record import recording
from jaxcoll._src.record import repeated as record_repeated
from jaxcoll._src.record import where as record_where
from jaxcoll._src.schedules.algorithms import NATIVE, SCHEDULE, check_algorithm
from jaxcoll._src.units import format_seconds, format_size
from jaxcoll._src.varying_axes import varying
from jaxcoll._src.wire.formats import Element as WireElement
from jaxcoll._src.wire.formats import (
  compresses,
  register_wire_format,
  unregister_wire_format,
  wire_format,
)
from jaxcoll._src.wire.rounding import check as check_rounding
from jaxcoll._src.wire.rounding import low_precision, round_to

__all__ = (
    "NATIVE",
    "NATIVE_MARGIN",
    "Overlap",
    "SCHEDULE",
    "ReportLine",
    "WireElement",
    "algorithm_of",
    "as_axes",
    "axes_in_mesh",
    "axis_index",
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
    "check_one_of",
    "check_op",
    "check_rounding",
    "check_vma_enabled",
    "config_field",
    "compresses",
    "format_seconds",
    "format_size",
    "low_precision",
    "make_varying",
    "mesh_shape",
    "native_equivalents",
    "normalize_axes",
    "offered_algorithm",
    "overlap",
    "record_at",
    "record_in_use",
    "record_note",
    "record_paused",
    "record_repeated",
    "record_where",
    "recording",
    "register_spmd_rule",
    "register_wire_format",
    "remove_config_field",
    "replaces",
    "round_to",
    "setting",
    "unregister_spmd_rule",
    "unregister_wire_format",
    "varying",
    "varying_axes",
    "wire_format",
)
