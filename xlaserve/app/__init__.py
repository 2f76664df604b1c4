"""A worker process, put together: the one room above both the worker's actors
(:mod:`xlaserve.worker`) and the frontend (:mod:`xlaserve.frontend`).

- :mod:`~xlaserve.app.preflight`: before JAX is imported, check the model repository and bind
  the addresses (and load the TLS files).
- :mod:`~xlaserve.app.compose`: the composition root: start the actors and fill the frontend's
  port from them.
- :mod:`~xlaserve.app.server`: the process: the boot order in one place, signals and drain.

Neither the worker nor the frontend imports anything of this package.
"""
