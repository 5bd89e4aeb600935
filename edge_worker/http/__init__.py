"""The edge's face to HTTP clients: the OpenAI-compatible API (its pure core, response objects, the ASGI server),
its guards, and the streamed text of a generation."""
