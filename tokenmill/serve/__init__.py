"""The OpenAI-compatible HTTP server: `tokenmill serve`."""
