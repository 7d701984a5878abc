"""kvpool.serve: ``kvpool serve``, an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``kvpool.engine``.

Needs the ``serve`` extra: ``pip install 'kvpool[serve]'``.
"""
