"""`vegas serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn)."""
