"""OpenAI's API: chat completions, completions, models, embeddings, ``/generate``
(``routes``), and the Responses API (``responses/``). The chat path here (``prepare``,
``answer``) is also the one the other dialects take, as a chat request."""
