"""The OpenAI-compatible HTTP server (FastAPI): `build_app(engine, config)` and `serve(engine_args, ...)`."""
