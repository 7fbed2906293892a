"""jaxformer.harness: lm-evaluation-harness on our models, against the harness's own `hf` model.

tests/fixtures/lm_eval/expected_*.json hold what `lm-eval`'s `hf` model (transformers + torch) answered for
the HF fixtures on the local tasks beside them (tests/fixtures/make_lm_eval_expected.py, run by hand).
"""

import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import chat
from jaxformer import decode
from jaxformer import evaluate
from jaxformer import harness
from jaxformer.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "fixtures" / "lm_eval"
LLAMA3_TEMPLATE = json.loads((ROOT / "tests" / "fixtures" / "chat" / "tokenizer_config.json").read_text())["chat_template"]


@pytest.fixture(autouse=True)
def at_the_checkout(monkeypatch):
  monkeypatch.chdir(ROOT)  # the task YAMLs name their data files from the checkout, as a user's name theirs


def _expected(name):
  return json.loads((TASKS / f"expected_{name}.json").read_text())


def _lm(converted, fixture, chat_template=False, batch_size=4):
  workdir, cfg, model, params, tok = converted(fixture)
  template = None
  if chat_template:  # Llama 3 Instruct's template, with the fixture tokenizer's special strings
    template = chat.ChatTemplate(LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
                                 "llama3")
  return harness.JaxformerLM(run=(cfg, model, params, tok), batch_size=batch_size, template=template)


@pytest.mark.parametrize("name,fixture", [("gpt2", "gpt2"), ("llama", "llama"),
                                          pytest.param("llama3_chat", "llama3", marks=pytest.mark.slow)])
def test_every_request_matches_the_harness_hf_model(converted, monkeypatch, name, fixture):
  expected = _expected(name)
  lm = _lm(converted, fixture, chat_template=expected["apply_chat_template"])
  generated = []  # (prompt ids, new ids) of every row decode.generate ran
  real_generate = decode.generate

  def recording_generate(model, params, prompts, max_new_tokens, rng, lengths=None, **kwargs):
    out = real_generate(model, params, prompts, max_new_tokens, rng, lengths=lengths, **kwargs)
    for row, n, new in zip(np.asarray(prompts).tolist(), np.asarray(lengths).tolist(), np.asarray(out).tolist()):
      generated.append((row[:n], new))
    return out

  monkeypatch.setattr(decode, "generate", recording_generate)
  results = harness.run_tasks(lm, list(expected["tasks"]), include_path=str(TASKS), log_samples=True,
                              apply_chat_template=expected["apply_chat_template"], bootstrap_iters=0)
  for task, want in expected["tasks"].items():
    ours = {s["doc_id"]: s for s in json.loads(json.dumps(results["samples"][task], default=str))}
    assert sorted(ours) == sorted(s["doc_id"] for s in want["samples"])
    for sample in want["samples"]:
      got = ours[sample["doc_id"]]
      # The prompts themselves: few-shot examples, and with the chat template its rendering (jaxformer.chat).
      assert got["arguments"] == sample["arguments"], (task, sample["doc_id"])
      for (mine,), (theirs,) in zip(got["resps"], sample["resps"], strict=True):
        if isinstance(theirs, list):  # loglikelihood: (log-prob, is-greedy)
          assert abs(mine[0] - theirs[0]) < 1e-4 and mine[1] == theirs[1], (task, sample["doc_id"], mine, theirs)
        elif isinstance(theirs, float):  # loglikelihood_rolling: a document's summed log-prob
          assert abs(mine - theirs) < 1e-4, (task, sample["doc_id"], mine, theirs)
        elif fixture != "llama":  # generate_until, a tokenizer.json: the same text
          assert mine == theirs, (task, sample["doc_id"])
    for metric, value in want["metrics"].items():
      if metric.startswith(("acc", "exact_match")) and "stderr" not in metric:  # counts: identical
        assert results["results"][task][metric] == pytest.approx(value, abs=1e-12), (task, metric)
      elif isinstance(value, float):  # from the summed log-likelihoods (perplexities exponentiate them)
        assert results["results"][task][metric] == pytest.approx(value, rel=1e-4), (task, metric)
  # Generations as tokens: the same prompts, and the same new tokens as far as transformers generated
  # (it stops a batch once every row met a stop string). sentencepiece and transformers' converted
  # tokenizer write random byte-fallback tokens as different text, so the llama fixture compares these only.
  theirs = {tuple(prompt): new for prompt, new in expected["generated_ids"]}
  mine = {tuple(prompt): new for prompt, new in generated}
  assert set(theirs) <= set(mine)
  for prompt, new in theirs.items():
    eos = new.index(lm.eot_token_id) + 1 if lm.eot_token_id in new else len(new)
    assert mine[prompt][:eos] == new[:eos], prompt


def _brute_force_logp(model, params, context, continuation):
  """log p(continuation | context) and whether it is greedy, from one unpadded forward in float64 numpy."""
  ids = np.asarray(context + continuation)
  logits = np.asarray(model.apply({"params": params}, jnp.asarray(ids[None, :-1])), np.float64)[0]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  rows = np.arange(len(context) - 1, len(ids) - 1)
  return logp[rows, ids[len(context):]].sum(), bool(np.all(logp[rows].argmax(-1) == ids[len(context):]))


def test_loglikelihood_against_brute_force_and_the_models_own_greedy_tokens(converted):
  lm = _lm(converted, "gpt2", batch_size=2)
  _, cfg, model, params, tok = converted("gpt2")
  context = tok.encode("The river ran through the old town")
  greedy = np.asarray(decode.generate(model, params, [context], 5, jax.random.PRNGKey(0), temperature=0.0))[0].tolist()
  wrong = greedy[:-1] + [(greedy[-1] + 1) % cfg.model.vocab_size]
  # Several requests share an input row (one-token continuations of one context) and rows of other lengths
  # share a batch (batch_size 2 rows, a padded width): each must score as it does alone, unpadded.
  requests = [(context, greedy), (context, wrong), (context, greedy[:1]), (context, [7]), (context, [9]),
              (context[:3], greedy), (context[:5], [11, 12])]
  got = lm._loglikelihood_tokens([(None, c, x) for c, x in requests])
  for (c, x), (logp, is_greedy) in zip(requests, got):
    want_logp, want_greedy = _brute_force_logp(model, params, c, x)
    assert logp == pytest.approx(want_logp, abs=1e-4) and is_greedy == want_greedy, (c, x)
  assert got[0][1] and not got[1][1] and got[2][1]  # the model's own greedy tokens are greedy; a changed one is not


def test_a_context_longer_than_the_model_is_cut_from_the_left_as_the_harness_does(converted):
  lm = _lm(converted, "gpt2")
  _, cfg, model, params, tok = converted("gpt2")
  long = tok.encode(" ".join(["the river ran under seven bridges"] * 20))
  assert len(long) > lm.max_length + 10
  (logp, _), = lm._loglikelihood_tokens([(None, long[:-3], long[-3:])])
  kept = long[-(lm.max_length + 1):]
  assert logp == pytest.approx(_brute_force_logp(model, params, kept[:-3], kept[-3:])[0], abs=1e-4)


@pytest.mark.parametrize("fixture", ["gpt2", "llama"])
def test_rolling_loglikelihood_is_eval_py_perplexity_with_the_prefix_token(converted, fixture, tmp_path):
  """The harness's rolling windows are evaluate.perplexity's windows (block = the model's context) over the
  text's tokens with the prefix token first: the same sum, computed by another path (cross-entropy of
  the training loss, in float32)."""
  lm = _lm(converted, fixture)
  workdir, cfg, model, params, tok = converted(fixture)
  text = " ".join(json.loads(line)["text"] for line in (TASKS / "rolling.jsonl").read_text().splitlines())
  rolling, = lm.loglikelihood_rolling([types.SimpleNamespace(args=(text,))])
  bos = [tok.bos_id] if cfg.data.add_bos else []  # what tok_encode puts first, after the prefix token
  ids = tok.encode(text)
  assert len(ids) % lm.max_length and len(ids) > 3 * lm.max_length  # several windows, the last one shorter
  for batch_size in (1, 8):  # the last window in a batch of its own, and with the others
    p = evaluate.perplexity(model, params, tok, text, lm.max_length, batch_size=batch_size,
                            prefix_ids=[lm.prefix_token_id] + bos, full_last_window=True)
    assert p["tokens"] == len(ids) + len(bos)
    assert -rolling == pytest.approx(p["nll_per_token"] * p["tokens"], rel=1e-5)
  # The same from the command line: eval.py --text FILE --rolling.
  path = tmp_path / "doc.txt"
  path.write_text(text + "\n")
  cli = evaluate.main(["--workdir", workdir, "--text", str(path), "--rolling"])
  line, = lm.loglikelihood_rolling([types.SimpleNamespace(args=(text + "\n",))])
  assert cli["tokens"] == len(tok.encode(text + "\n")) + len(bos)
  assert -line == pytest.approx(cli["nll_per_token"] * cli["tokens"], rel=1e-5)
  # eval.py's default: the first token unscored and a last window without context before it.
  plain = evaluate.perplexity(model, params, tok, text, lm.max_length)
  assert plain["tokens"] == len(ids) - 1
  assert plain["nll_per_token"] * plain["tokens"] != pytest.approx(-rolling, rel=1e-6)


def test_a_task_compiles_a_handful_of_programs_once(converted):
  lm = _lm(converted, "gpt2", batch_size=3)  # a batch no other test uses: its programs are new here
  first = harness.run_tasks(lm, ["jf_choice"], include_path=str(TASKS), bootstrap_iters=0)
  again = harness.run_tasks(lm, ["jf_choice"], include_path=str(TASKS), bootstrap_iters=0)
  assert 1 <= first["jaxformer"]["compilations"] <= 10  # per padded width: the forward, the scoring of its spans
  assert again["jaxformer"]["compilations"] == 0
  assert again["results"]["jf_choice"]["acc,none"] == first["results"]["jf_choice"]["acc,none"]


def test_bad_requests_are_one_line(converted, tiny_run, monkeypatch):
  lm = _lm(converted, "gpt2")
  with pytest.raises(UserError, match="unknown lm-eval task no_such_task"):
    harness.run_tasks(lm, ["no_such_task"], include_path=str(TASKS))
  with pytest.raises(UserError, match="--include-path /nonexistent: no such folder"):
    harness.run_tasks(lm, ["jf_choice"], include_path="/nonexistent")
  with pytest.raises(UserError, match="holds a translation model"):
    harness.JaxformerLM(tiny_run[0])
  monkeypatch.setattr(harness, "_MISSING", ImportError("No module named 'lm_eval'"))
  with pytest.raises(UserError, match=r'pip install -e "\.\[eval\]"'):
    harness.JaxformerLM(tiny_run[0])


@pytest.mark.slow  # eval.py as a process; the same run_tasks is tested in-process in the quick suite
def test_eval_py_tasks_prints_the_table_and_writes_json_and_names_missing_data(converted, tmp_path):
  workdir = converted("gpt2")[0]
  env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
  proc = subprocess.run([sys.executable, "eval.py", "--workdir", workdir, "--tasks", "jf_letters,jf_rolling",
                         "--include-path", str(TASKS), "--limit", "4", "--output", str(tmp_path / "out")],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "|jf_letters|" in proc.stdout.replace(" ", "") and "word_perplexity" in proc.stdout
  written = json.loads(next((tmp_path / "out").glob("results_*.json")).read_text())
  answers = [json.loads(line)["answer"] for line in (TASKS / "letters.jsonl").read_text().splitlines()]
  want = _expected("gpt2")["tasks"]["jf_letters"]["samples"]  # the hf model's log-likelihoods of each choice
  hits = [int(np.argmax([r[0][0] for r in s["resps"]]) == answers[s["doc_id"]]) for s in want if s["doc_id"] < 4]
  assert written["results"]["jf_letters"]["acc,none"] == pytest.approx(np.mean(hits))  # --limit 4: the first four
  assert written["results"]["jf_letters"]["sample_len"] == 4 and "XLA programs compiled" in proc.stderr
  # A built-in task whose data set is not cached, with no network: one line naming it and what to do.
  proc = subprocess.run([sys.executable, "eval.py", "--workdir", workdir, "--tasks", "arc_easy"],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  line = proc.stderr.strip().splitlines()[-1]
  assert line.startswith("error: ") and "allenai/ai2_arc" in line and "--include-path" in line, proc.stderr[-3000:]


def _train_text(path):
  """A corpus holding every character of the fixture tasks and their prompts (a char vocabulary)."""
  files = "".join((TASKS / name).read_text() for name in ("choice.jsonl", "letters.jsonl", "rolling.jsonl"))
  path.write_text((files + "Question: Answer:\n") * 4)
  return str(path)


@pytest.mark.slow  # a training run; eval.py --tasks on a checkpoint stays in the quick suite
def test_harness_tasks_run_at_eval_steps_and_equal_eval_py_on_the_checkpoint(tmp_path):
  from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import train  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / "run")
  cfg = config_lib.load_config("gpt2_tiny", [
      f"data.text_path={_train_text(tmp_path / 'text.txt')}", "train.num_steps=20", "train.eval_every=10",
      "train.eval_harness_tasks=jf_letters,jf_rolling", f"train.eval_harness_include_path={TASKS}",
      "train.eval_harness_limit=4", "train.sample_every_eval=false"])
  train.train_and_evaluate(cfg, workdir, log=lambda *a: None)
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  logged = {r["step"]: r for r in rows if "harness/jf_letters/acc" in r}
  assert sorted(logged) == [10, 20]
  assert all("harness/jf_rolling/word_perplexity" in r for r in logged.values())
  # The same tasks on the saved checkpoint through eval.py give the figures logged at its step.
  results = harness.main(["--workdir", workdir, "--tasks", "jf_letters,jf_rolling", "--include-path", str(TASKS),
                          "--limit", "4", "--output", str(tmp_path / "out")])
  assert results["results"]["jf_letters"]["acc,none"] == logged[20]["harness/jf_letters/acc"]
  assert results["results"]["jf_rolling"]["word_perplexity,none"] == pytest.approx(
      logged[20]["harness/jf_rolling/word_perplexity"], rel=1e-6)
  assert logged[10]["harness/jf_rolling/word_perplexity"] != logged[20]["harness/jf_rolling/word_perplexity"]


@pytest.mark.parametrize("overrides,message", [
    (["train.eval_harness_tasks=jf_letters", "train.eval_harness_every=15"], "must be a multiple of train.eval_every"),
    (["train.eval_harness_tasks=no_such_task"], "unknown lm-eval task no_such_task"),
])
def test_bad_harness_settings_stop_before_training(tmp_path, overrides, message):
  from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import train  # pylint: disable=g-import-not-at-top
  with pytest.raises(UserError, match=message):
    cfg = config_lib.load_config("gpt2_tiny", [f"data.text_path={_train_text(tmp_path / 'text.txt')}",
                                               f"train.eval_harness_include_path={TASKS}", *overrides])
    train.train_and_evaluate(cfg, str(tmp_path / "run"), log=lambda *a: None)
  assert not os.path.exists(tmp_path / "run" / "checkpoints") or not os.listdir(tmp_path / "run" / "checkpoints")
  with pytest.raises(UserError, match="runs language-model tasks"):
    from tests.conftest import tiny_config  # pylint: disable=g-import-not-at-top
    tiny_config("train.eval_harness_tasks=jf_letters")


@pytest.mark.parametrize("overrides", [["model.moe_experts=4", "model.moe_top_k=2"],
                                       pytest.param(["model.scan_layers=true"], marks=pytest.mark.slow),
                                       pytest.param(["model.sliding_window=8", "model.attention_pattern=local,global"],
                                                    marks=pytest.mark.slow)])
def test_loglikelihood_of_other_models_against_brute_force(overrides):
  """MoE (dropless at evaluation), scanned layers and sliding-window layers go through the same path."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import model as model_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load_config("llama_tiny", ["model.vocab_size=259", "data.tokenizer=byte", *overrides])
  model = model_lib.build_model(cfg.model)
  params = nn.unbox(model.init(jax.random.PRNGKey(1), jnp.ones((1, 8), jnp.int32))["params"])
  tok = tokenizer_lib.ByteTokenizer()
  lm = harness.JaxformerLM(run=(cfg, model, params, tok), batch_size=2)
  context, conts = tok.encode("Question: which season follows winter? Answer:"), [" spring", " a", " b", " summer"]
  got = lm._loglikelihood_tokens([(None, context, tok.encode(c)) for c in conts])
  for c, (logp, is_greedy) in zip(conts, got):
    want_logp, want_greedy = _brute_force_logp(model, params, context, tok.encode(c))
    assert logp == pytest.approx(want_logp, abs=1e-4) and is_greedy == want_greedy, c


def test_chat_rendering_with_and_without_the_generation_prompt(converted):
  lm = _lm(converted, "llama3", chat_template=True)
  history = [{"role": "user", "content": "Which season follows winter?"}]
  head = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhich season follows winter?<|eot_id|>"
  assert lm.apply_chat_template(history) == head + "<|start_header_id|>assistant<|end_header_id|>\n\n"
  # A task's answer prefix (gen_prefix) is the assistant's open turn: transformers' continue_final_message.
  opened = lm.apply_chat_template(history + [{"role": "assistant", "content": "The answer is"}],
                                  add_generation_prompt=False)
  assert opened == head + "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is"
  assert lm.tok_encode(opened)[0] == lm.tok.bos_id and lm.tok_encode(opened)[1] != lm.tok.bos_id  # BOS once
  assert lm.chat_template(True) == LLAMA3_TEMPLATE and lm.chat_template(False) is None


@pytest.mark.slow  # quantize + the harness, each tested on its own in the quick suite
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_workdir_scores_as_its_dequantized_float_model(converted, tmp_path, bits):
  from jaxformer import quantize  # pylint: disable=g-import-not-at-top
  workdir, cfg, model, params, tok = converted("llama")
  # weight-only (the default int16 activations change logp by ~1e-5 relative: against the dequantized model's
  # exact sums, 1e-4 absolute needs float activations)
  quantize.quantize_run(workdir, str(tmp_path / "q"), bits, group_size=32, log=lambda *a: None, activations="float")
  lm = harness.JaxformerLM(str(tmp_path / "q"), batch_size=2)
  reference = quantize.roundtrip_params(jax.device_get(params), cfg.model, bits, group_size=32)
  context = lm.tok_encode("Question: which season follows winter?\nAnswer:")
  conts = [tok.encode(" spring"), tok.encode(" the night"), tok.encode(" A")]
  got = lm._loglikelihood_tokens([(None, context, c) for c in conts])
  for c, (logp, is_greedy) in zip(conts, got):
    want_logp, want_greedy = _brute_force_logp(model, reference, context, c)
    assert logp == pytest.approx(want_logp, abs=1e-4) and is_greedy == want_greedy
    assert logp != pytest.approx(_brute_force_logp(model, params, context, c)[0], abs=1e-4)  # the weights changed
