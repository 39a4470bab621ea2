"""OpenAI-compatible HTTP server for expertcache (`expertcache serve`)."""
