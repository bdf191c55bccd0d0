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
* :mod:`.futures`: ``retrieve_futures`` (the SDK's session-wide poller) and ``cancel_future``.
* :mod:`.ops`: ``/healthz``, ``/readyz``, ``/metrics``, ``/stats`` and the catch-all that
  answers 501 for the Tinker training endpoints.

* :mod:`.models`: the SDK's request bodies as pydantic models.
* :mod:`.auth`: API keys (:class:`~shardserver.api.auth.AuthMiddleware`) and the owner an ID is
  bound to.
* :mod:`.access_log`: one line per request when ``server.access_log`` is on.

The process that serves the app is :class:`shardserver.workers.frontend.FrontendProc`. This
package's ``__init__`` imports nothing, so importing a leaf module (the supervisor loads the
API keys with :func:`shardserver.api.auth.load_key_table`) does not load FastAPI.
"""
