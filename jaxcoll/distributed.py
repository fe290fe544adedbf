"""Joining a multi-process job: :func:`initialize`.

Call it first thing in a script that :mod:`jaxcoll.launch` starts (or any
multi-host launcher starts), before JAX touches a device. Under
``jaxcoll.launch`` it reads the coordinator, the number of processes and this
process's id from the environment the launcher set, selects gloo for CPU
collectives, and, where the launcher gave this rank an address (a rank in its
own network namespace), makes gloo bind to and advertise that address instead
of what the host name resolves to (127.0.0.1 inside a namespace, which the other
side cannot reach). It also makes an uncaught exception end the process at once,
after printing its traceback: a normal exit would first wait in
``jax.distributed``'s shutdown barrier for peers that are themselves waiting in a
collective for this process, so the launcher would see the failure only when a
timeout fires (``jax.distributed``'s heartbeats; measured:
docs/measurements.md#multi-process-cpu-jobs). Then every process publishes its host
(:mod:`jaxcoll._src.auto.topology`) and reads every other's, once. Otherwise it
defers to ``jax.distributed.initialize()``, whose own cluster detection covers
SLURM, Open MPI, Kubernetes and cloud TPU jobs unchanged.
"""

from __future__ import annotations

import os
import sys

from jaxcoll._src import compat
from jaxcoll._src.launch_env import (
  ENV_COORDINATOR,
  ENV_LOCAL_ADDRESS,
  ENV_NUM_PROCESSES,
  ENV_PROCESS_ID,
)

__all__ = ("initialize", "launched")

def launched() -> bool:
  """Whether this process was started by :mod:`jaxcoll.launch`.

  Returns:
    True in a rank started by ``jaxcoll.launch`` / ``jaxcoll-launch``.

  Raises:
    Nothing: it reads this process's environment.

  Example:
    >>> import jaxcoll
    >>> jaxcoll.distributed.launched()      # this test process was not
    False
  """
  return ENV_COORDINATOR in os.environ


def initialize(**kwargs) -> None:
  """``jax.distributed.initialize`` with what :mod:`jaxcoll.launch` set (else JAX's own
  cluster detection). Extra keyword arguments go to ``jax.distributed.initialize``.
  Does nothing when this process already joined a job.

  Args:
    **kwargs: passed on to ``jax.distributed.initialize`` (they override what
      ``jaxcoll.launch`` set).

  Returns:
    None; afterwards ``jax.process_count()`` is the job's.

  Raises:
    RuntimeError: what ``jax.distributed.initialize`` raises (no coordinator, a timeout).

  Example:
    >>> import jaxcoll
    >>> jaxcoll.distributed.initialize     # in each rank, before anything uses a device
    <function initialize at ...>
  """
  import jax
  if jax.distributed.is_initialized():
    return
  if not launched():
    jax.distributed.initialize(**kwargs)
    _exchange_hosts()
    return
  sys.excepthook = _exit_at_once
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  address = os.environ.get(ENV_LOCAL_ADDRESS)
  if address:
    compat.register_gloo_cpu_backend(address)
  jax.distributed.initialize(coordinator_address=os.environ[ENV_COORDINATOR],
                             num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                             process_id=int(os.environ[ENV_PROCESS_ID]), **kwargs)
  _exchange_hosts()


def _exchange_hosts() -> None:
  """Every process learns every other's host (:mod:`jaxcoll._src.auto.topology`: links between
  processes on one host are priced apart from links between hosts)."""
  import jax

  from jaxcoll._src.auto import topology
  client = compat.distributed_client()
  if client is not None and jax.process_count() > 1:
    topology.exchange_hosts(client, jax.process_index(), jax.process_count())


def _exit_at_once(kind, value, traceback) -> None:
  """Prints the traceback, then exits without the shutdown barrier (module docstring)."""
  sys.__excepthook__(kind, value, traceback)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)
