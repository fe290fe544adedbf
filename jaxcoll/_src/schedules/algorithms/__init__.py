"""Schedules of every algorithm family; the registry is :mod:`.registry`.

Importing the package registers every family (order = order of ``algorithms()``).
"""

from jaxcoll._src.schedules.algorithms import bruck as _bruck  # noqa: F401
from jaxcoll._src.schedules.algorithms import chain as _chain  # noqa: F401
from jaxcoll._src.schedules.algorithms import direct as _direct  # noqa: F401
from jaxcoll._src.schedules.algorithms import halving_doubling as _hd  # noqa: F401
from jaxcoll._src.schedules.algorithms import hierarchical as _hier  # noqa: F401
from jaxcoll._src.schedules.algorithms import recursive_doubling as _rd  # noqa: F401
from jaxcoll._src.schedules.algorithms import ring as _ring  # noqa: F401
from jaxcoll._src.schedules.algorithms import trees as _trees  # noqa: F401
from jaxcoll._src.schedules.algorithms.registry import (  # noqa: F401
    NATIVE,
    SCHEDULE,
    Algorithm,
    algorithms,
    call_options,
    check_algorithm,
    entries,
    entry,
    label,
    register,
    schedule,
)
