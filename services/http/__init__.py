"""The OpenAI-compatible HTTP API (the `http` application)."""
