"""Tests for `python -m jaxformer.serve`: a real server process on 127.0.0.1 driven by the official openai client."""

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import forward_logp  # pylint: disable=g-import-not-at-top
from jaxformer import chat  # pylint: disable=g-import-not-at-top
from jaxformer import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
from jaxformer import evaluate  # pylint: disable=g-import-not-at-top
from jaxformer import generate  # pylint: disable=g-import-not-at-top
from jaxformer import model as model_lib  # pylint: disable=g-import-not-at-top
from jaxformer import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n"
        "User: Assistant: What is your name? MENENIUS, VOLUMNIA, CORIOLANUS! qxzjk 0123456789\n")


def _write_run(path, cfg, seed, final_scale=None):
  """Writes a workdir of `cfg` with random N(0, 0.3) params (no compiled init) at step 1 into `path` -> str(path);
  final_scale: the decoder's last norm scale (peaky logits: varied text)."""
  model = model_lib.build_model(cfg.model)
  ids = jnp.zeros((1, 8), jnp.int32)
  args = (ids, ids) if cfg.model.arch == "encoder_decoder" else (ids,)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *args)["params"]
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: np.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), nn.unbox(shapes))
  if final_scale is not None:
    params["decoder"]["final_norm"]["scale"] = np.full_like(params["decoder"]["final_norm"]["scale"], final_scale)
  checkpoint_lib.save_params(str(path), params, step=1)
  (path / "config.json").write_text(config_lib.to_json(cfg))
  return str(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A decoder-only workdir made by hand: gpt2_tiny (256 positions) with random params, a char tokenizer, the
  built-in `plain` chat template."""
  path = tmp_path_factory.mktemp("serve_run")
  tok = tokenizer_lib.CharTokenizer.train([TEXT])
  cfg = config_lib.load_config("gpt2_tiny", [f"model.vocab_size={tok.vocab_size}", "model.max_len=256",
                                             "data.chat_template=plain"])
  tok.save(str(path / "tokenizer.json"))
  return _write_run(path, cfg, seed=0, final_scale=4.0)


def _start(workdir, *flags, env=None):
  """Starts the server on a free port -> (process, base url); waits for its ready line."""
  env = dict(os.environ, **(env or {}))
  proc = subprocess.Popen([sys.executable, "-m", "jaxformer.serve", "--workdir", workdir, "--port", "0",
                           "--max-seq-len", "256", "--prefill-chunk", "32", *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  line = proc.stdout.readline()
  match = re.search(r"ready at (http://127\.0\.0\.1:\d+/v1)", line)
  if not match:
    proc.kill()
    raise AssertionError(f"no ready line: {line!r} {proc.stderr.read()[-2000:]}")
  threading.Thread(target=proc.stderr.read, daemon=True).start()   # keep the pipe drained
  return proc, match.group(1)


def _stop(proc):
  if proc.poll() is None:
    proc.kill()
  proc.wait(timeout=30)


def _served_greedy(workdir, prompts, max_tokens, *flags):
  """Starts a server on `workdir` and sends `prompts` as concurrent greedy completions -> their texts."""
  proc, url = _start(workdir, *flags)
  try:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id

    def ask(p):
      return client.completions.create(model=name, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
      return list(pool.map(ask, prompts))
  finally:
    _stop(proc)


@pytest.fixture(scope="module")
def server(workdir):
  """(base url, openai client) of a server with 4 slots."""
  proc, url = _start(workdir, "--max-batch", "4")
  try:
    yield url, openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
  finally:
    _stop(proc)


@pytest.fixture(scope="module")
def local(workdir):
  """(cfg, model, params, tokenizer) of the run, loaded in this process for references."""
  cfg, model, params, tokenizer, _ = evaluate.load_run(workdir, log=lambda *a: None)
  return cfg, model, params, tokenizer


def _expected(local, prompts, n):
  """jaxformer.generate's greedy continuations (text), all prompts in one batch."""
  cfg, model, params, tokenizer = local
  return generate.generate_text(model, params, tokenizer, cfg, prompts, max_new_tokens=n, temperature=0.0,
                                top_k=0, top_p=1.0)


def test_completions_greedy_equal_generate_alone_and_16_concurrent(server, local):
  """Greedy text equals jaxformer.generate's, for one request and for 16 concurrent ones of mixed lengths
  (4 slots: they queue and join as others leave); streamed equals not streamed; usage and finish_reason."""
  url, client = server
  prompts = [TEXT[k:k + 3 + 7 * k] for k in range(16)]
  lengths = [5 + 3 * (k % 7) for k in range(16)]
  expected = _expected(local, prompts, max(lengths))
  one = client.completions.create(model=client.models.list().data[0].id, prompt=prompts[3], max_tokens=lengths[3],
                                  temperature=0)
  assert one.choices[0].text == expected[3][:lengths[3]]
  assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == lengths[3]
  assert one.usage.prompt_tokens == len(prompts[3])
  model = one.model

  def ask(k):
    return client.completions.create(model=model, prompt=prompts[k], max_tokens=lengths[k], temperature=0)

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    answers = list(pool.map(ask, range(16)))
  assert [a.choices[0].text for a in answers] == [e[:n] for e, n in zip(expected, lengths)]
  stream = client.completions.create(model=model, prompt=prompts[5], max_tokens=lengths[5], temperature=0, stream=True)
  chunks = list(stream)
  assert "".join(c.choices[0].text for c in chunks) == answers[5].choices[0].text
  assert chunks[-1].choices[0].finish_reason == "length"
  with httpx.stream("POST", url + "/completions", json={"prompt": "All", "max_tokens": 3, "stream": True}) as r:
    lines = [line for line in r.iter_lines() if line]
  assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
  assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_chat_renders_as_jaxformer_chat(server, local, workdir):
  """A chat answer equals `jaxformer.generate --chat`'s (chat_replies) greedy answer; prompt_tokens is the
  length of chat.prompt_ids' rendering; streamed chunks start with the role and join to the same text."""
  _, client = server
  cfg, model, params, tokenizer = local
  messages = [{"role": "system", "content": "Speak."}, {"role": "user", "content": "What is your name?"}]
  expected = generate.chat_replies(model, params, tokenizer, cfg, workdir, [messages], max_new_tokens=24,
                                   temperature=0.0, top_k=0, top_p=1.0)[0]
  model_id = client.models.list().data[0].id
  answer = client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0)
  template, hf = generate.chat_template(cfg, workdir, tokenizer)
  assert answer.usage.prompt_tokens == len(chat.prompt_ids(template, tokenizer, messages, cfg.data.add_bos, hf))
  assert answer.choices[0].message.content == expected and answer.choices[0].message.role == "assistant"
  chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
  assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


def test_stop_n_seed_logprobs_echo(server, local):
  """A stop string ends the text before it (finish_reason stop); n choices with a seed are reproducible;
  logprobs list the chosen token (the top one when greedy) and its alternatives; echo prepends the prompt."""
  _, client = server
  model_id = client.models.list().data[0].id
  full = client.completions.create(model=model_id, prompt="First", max_tokens=30, temperature=0).choices[0].text
  stop = full[10:12]
  cut = client.completions.create(model=model_id, prompt="First", max_tokens=30, temperature=0, stop=[stop, "@@"])
  assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
  streamed = client.completions.create(model=model_id, prompt="First", max_tokens=30, temperature=0, stop=stop,
                                       stream=True)
  assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]
  many = lambda: client.completions.create(model=model_id, prompt="All", max_tokens=12, temperature=1.0, n=3, seed=5)
  a, b = many(), many()
  assert len(a.choices) == 3 and [c.index for c in a.choices] == [0, 1, 2]
  assert [c.text for c in a.choices] == [c.text for c in b.choices]
  assert len({c.text for c in a.choices}) > 1            # each choice its own draw
  lp = client.completions.create(model=model_id, prompt="First", max_tokens=8, temperature=0, logprobs=3,
                                 echo=True)
  choice = lp.choices[0]
  assert choice.text == "First" + full[:8]
  assert "".join(choice.logprobs.tokens) == "First" + full[:8]   # the prompt's tokens, then the generated ones
  generated = [x[-8:] for x in (choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)]
  for token, value, top in zip(*generated):
    assert len(top) == 3 and value <= 0 and max(top, key=top.get) == token and top[token] == pytest.approx(value)
  chat_lp = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Speak"}],
                                           max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
  content = chat_lp.choices[0].logprobs.content
  assert "".join(t.token for t in content) == chat_lp.choices[0].message.content
  assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)


def test_echo_with_logprobs_scores_the_prompt(server, local):
  """echo + logprobs (OpenAI's and vLLM's legacy completions, lm-eval's API scoring): one entry per prompt token
  (log-prob null for the first) then the generated ones; the prompt's log-probs equal one forward over it (1e-4),
  top_logprobs hold the k most likely, text_offset indexes the echoed text; max_tokens 0 only scores; a prompt
  whose blocks are in the prefix cache scores the same; token ids as the prompt (lm-eval sends them)."""
  url, client = server
  cfg, model, params, tokenizer = local
  model_id = client.models.list().data[0].id
  prompt = TEXT[:50]
  ids = generate.encode_prompt(tokenizer, cfg, prompt)
  want, rows = forward_logp(model, params, ids)
  score = lambda p, n=0, k=2: client.completions.create(model=model_id, prompt=p, max_tokens=n, temperature=0,
                                                        logprobs=k, echo=True).choices[0]
  scored = score(prompt)
  lp = scored.logprobs
  assert scored.text == prompt and scored.finish_reason == "length" and "".join(lp.tokens) == prompt
  assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-4)
  assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
  for top, row in zip(lp.top_logprobs[1:], rows):
    assert sorted(top.values(), reverse=True) == pytest.approx(np.sort(row)[::-1][:2], abs=1e-4)
  again = score(prompt)                                   # its blocks are cached now: still scored whole
  assert again.logprobs.token_logprobs == lp.token_logprobs
  as_ids = score([ids], n=1, k=1)
  assert as_ids.logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-6)
  greedy = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0).choices[0].text
  longer = score(prompt, n=5)
  assert longer.text == prompt + greedy and longer.logprobs.token_logprobs[:len(ids)] == pytest.approx(
      lp.token_logprobs, abs=1e-6)
  assert "".join(longer.logprobs.tokens) == longer.text and len(longer.logprobs.tokens) == len(ids) + 5
  plain = client.completions.create(model=model_id, prompt=prompt, max_tokens=0, echo=True).choices[0]
  assert plain.text == prompt and plain.logprobs is None
  usage = client.completions.create(model=model_id, prompt=prompt, max_tokens=0, echo=True, logprobs=0).usage
  assert usage.completion_tokens == 0 and usage.prompt_tokens == len(ids)
  r = httpx.post(url + "/completions", json={"model": model_id, "prompt": "a", "max_tokens": 0, "logprobs": 1})
  assert r.status_code == 400 and "0 only with 'echo'" in r.json()["error"]["message"]


def test_tokenizer_endpoints_as_vllm(server, local):
  """POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's, which lm-eval's remote tokenizer reads):
  the run's own ids and text; bad ids are a 400 naming the field."""
  url, _ = server
  cfg, _, _, tokenizer = local
  root = url[:-3]
  out = httpx.post(root + "/tokenize", json={"prompt": "Speak, speak.", "add_special_tokens": False}).json()
  assert out["tokens"] == tokenizer.encode("Speak, speak.") and out["count"] == len(out["tokens"])
  assert out["max_model_len"] == 256
  assert httpx.post(root + "/tokenize", json={"prompt": "Speak"}).json()["tokens"] == generate.encode_prompt(
      tokenizer, cfg, "Speak")
  assert httpx.post(root + "/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": "Speak, speak."}
  r = httpx.post(root + "/detokenize", json={"tokens": [10 ** 6]})
  assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
  info = httpx.get(root + "/tokenizer_info").json()
  assert info["tokenizer_class"] == "CharTokenizer" and info["model_max_length"] == 256


@pytest.fixture(scope="module")
def word_workdir(tmp_path_factory):
  """A decoder-only workdir whose tokenizer.json is word-level (w0 .. w99 and a few non-ASCII words, split on
  whitespace, no decoder: decode joins words with spaces), gpt2_tiny with random params."""
  tokenizers = pytest.importorskip("tokenizers")
  path = tmp_path_factory.mktemp("word_run")
  words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(100)] + ["Männer", "漢字", "éüß", "\U0001F600"]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<pad>", "<s>", "</s>"])
  tok.save(str(path / "tokenizer.json"))
  cfg = config_lib.load_config("gpt2_tiny", [f"model.vocab_size={len(words)}", "model.max_len=128", "data.tokenizer=hf",
                                             "model.pad_id=0", "model.bos_id=1", "model.eos_id=2"])
  return _write_run(path, cfg, seed=1)


def test_text_is_decoded_in_context_streamed_or_echoed(word_workdir):
  """A word-level tokenizer's completion keeps the separator after the prompt (decoded alone it would read
  "w80w63"): the echoed text is the decode of prompt + completion, the completion text is that past the prompt,
  the streamed deltas add up to the non-streamed text, and the logprob tokens to the text (non-ASCII words too)."""
  proc, url = _start(word_workdir, "--max-batch", "2", "--max-seq-len", "128")
  try:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    tok = tokenizer_lib.HFTokenizer(pathlib.Path(word_workdir) / "tokenizer.json")
    for prompt in ("w78 w72 w19 w80", "Männer w3 漢字", "\U0001F600 éüß w5"):
      ask = lambda **kw: client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, **kw)
      echoed = ask(echo=True, logprobs=1).choices[0]
      ids = tok.encode(echoed.text)
      assert echoed.text == tok.decode(ids) and echoed.text.startswith(prompt + " ")
      assert "".join(echoed.logprobs.tokens) == echoed.text
      text = ask().choices[0].text
      assert prompt + text == echoed.text and text.startswith(" ")
      assert "".join(c.choices[0].text for c in ask(stream=True)) == text
    # This run has no chat template: the chat endpoint says so (it was a 500 with a traceback in the log).
    with pytest.raises(openai.BadRequestError, match="has no chat template.*use /v1/completions"):
      client.chat.completions.create(model=name, messages=[{"role": "user", "content": "w1"}], max_tokens=2)
  finally:
    _stop(proc)


def test_prefix_cache_hit_equals_miss(server, local):
  """Two prompts sharing a 40-character prefix: the second reads its full blocks from the cache (the
  /metrics hit rate rises) and its text equals jaxformer.generate's (a cold run)."""
  url, client = server
  model_id = client.models.list().data[0].id
  shared = TEXT[:40]
  first, second = shared + "Speak", shared + "MENENIUS"
  hit_rate = lambda: float(re.search(r"^jaxformer_prefix_cache_hit_rate (\S+)$", httpx.get(url[:-3] + "/metrics").text,
                                     re.M).group(1))
  client.completions.create(model=model_id, prompt=first, max_tokens=4, temperature=0)
  before = hit_rate()
  hit = client.completions.create(model=model_id, prompt=second, max_tokens=12, temperature=0)
  assert hit_rate() > before
  assert hit.choices[0].text == _expected(local, [second], 12)[0]


BAD = [  # (body, the param the error names)
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "a", "temperature": -0.5}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "n": 100}, "n"),
    ({"prompt": "a" * 300, "max_tokens": 4}, "prompt"),
    ({"prompt": "a", "model": "gpt-4"}, "model"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "stop": 3}, "stop"),
]


def test_bad_input_is_400_and_others_run_on(server, local):
  """Each bad input is a 400 with OpenAI's error object naming the field, while a long request that runs
  meanwhile completes unchanged; malformed JSON, an empty messages list, a body above the limit."""
  url, client = server
  model_id = client.models.list().data[0].id
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    running = pool.submit(client.completions.create, model=model_id, prompt="Before", max_tokens=120, temperature=0)
    for body, param in BAD:
      r = httpx.post(url + "/completions", json={"model": model_id, **body})
      err = r.json()["error"]
      assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", (body, err)
      assert param in err["message"] and "\n" not in err["message"]
    r = httpx.post(url + "/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/chat/completions", json={"model": model_id, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url + "/completions", json={"prompt": "a" * (2 << 20)})
    assert r.status_code == 413
    assert running.result().choices[0].text == _expected(local, ["Before"], 120)[0]


def test_models_health_metrics_and_no_compilation(server):
  """/v1/models names the model, /health is ok, /metrics is Prometheus text whose compilation counter is
  still 0 after every request of this module (all programs were compiled before the ready line)."""
  url, client = server
  assert client.models.list().data[0].id == "serve_run0"
  assert httpx.get(url[:-3] + "/health").json()["status"] == "ok"
  text = httpx.get(url[:-3] + "/metrics").text
  for name in ("jaxformer_requests_total", "jaxformer_time_to_first_token_seconds_bucket",
               "jaxformer_time_per_output_token_seconds_count", "jaxformer_kv_blocks_used", "jaxformer_kv_blocks_free",
               "jaxformer_requests_running", "jaxformer_requests_waiting", "jaxformer_prompt_tokens_total",
               "jaxformer_preemptions_total"):
    assert re.search(rf"^{name}", text, re.M), name
  assert re.search(r"^jaxformer_xla_compilations_since_start 0\.0$", text, re.M)


def test_key_queue_disconnect_and_sigterm_drain(workdir, local):
  """One slot, one waiting place, an API key: 401 without the key; a third request gets 429 with Retry-After;
  a streaming client that disconnects frees its slot for the next request; SIGTERM lets the running and
  waiting requests finish, then the process exits 0."""
  proc, url = _start(workdir, "--max-batch", "1", "--max-waiting", "1", "--api-key", "sesame", "--drain-s", "60")
  try:
    assert httpx.post(url + "/completions", json={"prompt": "a"}).status_code == 401
    bad = httpx.get(url + "/models", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0, timeout=120)
    model_id = client.models.list().data[0].id
    # A disconnecting stream: read two chunks, close; the next request must get the only slot.
    stream = client.completions.create(model=model_id, prompt="First", max_tokens=250, temperature=0, stream=True)
    for _, _ in zip(range(2), stream):
      pass
    stream.close()
    quick = client.completions.create(model=model_id, prompt="All", max_tokens=3, temperature=0)
    assert quick.choices[0].finish_reason == "length"
    health = httpx.get(url[:-3] + "/health").json()
    assert health["running"] == 0 and health["waiting"] == 0
    body = {"prompt": "Before", "max_tokens": 240, "temperature": 0}
    post = lambda: httpx.post(url + "/completions", json=body, headers={"Authorization": "Bearer sesame"}, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      for attempt in range(3):
        first = pool.submit(post)
        while httpx.get(url[:-3] + "/health").json()["running"] < 1 and not first.done():
          time.sleep(0.05)
        # Three at once while the slot is taken (240 tokens): one takes the waiting place, two find the queue
        # full. (Sent one by one, the waiting request could take the slot between a /health poll and the
        # third.) On a machine so loaded that the first request ended before the three arrived, the round
        # is run again (all its requests finish first); nothing else is retried.
        more = [pool.submit(post) for _ in range(3)]
        done = concurrent.futures.as_completed(more)
        rejected = [next(done).result(), next(done).result()]
        if all(r.status_code == 429 for r in rejected) or attempt == 2:
          break
        assert first.result().status_code == 200 and next(done).result().status_code == 200
      # SIGTERM only once both refusals are back: all three have reached the server, none is refused at connect.
      proc.send_signal(signal.SIGTERM)   # draining: the running and waiting requests still finish
      answers = [first.result(), next(done).result()]   # the third to finish: the one that waited
    for r in rejected:
      assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert [a.json()["choices"][0]["text"] for a in answers] == _expected(local, ["Before"] * 2, 240)
    assert proc.wait(timeout=60) == 0
  finally:
    _stop(proc)


@pytest.mark.slow  # quantize's command + a server; the engine on quantized weights: test_engine (quick)
def test_a_quantized_workdir_serves_the_tokens_generate_gives_it(workdir, tmp_path):
  """`python -m jaxformer.quantize --bits 4` on the run, then served: 4 concurrent greedy completions equal
  jaxformer.generate's on the quantized workdir (int4 projections and the int8 table on both sides)."""
  from jaxformer import quantize  # pylint: disable=g-import-not-at-top
  qdir = str(tmp_path / "q4")
  quantize.quantize_run(workdir, qdir, 4, group_size=32, log=lambda *a: None)
  cfg, model, params, tokenizer, _ = evaluate.load_run(qdir, log=lambda *a: None)
  assert "qkernel" in params["decoder"]["layer_0"]["ffn"]["wi"]
  prompts = [TEXT[k:k + 4 + 5 * k] for k in range(4)]  # short: prefill rows stay on the kernel in both
  expected = [generate.generate_text(model, params, tokenizer, cfg, [p], max_new_tokens=12, temperature=0.0,
                                     top_k=0, top_p=1.0)[0] for p in prompts]
  assert _served_greedy(qdir, prompts, 12, "--max-batch", "4") == [e[:12] for e in expected]


@pytest.fixture(scope="module")
def translation_workdir(tmp_path_factory):
  """A tiny_encdec workdir made by hand (random params, a char tokenizer), beam 2 as its decode setting."""
  path = tmp_path_factory.mktemp("serve_translation")
  tok = tokenizer_lib.CharTokenizer.train([TEXT])
  cfg = config_lib.load_config("tiny_encdec", [f"model.vocab_size={tok.vocab_size}", "data.tokenizer=char",
                                               "model.max_len=48", "decode.beam_size=2", "decode.max_extra_len=6"])
  tok.save(str(path / "tokenizer.json"))
  return _write_run(path, cfg, seed=1)


def test_a_translation_workdir_serves_v1_translate_as_eval_translates(translation_workdir):
  """POST /v1/translate: one request of several sentences, and 3 concurrent ones batched together, give
  `evaluate.translate`'s beam-search output with the run's decode settings; bad input is a 400, the
  completions endpoint a 404 naming /v1/translate; no compilation after the ready line."""
  cfg, model, params, tokenizer, _ = evaluate.load_run(translation_workdir, log=lambda *a: None)
  texts = [TEXT[k:k + 5 + k] for k in range(0, 12, 2)]
  d = cfg.decode
  expected = evaluate.translate(model, params, tokenizer, texts, d.beam_size, d.alpha, d.max_extra_len, batch_size=4,
                                length_penalty=d.length_penalty, early_stopping=d.hf_early_stopping,
                                suppress_pad=d.suppress_pad)
  proc, url = _start(translation_workdir, "--max-batch", "4")
  try:
    post = lambda body: httpx.post(url + "/translate", json=body, timeout=120)
    one = post({"text": texts[:4]})
    assert one.status_code == 200, one.text
    assert one.json()["translations"] == expected[:4]
    assert one.json()["usage"]["source_tokens"] == sum(len(t) + 1 for t in texts[:4])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # 1 + 2 + 1 sentences: one call of 4 rows
      answers = list(pool.map(post, [{"text": texts[4]}, {"text": texts[:2]}, {"text": [texts[5]]}]))
    assert [a.json()["translations"] for a in answers] == [[expected[4]], expected[:2], [expected[5]]]
    for body, field in (({"text": 3}, "text"), ({"text": []}, "text"), ({"text": ["a" * 60]}, "text")):
      r = post(body)
      assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "above this model's 48" in r.json()["error"]["message"]  # the last: 61 tokens with EOS
    r = httpx.post(url + "/completions", json={"prompt": "All", "max_tokens": 2}, timeout=60)
    assert r.status_code == 404 and "/v1/translate" in r.json()["error"]["message"]
    metrics = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=60).text
    assert re.search(r"^jaxformer_xla_compilations_since_start 0\.0$", metrics, re.M), metrics
  finally:
    _stop(proc)


@pytest.mark.parametrize("name", ["mixtral", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_a_converted_workdir_serves_the_tokens_generate_gives_it(converted, name):
  """Workdirs imported with `convert --from-hf` (Mixtral: MoE layers; Qwen2: qkv biases, its tokenizer.json)
  served: 3 concurrent greedy completions equal jaxformer.generate's on the same workdir."""
  workdir, cfg, model, params, tokenizer = converted(name)
  prompts = ["Hello there", "The quick brown fox", "1 2 3"]
  expected = [generate.generate_text(model, params, tokenizer, cfg, [p], max_new_tokens=8, temperature=0.0,
                                     top_k=0, top_p=1.0)[0] for p in prompts]
  assert _served_greedy(workdir, prompts, 8, "--max-batch", "3", "--max-seq-len", "64") == expected


LM_EVAL_TASKS = pathlib.Path(__file__).resolve().parent / "fixtures" / "lm_eval"


def test_lm_eval_local_completions_against_the_server_equals_its_hf_model(converted):
  """lm-evaluation-harness's own API client, `local-completions` (echo + logprobs 1 + max_tokens 1 per request,
  sliced at the context's length; prompts tokenized through /tokenize: tokenizer_backend=remote), against a
  server on the GPT-2 fixture imported with convert, equals the harness's `hf` model on the same weights
  (tests/fixtures/lm_eval/expected_gpt2_api.json, made with transformers by make_lm_eval_expected.py): the same
  prompts, every log-likelihood within 1e-4 with the same is-greedy flag, acc and acc_norm. An API client keeps
  one position for the token it asks for, so an input longer than the model's 64 positions is cut one token
  sooner than `hf` cuts it: those (4 of 80 requests, one question) are checked to be cut, not compared."""
  lm_eval = pytest.importorskip("lm_eval")
  pytest.importorskip("tenacity")                       # lm-eval's [api] extra
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  workdir, _, _, _, tokenizer = converted("gpt2")
  expected = json.loads((LM_EVAL_TASKS / "expected_gpt2_api.json").read_text())
  proc, url = _start(workdir, "--max-batch", "4", "--max-seq-len", "64")
  try:
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args=f"model={os.path.basename(workdir)},base_url={url}/completions,"
        "tokenizer_backend=remote,num_concurrent=2,max_retries=1,batch_size=4,max_length=65",
        tasks=list(expected["tasks"]), task_manager=TaskManager(include_path=str(LM_EVAL_TASKS)),
        num_fewshot=0, log_samples=True, bootstrap_iters=0)
  finally:
    _stop(proc)
  cut = 0
  for task, want in expected["tasks"].items():
    ours = {s["doc_id"]: s for s in json.loads(json.dumps(out["samples"][task], default=str))}
    whole = True
    for sample in want["samples"]:
      got = ours[sample["doc_id"]]
      assert got["arguments"] == sample["arguments"], (task, sample["doc_id"])
      for (context, continuation), (mine,), (theirs,) in zip(got["arguments"], got["resps"], sample["resps"],
                                                             strict=True):
        if len(tokenizer.encode(context + continuation)) > 64:
          cut, whole = cut + 1, False
          continue
        assert abs(mine[0] - theirs[0]) < 1e-4 and mine[1] == theirs[1], (task, sample["doc_id"], mine, theirs)
    for metric, value in want["metrics"].items():
      if whole and metric.startswith("acc") and "stderr" not in metric:
        assert out["results"][task][metric] == pytest.approx(value, abs=1e-12), (task, metric)
  assert cut == 4
