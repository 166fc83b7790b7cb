"""``nnx-es serve RUNS_ROOT``: a local, read-only web app over a runs root -- the runs, their curves, events,
time travel, audit, diff and data map -- and the JSON API behind each page (the ``web`` extra:
Starlette and uvicorn). See docs/guides/web.md.

Modules: :mod:`~nnx_es.web.reading` (the runs root, confined and read quietly), :mod:`~nnx_es.web.api`
(what each page shows, built on the readers of ``tools/inspect`` and ``tools/replay``), :mod:`~nnx_es.web.studies`
(the studies of ``nnx-es search``, built on :mod:`nnx_es.search`),
:mod:`~nnx_es.web.app` (the Starlette app), :mod:`~nnx_es.web.serve` (the command).
"""

__all__ = ["create_app", "serve"]


def __getattr__(name: str):  # noqa: ANN202 - Starlette is imported only when the app is asked for
    if name == "create_app":
        from nnx_es.web.app import create_app

        return create_app
    if name == "serve":
        from nnx_es.web.serve import serve

        return serve
    raise AttributeError(name)
