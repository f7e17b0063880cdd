"""``pagedkv gateway``: an OpenAI-compatible HTTP front (Starlette on uvicorn, SSE streaming) that translates
to a scheduler's gRPC API.

  POST /v1/completions, POST /v1/chat/completions   (stream: SSE chunks, stream_options.include_usage, [DONE])
  POST /v1/responses, GET and DELETE /v1/responses/{id}   (OpenAI's Responses API on the chat path; stored per tenant)
  GET  /v1/models
  POST /tokenize, POST /detokenize   (vLLM's: the scheduler's Tokenize and Detokenize)
  POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter   (vLLM's: the scheduler's LoadAdapter, UnloadAdapter)
  GET  /version       the pagedkv version
  GET  /health        200 while the scheduler answers SERVING, else 503 (readiness)
  GET  /health/live   200 while the gateway's event loop runs (liveness)
  GET  /metrics       Prometheus (no tenant data, no keys)

``Authorization: Bearer <key>`` goes to the scheduler as gRPC metadata: the scheduler authenticates the tenant.
A client that disconnects has its gRPC calls cancelled (the scheduler frees their pages within one step).
Every size is bounded before work is done: the request head (``--max-header-bytes``, 431) and the time to send
it (``--header-timeout``) and the body (``--body-timeout``) in the HTTP protocol; the body (``--max-body-bytes``,
by default the scheduler's request limit) before it is parsed, its JSON nesting before ``json.loads`` recurses,
each prompt against the scheduler's limits before it is sent, streams (prompts x n) against ``--max-streams``.

The modules, in the order a request meets them:

- ``guards``: the HTTP head/body bounds (in the protocol, before the parser) and the body's size and nesting;
- ``app``: the routes and ``Gateway``, which checks and translates a request (``fields``: every OpenAI and vLLM
  field honoured, refused or ignored by design, by one table; ``openai_requests``: a ``Plan`` of GenerateRequests,
  a chat's conversation by ``chat_requests``)
  and counts the streams;
- ``tokenize``: /tokenize and /detokenize, read and answered in vLLM's shapes;
- ``adapter_routes``: vLLM's run-time LoRA endpoints (the caller's tenant owns what it loads);
- ``upstream``: the scheduler's channel, the caller's credentials as metadata;
- ``streaming``: ``Generation``, one request answered inside the ASGI call (JSON body or SSE chunks, built by
  ``openai_responses``); ``errors``: ApiError and the gRPC status mapping; ``metrics``: the gateway's series;
- ``responses_*``: the Responses API: ``responses_fields`` (its field table), ``responses_api`` (a body as a chat
  request; the chat answer as output items), ``responses_stream`` (the typed SSE events), ``responses_store`` (stored
  responses per tenant: memory and a file each under --responses-dir), ``responses_routes`` (the three routes; a
  stored turn's KV retained on the scheduler, released on DELETE);
- ``cli``: ``pagedkv gateway`` (flags, uvicorn), the ``serve --http-port`` child and ``health --http``;
- ``edge``: the edge mode (``--edge-upstream URL``): no scheduler; keys checked against ``--tenants-file``, the
  request relayed to a fleet frontend (Dynamo's) with the tenant's cache salt and signed assertion, the answer
  streamed back.

With ``--trust-gie-headers`` (and the scheduler's trusted-hop secret) GIE's ``x-gateway-inference-fairness-id`` and
``x-gateway-inference-objective`` go to the scheduler as a trusted hop's assertion (pagedkv/trusted_hop.py);
without it they are never read.
"""
