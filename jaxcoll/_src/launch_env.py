"""The environment :mod:`jaxcoll.launch` sets for each rank and :mod:`jaxcoll.distributed`
reads (apart from ``jaxcoll.launch`` so that importing ``jaxcoll`` never imports the launcher
that ``python -m jaxcoll.launch`` is about to run)."""

ENV_COORDINATOR = "JAXCOLL_COORDINATOR"
ENV_NUM_PROCESSES = "JAXCOLL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXCOLL_PROCESS_ID"
ENV_LOCAL_ADDRESS = "JAXCOLL_LOCAL_ADDRESS"   # the address gloo binds and advertises
