"""The OpenAI-compatible HTTP front: a starlette/uvicorn shell around pure request/response mapping."""
