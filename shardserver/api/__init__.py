"""The HTTP API of a front-end: one module per concern, handlers as module-level functions.

* :mod:`.app`: :func:`~shardserver.api.app.create_app` assembles the FastAPI app (lifespan,
  middleware, exception handlers, routers in match order).
* :mod:`.state`: :class:`~shardserver.api.state.FrontendContext`, the per-process state that
  handlers reach through ``request.app.state`` (never through closures).
* :mod:`.common`: reading a JSON body under ``server.max_request_bytes``, error answers.
* :mod:`.sessions`: ``client/config``, ``client/dynamic_config``, ``create_session``,
  ``session_heartbeat``, ``sessions/{id}/finish``, ``telemetry``,
  ``create_sampling_session``, ``samplers/{id}``.
* :mod:`.sampling`: ``asample`` and ``retrieve_future``.
* :mod:`.ops`: ``/healthz``, ``/readyz``, ``/metrics``, ``/stats`` and the catch-all that
  answers 501 for the Tinker training endpoints.

The process that serves the app is :class:`shardserver.workers.frontend.FrontendProc`.
"""
