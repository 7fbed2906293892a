"""An OpenAI-compatible HTTP server for a workdir: the thin layer over `jaxformer.engine` (and `jaxformer.batcher`).

    python -m jaxformer.serve --workdir W [--host 127.0.0.1] [--port 8000] [--max-batch 8] [--kv-blocks N]
        [--block-size 16] [--max-seq-len L] [--prefill-chunk 256] [--max-waiting 256] [--drain-s 30]
        [--api-key K | $JAXFORMER_API_KEY] [--model-name NAME]

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events when
`stream` is true), GET /v1/models, GET /health, GET /metrics (Prometheus), and vLLM's tokenizer endpoints
POST /tokenize, POST /detokenize, GET /tokenizer_info (lm-eval's `local-completions` model tokenizes
through them: `tokenizer_backend=remote`). Completions with `echo` and `logprobs` score the prompt's
tokens too (OpenAI's and vLLM's legacy API: `null` for the first), and `max_tokens: 0` with `echo` only
scores, as lm-eval's log-likelihood requests do. Text is decoded incrementally in context
(`jaxformer.detokenize`): a stream's pieces add up to the whole text, an echo is the decode of prompt
and completion together. The chat endpoint renders
`messages` with the run's chat template exactly as `python -m jaxformer.generate --chat` does
(`chat.prompt_ids`) and stops at the end of the assistant's turn (`chat.end_of_turn_ids`).
A translation (encoder-decoder) workdir serves POST /v1/translate instead: `{"text": "..." | [...]}` ->
`{"translations": [...]}`, requests beam-searched together (up to --max-batch sentences per call) with
the run's decode settings, as `eval.py` translates.

Bad input is a 400 with OpenAI's error object naming the field; a full queue a 429 with Retry-After;
a body above --max-body-bytes a 413; a missing or wrong key (with --api-key) a 401. SIGTERM stops
accepting connections, lets the running requests finish for up to --drain-s seconds, then exits 0.
"""

import argparse
import asyncio
import functools
import json
import os
import secrets
import signal
import socket
import sys
import time

from jaxformer import chat
from jaxformer import batcher as batcher_lib
from jaxformer import detokenize
from jaxformer import engine as engine_lib
from jaxformer import evaluate
from jaxformer import generate
from jaxformer import runtime
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError, cli

MAX_N = 16
MAX_STOPS = 4


class BadRequest(Exception):
  """A 400: `message` is one sentence naming the field (`param`) and its limit."""

  def __init__(self, message, param=None, status=400, kind="invalid_request_error", code=None, headers=None):
    super().__init__(message)
    self.message, self.param, self.status, self.kind, self.code, self.headers = message, param, status, kind, code, headers


def error_body(message, kind="invalid_request_error", param=None, code=None):
  """OpenAI's error object."""
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ----------------------------------------------------------------------------- request fields


def _field(body, name, kinds, default, check=None, limit=""):
  """body[name] of one of `kinds` (bool is never an int), within `check`, else a BadRequest naming it."""
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
    names = " or ".join(k.__name__ for k in kinds).replace("str", "string").replace("int", "integer").replace(
        "float", "number").replace("bool", "boolean").replace("list", "array")
    raise BadRequest(f"'{name}' must be a {names}, got {json.dumps(value)[:40]}", name)
  if check is not None and not check(value):
    raise BadRequest(f"'{name}' must be {limit}, got {value}", name)
  return value


def sampling_fields(body, chat_api, max_seq_len):
  """The sampling fields common to both endpoints, checked -> dict (max_tokens 0: the caller checks echo)."""
  number = (int, float)
  out = {
      "max_tokens": _field(body, "max_completion_tokens" if chat_api and "max_completion_tokens" in body
                           else "max_tokens", (int,), None, lambda v: 0 <= v <= max_seq_len,
                           f"between 1 and the context of {max_seq_len} tokens"),
      "temperature": float(_field(body, "temperature", number, 1.0, lambda v: 0 <= v <= 2, "between 0 and 2")),
      "top_p": float(_field(body, "top_p", number, 1.0, lambda v: 0 < v <= 1, "in (0, 1]")),
      "top_k": _field(body, "top_k", (int,), 0, lambda v: v >= -1, "-1 or 0 (off) or a positive integer"),
      "n": _field(body, "n", (int,), 1, lambda v: 1 <= v <= MAX_N, f"between 1 and {MAX_N}"),
      "seed": _field(body, "seed", (int,), None, lambda v: -2 ** 31 <= v < 2 ** 31, "a 32-bit integer"),
      "stream": _field(body, "stream", (bool,), False),
  }
  stop = _field(body, "stop", (str, list), [])
  stop = [stop] if isinstance(stop, str) else stop
  if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
    raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
  out["stop"] = stop
  options = _field(body, "stream_options", (dict,), {})
  out["include_usage"] = bool(options.get("include_usage", False))
  if out["top_k"] == -1:
    out["top_k"] = 0
  return out


# ----------------------------------------------------------------------------- the server state


class Server:
  """The engine thread, the tokenizer, the chat template and the metrics of one served run."""

  def __init__(self, engine, tokenizer, cfg, workdir, model_name, api_key=None, max_body_bytes=1 << 20,
               translator=None):
    """engine: the LM engine (None for a translation run, whose `translator` is a batcher.TranslationBatcher)."""
    import prometheus_client as prom  # pylint: disable=g-import-not-at-top
    self.engine, self.tokenizer, self.cfg, self.workdir = engine, tokenizer, cfg, workdir
    self.translator = translator
    self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
    self.created = int(time.time())
    self.compilations_at_start = engine_lib.compilations()
    self._template = None
    self.accepting = True
    r = self.registry = prom.CollectorRegistry()
    self.m_requests = prom.Counter("jaxformer_requests", "Requests by outcome", ["outcome"], registry=r)
    self.m_prompt = prom.Counter("jaxformer_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
    self.m_generated = prom.Counter("jaxformer_generation_tokens", "Generated tokens", registry=r)
    buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
    self.m_ttft = prom.Histogram("jaxformer_time_to_first_token_seconds", "Time to first token", buckets=buckets,
                                 registry=r)
    self.m_tpot = prom.Histogram("jaxformer_time_per_output_token_seconds", "Time per output token after the first",
                                 buckets=buckets, registry=r)
    self.m_running = prom.Gauge("jaxformer_requests_running", "Requests in a decode slot", registry=r)
    self.m_waiting = prom.Gauge("jaxformer_requests_waiting", "Requests waiting for a slot", registry=r)
    self.m_used = prom.Gauge("jaxformer_kv_blocks_used", "KV blocks read by a request", registry=r)
    self.m_free = prom.Gauge("jaxformer_kv_blocks_free", "KV blocks free or evictable", registry=r)
    self.m_hit = prom.Gauge("jaxformer_prefix_cache_hit_rate", "Prompt tokens read from the prefix cache / all",
                            registry=r)
    self.m_preempted = prom.Counter("jaxformer_preemptions", "Running requests preempted (KV pool short)",
                                    registry=r)
    self._preemptions_seen = 0
    self.m_compiles = prom.Gauge("jaxformer_xla_compilations_since_start",
                                 "XLA programs compiled after the ready line", registry=r)
    prom.ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds (Linux)

  @property
  def hf(self):
    """Whether the run's tokenizer is a tokenizer.json (whose special tokens are matched in text)."""
    return isinstance(self.tokenizer, tokenizer_lib.HFTokenizer)

  def tokenizer_info(self):
    """GET /tokenizer_info's body, as vLLM's: the tokenizer's class, special-token strings, context and chat
    template (where the run has one)."""
    t, text = self.tokenizer, functools.partial(tokenizer_lib.special_text, self.tokenizer)
    info = {"tokenizer_class": type(t).__name__, "bos_token": text(t.bos_id), "eos_token": text(t.eos_id),
            "pad_token": text(t.pad_id),
            "model_max_length": self.engine.max_seq_len if self.engine else self.cfg.model.max_len}
    if self.cfg.data.chat_template:
      try:
        info["chat_template"] = self.template()[0].text
      except UserError:  # a template that does not load is reported by the chat endpoint
        pass
    return info

  def template(self):
    """(ChatTemplate, hf) of the run, loaded at the first chat request (a run without one can still serve completions)."""
    if self._template is None:
      self._template = generate.chat_template(self.cfg, self.workdir, self.tokenizer)
    return self._template

  def metrics_text(self):
    """(Prometheus text of every metric, its content type), the gauges read from the engine now."""
    import prometheus_client as prom  # pylint: disable=g-import-not-at-top
    e = self.engine
    if e is None:  # a translation run: sentences being translated and requests waiting
      self.m_running.set(self.translator.busy)
      self.m_waiting.set(len(self.translator.waiting))
    else:
      self.m_running.set(e.running())
      self.m_waiting.set(len(e.waiting))
      self.m_used.set(e.pool.used())
      self.m_free.set(e.pool.available())
      self.m_hit.set(e.stats["cached_tokens"] / max(e.stats["prompt_tokens"], 1))
      preempted = e.stats["preemptions"]   # read once: the engine's thread may add to it meanwhile
      self.m_preempted.inc(preempted - self._preemptions_seen)
      self._preemptions_seen = preempted
    self.m_compiles.set(engine_lib.compilations() - self.compilations_at_start)
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST

  def check_model(self, body):
    """A BadRequest when the body names a model other than the one served (absent: the served one)."""
    model = body.get("model", self.model_name)
    if model != self.model_name:
      raise BadRequest(f"'model' {json.dumps(model)[:60]} is not served here: use {self.model_name!r} "
                       "(GET /v1/models)", "model", code="model_not_found")

  def submit(self, prompt, sampling, stop_ids, logprobs, seed, prompt_logprobs=False):
    """One engine request -> (request, asyncio.Queue of snapshots (output, logprobs, finish_reason));
    prompt_logprobs: the prompt's tokens are scored too (echo)."""
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()

    def on_event(r):  # the engine's thread: hand a snapshot to the event loop
      loop.call_soon_threadsafe(queue.put_nowait, (list(r.output), list(r.logprobs), r.finish_reason))

    params = engine_lib.SamplingParams(max_tokens=sampling["max_tokens"], temperature=sampling["temperature"],
                                       top_p=sampling["top_p"], top_k=sampling["top_k"], seed=seed,
                                       stop_ids=tuple(stop_ids), logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    try:
      request = self.engine.submit(prompt, params, on_event)
    except UserError as e:
      raise BadRequest(str(e), "messages" if sampling.get("chat") else "prompt") from None
    except engine_lib.QueueFull as e:
      self.m_requests.labels("rejected_queue_full").inc()
      raise BadRequest(f"the server is busy: {e}; retry later", None, status=429, kind="server_busy",
                       headers={"Retry-After": "1"}) from None
    self.m_prompt.inc(len(prompt))
    return request, queue


class Completion:
  """One choice in flight: turns the engine's tokens into text (decoded in the prompt's context), applies stop
  strings, tracks timing."""

  def __init__(self, server, request, queue, stops, stop_ids):
    self.server, self.request, self.queue = server, request, queue
    self.stops, self.stop_ids = stops, set(stop_ids)
    self.tokens, self.logprobs, self.text, self.sent = [], [], "", 0
    self.decoder = detokenize.IncrementalDecoder(server.tokenizer, request.prompt)
    self._prompt_pieces = None
    self.finish_reason = None
    self.start = time.perf_counter()
    self.first = None

  def _visible(self, tokens, finished):
    """The text of the generated tokens in context, the final stop id left out (held-back text: at the end)."""
    if tokens and tokens[-1] in self.stop_ids:
      tokens = tokens[:-1]
    self.decoder.extend(tokens[len(self.decoder.pieces):])
    if finished:
      self.decoder.flush()
    return self.decoder.text

  async def next(self):
    """Waits for the next engine event -> the new text that is safe to send ('' when none), or None at the end."""
    if self.finish_reason is not None:
      return None
    tokens, logprobs, finish = await self.queue.get()
    now = time.perf_counter()
    if self.first is None and tokens:
      self.first = now
      self.server.m_ttft.observe(now - self.start)
    self.tokens, self.logprobs = tokens, logprobs
    text = self._visible(tokens, finish is not None)
    hit = min((text.find(s) for s in self.stops if s in text), default=-1)
    if hit >= 0:                                   # a stop string: never emitted, the request ends now
      text, finish = text[:hit], "stop"
      self.server.engine.cancel(self.request, "stop")
      self.decoder.flush()
    if finish is not None:
      self.finish_reason = "stop" if finish == "stop" else "length"
      self._record()
      self.text = text
      out, self.sent = text[self.sent:], len(text)
      return out
    # Hold back a possible stop-string prefix and an unfinished multi-byte character.
    hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    safe = len(text) - hold
    if text.endswith("\ufffd"):
      safe = min(safe, len(text) - 1)
    self.text = text
    out = text[self.sent:max(safe, self.sent)]
    self.sent += len(out)
    return out

  def _record(self):
    n = len(self.tokens)
    self.server.m_generated.inc(n)
    if self.first is not None and n > 1:
      self.server.m_tpot.observe((time.perf_counter() - self.first) / (n - 1))

  async def drain(self):
    """Waits for the end (non-streamed responses)."""
    while await self.next() is not None:
      pass

  def cancel(self):
    """Ends the engine request now (the client went away)."""
    if self.finish_reason is None:
      self.server.engine.cancel(self.request)
      self.finish_reason = "cancelled"
      self.server.m_requests.labels("cancelled").inc()

  def token_logprobs(self, k):
    """Per shown token: (its text in context, logprob, [(text, logprob) of the top k])."""
    out = []
    for t, piece, (lp, top) in zip(self.tokens, self.decoder.pieces, self.logprobs):
      if t in self.stop_ids:
        break
      out.append((piece, lp, _alternatives(self.server.tokenizer, t, piece, top, k)))
    return out

  def prompt_logprobs(self, k):
    """Per prompt token (echo): (its text in context, logprob or None for the first, top k or None)."""
    prompt = self.request.prompt
    if self._prompt_pieces is None:    # decoded once (the echoed text and the logprob rows both read it)
      decoder = detokenize.IncrementalDecoder(self.server.tokenizer)
      decoder.extend(prompt)
      if not self.decoder.pieces:      # nothing follows: the prompt's held-back text is its own
        decoder.flush()
      self._prompt_pieces = decoder.pieces
    out = []
    for i, (t, piece) in enumerate(zip(prompt, self._prompt_pieces)):
      scored = self.request.prompt_logprobs[i] if self.request.prompt_logprobs else None
      if scored is None:
        out.append((piece, None, None))
      else:
        out.append((piece, scored[0], _alternatives(self.server.tokenizer, t, piece, scored[1], k)))
    return out


def _alternatives(tokenizer, token, piece, top, k):
  """[(text, logprob)] of a token's top k alternatives: each decoded alone (as vLLM does), the token itself
  as its text in context (so it keys the same entry as the `tokens` list)."""
  return [(piece if i == token else tokenizer.decode([i]), v) for i, v in top[:k]]


# ----------------------------------------------------------------------------- the app


def make_app(server, drain_s=30.0):
  """The FastAPI app over `server` (a Server whose engine thread runs)."""
  from fastapi import FastAPI, Request  # pylint: disable=g-import-not-at-top
  from fastapi.responses import JSONResponse, Response  # pylint: disable=g-import-not-at-top
  from sse_starlette import EventSourceResponse  # pylint: disable=g-import-not-at-top
  import anyio  # pylint: disable=g-import-not-at-top
  import anyio.to_thread  # pylint: disable=g-import-not-at-top

  app = FastAPI(title="jaxformer", docs_url=None, redoc_url=None)

  def fail(e):
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=e.headers)

  def check_key(request):
    if server.api_key is None:
      return
    auth = request.headers.get("authorization", "")
    if not secrets.compare_digest(auth.encode(), f"Bearer {server.api_key}".encode()):
      raise BadRequest("missing or wrong API key: send the header 'Authorization: Bearer KEY'", None, status=401,
                       kind="authentication_error", code="invalid_api_key")

  async def read_body(request, translation):
    """The request's JSON object, after the key, size, model and endpoint checks (translation: /v1/translate)."""
    check_key(request)
    if translation and server.translator is None:
      raise BadRequest(f"{server.model_name} is a decoder-only model: use /v1/completions or /v1/chat/completions",
                       None, status=404, code="unsupported_endpoint")
    if not translation and server.engine is None:
      raise BadRequest(f"{server.model_name} is a translation model: POST /v1/translate with {{\"text\": [...]}}",
                       None, status=404, code="unsupported_endpoint")
    size = request.headers.get("content-length")
    if size and size.isdigit() and int(size) > server.max_body_bytes:
      raise BadRequest(f"the request body is {size} bytes, above the limit of {server.max_body_bytes} bytes",
                       None, status=413)
    raw = b""
    async for chunk in request.stream():
      raw += chunk
      if len(raw) > server.max_body_bytes:
        raise BadRequest(f"the request body is above the limit of {server.max_body_bytes} bytes", None, status=413)
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise BadRequest(f"the request body is not valid JSON ({e})", None) from None
    if not isinstance(body, dict):
      raise BadRequest("the request body must be a JSON object", None)
    server.check_model(body)
    return body

  async def run(request, chat_api):
    if not server.accepting:
      return fail(BadRequest("the server is shutting down", None, status=503, kind="server_shutting_down"))
    try:
      body = await read_body(request, translation=False)
      max_seq_len = server.engine.max_seq_len
      sampling = sampling_fields(body, chat_api, max_seq_len)
      if chat_api:
        messages = _field(body, "messages", (list,), None)
        if not messages:
          raise BadRequest("'messages' must be a non-empty array of {role, content} objects", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages):
          raise BadRequest("'messages' must hold objects with a string 'role' and a string 'content'", "messages")
        try:
          template, hf = server.template()
        except UserError as e:   # a run without a chat template serves completions only
          raise BadRequest(f"this model has no chat template ({e}): use /v1/completions", "messages") from None
        try:
          prompts = [chat.prompt_ids(template, server.tokenizer, messages, server.cfg.data.add_bos, hf,
                                     where="messages")]
        except UserError as e:
          raise BadRequest(str(e), "messages") from None
        stop_ids = chat.end_of_turn_ids(template, server.tokenizer, hf)
        want_logprobs = _field(body, "logprobs", (bool,), False)
        k = _field(body, "top_logprobs", (int,), 0, lambda v: 0 <= v <= engine_lib.TOP_LOGPROBS,
                   f"between 0 and {engine_lib.TOP_LOGPROBS}")
        if k and not want_logprobs:
          raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = max(k, 1) if want_logprobs else 0
        echo = False
      else:
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, int) and
                                                                                   not isinstance(p, bool)
                                                                                   for p in prompt)):
          prompt = [prompt]
        if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)) for p in prompt):
          raise BadRequest("'prompt' must be a string, an array of strings, or token ids", "prompt")
        prompts = [generate.encode_prompt(server.tokenizer, server.cfg, p) if isinstance(p, str) else list(p)
                   for p in prompt]
        if any(not 0 <= t < server.engine.model.cfg.vocab_size for p in prompts for t in p):
          raise BadRequest(f"'prompt' token ids must be in [0, {server.engine.model.cfg.vocab_size})", "prompt")
        stop_ids = [server.tokenizer.eos_id] if server.tokenizer.eos_id is not None else []
        if _field(body, "ignore_eos", (bool,), False):   # vLLM's extension, for load tests: always max_tokens
          stop_ids = []
        k = _field(body, "logprobs", (int,), None, lambda v: 0 <= v <= 5, "between 0 and 5")
        want_logprobs = k is not None
        logprobs = max(k, 1) if want_logprobs else 0   # the engine's alternatives per token
        echo = _field(body, "echo", (bool,), False)
        if echo and sampling["stream"]:
          raise BadRequest("'echo' is not supported with 'stream'", "echo")
      if sampling["max_tokens"] == 0 and (chat_api or not echo):
        raise BadRequest(f"'max_tokens' must be between 1 and the context of {max_seq_len} tokens (0 only with "
                         "'echo', to score the prompt)", "max_tokens")
      if sampling["max_tokens"] is None:   # as vLLM: up to the context, here capped by decode.max_new_tokens
        sampling["max_tokens"] = max(1, min(server.cfg.decode.max_new_tokens,
                                            max_seq_len - max(len(p) for p in prompts)))
      seed = sampling["seed"] if sampling["seed"] is not None else secrets.randbelow(2 ** 31)
      sampling["chat"] = chat_api
      choices = []
      try:
        for p in prompts:
          for i in range(sampling["n"]):
            engine_request, queue = server.submit(p, sampling, stop_ids, logprobs, seed + i,
                                                  prompt_logprobs=echo and (want_logprobs or not sampling["max_tokens"]))
            choices.append(Completion(server, engine_request, queue, sampling["stop"], stop_ids))
      except BadRequest:
        for c in choices:
          c.cancel()
        raise
    except BadRequest as e:
      if e.status == 400:
        server.m_requests.labels("rejected_invalid").inc()
      return fail(e)

    rid = ("chatcmpl-" if chat_api else "cmpl-") + secrets.token_hex(12)
    created = int(time.time())
    prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, whatever n (OpenAI)

    def usage():
      completion = sum(len([t for t in c.tokens if t not in c.stop_ids]) for c in choices)
      return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
              "total_tokens": prompt_tokens + completion}

    def chat_logprobs(c):
      return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                           "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in top]}
                          for t, lp, top in c.token_logprobs(k)]}

    def completion_logprobs(c):
      rows = (c.prompt_logprobs(k) if echo else []) + c.token_logprobs(k)
      offsets, at = [], 0
      for t, _, _ in rows:
        offsets.append(at)
        at += len(t)
      return {"tokens": [t for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
              "top_logprobs": [None if top is None else dict(top) for _, _, top in rows], "text_offset": offsets}

    def echoed(c):
      """The prompt's text as decoded before the completion's (the decode of both together)."""
      return "".join(t for t, _, _ in c.prompt_logprobs(0))

    if not sampling["stream"]:
      waits = [asyncio.ensure_future(c.drain()) for c in choices]
      while not all(w.done() for w in waits):
        await asyncio.wait(waits, timeout=0.25)
        if not all(w.done() for w in waits) and await request.is_disconnected():  # the client went away: free the slots
          for c in choices:
            c.cancel()
          for w in waits:
            w.cancel()
          return Response(status_code=499)
      server.m_requests.labels("success").inc()
      out = []
      for index, c in enumerate(choices):
        if chat_api:
          out.append({"index": index, "message": {"role": "assistant", "content": c.text},
                      "logprobs": chat_logprobs(c) if logprobs else None, "finish_reason": c.finish_reason})
        else:
          out.append({"index": index, "text": (echoed(c) if echo else "") + c.text,
                      "logprobs": completion_logprobs(c) if want_logprobs else None,
                      "finish_reason": c.finish_reason})
      return JSONResponse({"id": rid, "object": "chat.completion" if chat_api else "text_completion",
                           "created": created, "model": server.model_name, "choices": out, "usage": usage()})

    obj = "chat.completion.chunk" if chat_api else "text_completion"

    def chunk(index, text, finish=None, first=False):
      if chat_api:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if finish is None else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
      else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
      return {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": server.model_name,
                                  "choices": [choice]})}

    async def events():
      done = False
      try:
        if chat_api:
          for index in range(len(choices)):
            yield chunk(index, "", first=True)
        pending = {asyncio.ensure_future(c.next()): i for i, c in enumerate(choices)}
        while pending:
          finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
          for f in finished:
            i = pending.pop(f)
            text = f.result()
            if text is None:
              continue
            if text:
              yield chunk(i, text)
            if choices[i].finish_reason is not None:
              yield chunk(i, "", choices[i].finish_reason)
            else:
              pending[asyncio.ensure_future(choices[i].next())] = i
        if sampling["include_usage"]:
          yield {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": server.model_name,
                                     "choices": [], "usage": usage()})}
        yield {"data": "[DONE]"}
        done = True
        server.m_requests.labels("success").inc()
      finally:
        if not done:  # the client disconnected mid-stream: free the slots
          for c in choices:
            c.cancel()

    # On SIGTERM the stream runs on for up to drain_s (sse-starlette would cut it at once by default).
    return EventSourceResponse(events(), ping=15, shutdown_event=anyio.Event(), shutdown_grace_period=drain_s)

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await run(request, chat_api=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await run(request, chat_api=True)

  @app.post("/v1/translate")
  async def translate(request: Request):
    if not server.accepting:
      return fail(BadRequest("the server is shutting down", None, status=503, kind="server_shutting_down"))
    try:
      body = await read_body(request, translation=True)
      texts = body.get("text")
      texts = [texts] if isinstance(texts, str) else texts
      if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequest("'text' must be a string or a list of strings", "text")
      try:
        server.translator.check(texts)
      except UserError as e:
        raise BadRequest(str(e), "text") from None
      except OverflowError as e:
        raise BadRequest(f"the queue is full ({e}): retry later", None, status=429, kind="rate_limit_exceeded",
                         headers={"Retry-After": "1"}) from None
    except BadRequest as e:
      server.m_requests.labels("rejected").inc()
      return fail(e)
    job = server.translator.submit(texts)
    await anyio.to_thread.run_sync(job.done.wait)
    if job.error is not None:
      server.m_requests.labels("error").inc()
      return fail(BadRequest(f"translation failed: {job.error}", None, status=500, kind="server_error"))
    server.m_requests.labels("success").inc()
    tokens = sum(len(server.tokenizer.encode(t)) + 1 for t in texts)
    server.m_prompt.inc(tokens)
    return {"object": "translation", "model": server.model_name, "translations": job.translations,
            "usage": {"source_tokens": tokens}}

  # vLLM's tokenizer endpoints, at the root as vLLM serves them (lm-eval's RemoteTokenizer reads them there).
  @app.post("/tokenize")
  async def tokenize(request: Request):
    try:
      body = await read_body(request, translation=False)
      text = body.get("prompt")
      if not isinstance(text, str):
        raise BadRequest("'prompt' must be a string", "prompt")
      special = _field(body, "add_special_tokens", (bool,), True)
    except BadRequest as e:
      return fail(e)
    ids = (generate.encode_prompt(server.tokenizer, server.cfg, text) if special
           else chat.encode_pieces(server.tokenizer, [(text, False)], server.hf)[0].tolist())
    return {"count": len(ids), "max_model_len": server.engine.max_seq_len, "tokens": ids, "token_strs": None}

  @app.post("/detokenize")
  async def detokenize_ids(request: Request):
    try:
      body = await read_body(request, translation=False)
      ids = body.get("tokens")
      vocab = server.engine.model.cfg.vocab_size
      if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                              for t in ids):
        raise BadRequest(f"'tokens' must be an array of token ids in [0, {vocab})", "tokens")
    except BadRequest as e:
      return fail(e)
    return {"prompt": server.tokenizer.decode(ids)}

  @app.get("/tokenizer_info")
  async def tokenizer_info(request: Request):
    try:
      check_key(request)
    except BadRequest as e:
      return fail(e)
    return server.tokenizer_info()

  @app.get("/v1/models")
  async def models(request: Request):
    try:
      check_key(request)
    except BadRequest as e:
      return fail(e)
    return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                        "owned_by": "jaxformer", "max_model_len": (
                                            server.engine.max_seq_len if server.engine else server.cfg.model.max_len)}]}

  @app.get("/health")
  async def health():
    work = server.engine or server.translator
    running = server.engine.running() if server.engine else server.translator.busy
    return {"status": "ok" if server.accepting else "draining", "running": running, "waiting": len(work.waiting)}

  @app.get("/metrics")
  async def metrics():
    text, content_type = server.metrics_text()
    return Response(text, media_type=content_type)

  return app


# ----------------------------------------------------------------------------- command


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Serve a decoder-only jaxformer workdir over an OpenAI-compatible API.")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
  parser.add_argument("--port", type=int, default=8000, help="0: any free port (the ready line names it)")
  parser.add_argument("--model-name", default=None, help="the model id clients send (default: the workdir's name)")
  parser.add_argument("--max-batch", type=int, default=8, help="decode slots: requests run together")
  parser.add_argument("--kv-blocks", type=int, default=None, help="KV pool size in blocks (default: max-batch x "
                      "max-seq-len / block-size, every slot at full length)")
  parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
  parser.add_argument("--max-seq-len", type=int, default=None, help="prompt + generated tokens per request "
                      "(default: model.max_len)")
  parser.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per engine step")
  parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429s")
  parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
  parser.add_argument("--drain-s", type=float, default=30.0, help="on SIGTERM, seconds running requests may take")
  parser.add_argument("--api-key", default=os.environ.get("JAXFORMER_API_KEY"),
                      help="require 'Authorization: Bearer KEY' (default: $JAXFORMER_API_KEY, else none)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--tensor", type=int, default=1, help="devices that split heads / the FFN (and the KV pool)")
  parser.add_argument("--fsdp", type=int, default=1, help="devices that split the weights' embed axis")
  return parser.parse_args(argv)


def _mesh(args):
  """The serving mesh of --fsdp x --tensor local devices (the training rule table's axes); None for one device."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxformer import config as config_lib, sharding  # pylint: disable=g-import-not-at-top
  n = args.fsdp * args.tensor
  if n == 1:
    return None
  if min(args.fsdp, args.tensor) < 1 or n > jax.local_device_count():
    raise UserError(f"--fsdp {args.fsdp} x --tensor {args.tensor} needs {n} devices; "
                    f"{jax.local_device_count()} are here")
  return sharding.make_mesh(config_lib.MeshConfig(data=1, fsdp=args.fsdp, tensor=args.tensor),
                            jax.local_devices()[:n])


def build(args, log=print):
  """(Server, engine) for parsed args: loads the run, builds the engine and compiles its programs."""
  runtime.keep_freed_memory()
  runtime.use_compilation_cache()
  cfg, model, params, tokenizer, _ = evaluate.load_run(args.workdir, step=args.step, log=lambda *_: None)
  name = args.model_name or os.path.basename(os.path.abspath(args.workdir))
  if cfg.model.arch != "decoder_only":
    if args.tensor * args.fsdp > 1:
      raise UserError("--tensor/--fsdp shard a decoder-only model's serving engine; a translation run is served on one device")
    translator = batcher_lib.TranslationBatcher(cfg, model, params, tokenizer, args.max_batch, args.max_waiting)
    seconds = translator.warm_up()
    return Server(None, tokenizer, cfg, args.workdir, name, args.api_key, args.max_body_bytes, translator), seconds
  engine = engine_lib.Engine(model, params, max_batch=args.max_batch, kv_blocks=args.kv_blocks,
                             block_size=args.block_size, max_seq_len=args.max_seq_len,
                             prefill_chunk=args.prefill_chunk, max_waiting=args.max_waiting, mesh=_mesh(args))
  seconds = engine.warm_up()
  server = Server(engine, tokenizer, cfg, args.workdir, name, args.api_key, args.max_body_bytes)
  return server, seconds


def _attention_path(e):
  """The ready line's attention: the CPU paged kernel, the Pallas TPU kernel for decode steps (prefill by the
  gather path), or the gather path and why."""
  if e.paged_fallback is None:
    return "paged kernel"
  if e.pallas_fallback is None:
    return f"Pallas decode, gather prefill ({e.paged_fallback})"
  return f"gather ({e.paged_fallback}; Pallas: {e.pallas_fallback})"


@cli
def main(argv):
  """The `python -m jaxformer.serve` entry point: loads, warms up, prints the ready line, serves until SIGTERM."""
  import uvicorn  # pylint: disable=g-import-not-at-top
  args = parse_args(argv)
  server, seconds = build(args)
  # The socket is bound before the ready line, so a client that reads it can connect at once.
  family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((args.host, args.port))
  except OSError as e:
    raise UserError(f"cannot listen on {args.host}:{args.port} ({e.strerror}): pick another --port") from None
  sock.listen(2048)
  port = sock.getsockname()[1]
  app = make_app(server, args.drain_s)
  config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.drain_s, access_log=False)
  uv = uvicorn.Server(config)
  work = server.engine or server.translator
  work.start()
  e = server.engine
  if e is None:
    d = server.cfg.decode
    print(f"jaxformer.serve: ready at http://{args.host}:{port}/v1 model={server.model_name} (translation: POST "
          f"/v1/translate) batch={args.max_batch} sentences beam={d.beam_size} alpha={d.alpha} "
          f"max_source_len={server.translator.max_source_len} warm-up {seconds:.1f}s", flush=True)
  else:
    print(f"jaxformer.serve: ready at http://{args.host}:{port}/v1 model={server.model_name} slots={e.max_batch} "
          f"kv={e.pool.num_blocks} blocks x {e.block_size} tokens ({e.capacity_tokens()} tokens) "
          f"max_seq_len={e.max_seq_len} prefill_chunk={e.prefill_chunk} attention="
          f"{_attention_path(e)} "
          f"dense={'output-major kernel' if e.dense_fallback is None else 'XLA (' + e.dense_fallback + ')'} "
          f"warm-up {seconds:.1f}s", flush=True)
  # uvicorn re-raises the SIGTERM it handled once it has drained, under the handler it found: a no-op
  # one here, so a drained server exits 0 (a second Ctrl-C during the drain forces the exit, as uvicorn does).
  signal.signal(signal.SIGTERM, lambda *_: None)
  try:
    uv.run(sockets=[sock])
  finally:
    server.accepting = False
    work.stop()
  print("jaxformer.serve: stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
  main()
