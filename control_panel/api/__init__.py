"""The OpenAI-compatible API, one module per resource; `control_panel/app.py` includes their routers.

Streaming answers are SSE (`data: {...}` chunks, then `data: [DONE]`); a final usage chunk comes
when `stream_options.include_usage` is set. /v1/responses streams the Responses API's typed events
(`event: response.output_text.delta`, …) and ends with `response.completed` (or `.incomplete`,
`.failed`). Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` (`errors.py`): 400 for parameters Tandem cannot
honour (or a body that is not JSON), 401 for a missing or wrong API key, 404 for an unknown model,
413 for a body over the panel's limit, 415 for a body not sent as JSON, 429 with Retry-After when
the API key is over its limits (`control_panel/rate_limits.py`) or the nodes' budgets stay busy
past their deadline, 503 when no route is up (its message names the request's id, under which the
request log keeps what the nodes said: their addresses and errors are never told to a client).
"""
