"""The OpenAI-compatible HTTP server over `inference.Engine` (`python -m inference.serve`, `__main__.py`).

`server` (the `Server` and its FastAPI app), `api` (request and response formats, limits, errors), `loop`
(one thread driving one engine), `text` (detokenizing with stop strings), `metrics` (Prometheus text) and
`load` (what is served: a run's weights, a Hugging Face directory or random weights; the `--mesh`).
Importers name the submodule.
"""
