"""OpenAI's Responses API: its routes, its schemas, and the store of past responses."""
