"""SFT and DPO data and objectives: golden chat renderings and masks (TRL's style), packing, the DPO loss."""

import json
import re
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import chat, data as data_lib, losses, model as model_lib, synthetic, tasks, train
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.config import load_config
from jaxformer.errors import UserError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "chat")
with open(os.path.join(FIXTURES, "expected.json"), encoding="utf-8") as _f:
  EXPECTED = json.load(_f)  # made by transformers' apply_chat_template (make_chat_fixtures.py)
QUIET = lambda *a: None


def fixture_template(name):
  with open(os.path.join(FIXTURES, "tokenizer_config.json")) as f:
    config = json.load(f)
  return chat.ChatTemplate(EXPECTED["templates"][name], {k: config[k] for k in ("bos_token", "eos_token")}, name)


@pytest.fixture(scope="module")
def hf_tok():
  return tokenizer_lib.load_tokenizer(os.path.join(FIXTURES, "tokenizer.json"))


def cases(error=False):
  return [c for c in EXPECTED["cases"] if ("error" in c) == error]


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c['template']}-{c['conversation']}")
def test_rendering_and_tokens_equal_transformers(case, hf_tok):
  template = fixture_template(case["template"])
  conv = EXPECTED["conversations"][case["conversation"]]
  assert template.render(conv) == case["text"]
  assert template.render(conv[:-1], add_generation_prompt=True) == case["prompt_text"]
  for loss_on in ("assistant", "completion", "all"):  # tokenizing the pieces = tokenizing the whole text
    ids, mask = chat.encode_pieces(hf_tok, chat.conversation_pieces(template, conv, loss_on), True)
    assert ids.tolist() == case["ids"]
    assert len(mask) == len(ids) and (loss_on != "all" or mask.all())


def test_raise_exception_is_one_line(tmp_path):
  """A template's raise_exception(...) on a record: one line naming the record's file and line (as README says),
  the template's file and its message; so is anything else a template raises on a record (a TypeError here)."""
  (case,) = cases(error=True)
  template = tmp_path / "mistral.jinja"
  template.write_text(EXPECTED["templates"][case["template"]])
  path = tmp_path / "chats.jsonl"
  write_jsonl(path, [{"messages": EXPECTED["conversations"][0]}, {"messages": EXPECTED["conversations"][case["conversation"]]}])
  cfg = sft_config(tmp_path, f"data.chat_path={path}", f"data.chat_template={template}")
  with pytest.raises(UserError) as e:
    chat.ensure_prepared(cfg, str(tmp_path / "run"), log=QUIET)
  assert str(e.value) == f"{path}:2: chat template {template}: {case['error']}"
  template.write_text("{{ messages[0]['content'] + 1 }}")
  with pytest.raises(UserError) as e:
    chat.ensure_prepared(cfg, str(tmp_path / "run2"), log=QUIET)
  assert str(e.value).startswith(f"{path}:1: chat template {template}: TypeError: ") and "\n" not in str(e.value)


def test_a_template_that_does_not_parse_names_its_file(tmp_path):
  template = tmp_path / "broken.jinja"
  template.write_text("{% for message in messages %}\n{{ message['content'] }}\n{% if %}")
  cfg = sft_config(tmp_path, f"data.chat_template={template}")
  with pytest.raises(UserError, match=rf"^chat template {re.escape(str(template))} does not parse \(line 3 of the "
                     r"template\): ") as e:
    chat.ensure_prepared(cfg, str(tmp_path / "run"), log=QUIET)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", [c for c in cases() if "assistant_masks" in c], ids=lambda c: str(c["conversation"]))
def test_generation_block_mask_equals_transformers_assistant_masks(case, hf_tok):
  template = fixture_template(case["template"])
  _, mask = chat.encode_pieces(hf_tok, chat.conversation_pieces(template, EXPECTED["conversations"][case["conversation"]],
                                                                "assistant"), True)
  assert mask.tolist() == case["assistant_masks"]


# The trained text of each conversation, written out by hand (TRL's golden-label style): every
# assistant turn and the end-of-turn token after it; completion: the last turn only.
LLAMA3_TRAINED = {0: ["three two one<|eot_id|>"], 1: ["5<|eot_id|>", "8<|eot_id|>"],  # | trim strips " 8\n"
                  2: ["Hallo, hi.<|eot_id|>", "hi<|eot_id|>"]}
MISTRAL_TRAINED = {0: ["three two one<|eot_id|> "], 2: ["Hallo, hi.<|eot_id|> ", "hi<|eot_id|> "]}


def trained_runs(tok, ids, mask):
  """The decoded text of each maximal run of mask-1 tokens."""
  runs, current = [], []
  for i, m in zip(ids.tolist(), mask.tolist()):
    if m:
      current.append(i)
    elif current:
      runs.append(tok.decode(current)), current.clear()
  return runs + ([tok.decode(current)] if current else [])


@pytest.mark.parametrize("name,expected", [("llama3", LLAMA3_TRAINED), ("mistral", MISTRAL_TRAINED)])
def test_assistant_masks_by_hand(name, expected, hf_tok):
  template = fixture_template(name)
  for k, runs in expected.items():
    conv = EXPECTED["conversations"][k]
    ids, mask = chat.encode_pieces(hf_tok, chat.conversation_pieces(template, conv, "assistant"), True)
    assert trained_runs(hf_tok, ids, mask) == runs
    ids, mask = chat.encode_pieces(hf_tok, chat.conversation_pieces(template, conv, "completion"), True)
    assert trained_runs(hf_tok, ids, mask) == runs[-1:]
  eot = hf_tok.tok.token_to_id("<|eot_id|>")
  ids, mask = chat.encode_pieces(hf_tok, chat.conversation_pieces(template, EXPECTED["conversations"][0], "assistant"),
                                 True)
  assert eot in ids[mask == 1].tolist()  # the end-of-turn token is in the loss


def test_builtin_template_with_our_byte_tokenizer():
  """gpt2_small/char models: chatml, with the model's EOS id ending the assistant's turn (in the loss)."""
  tok = tokenizer_lib.ByteTokenizer()
  template = chat.load_template("chatml", "byte", False)
  conv = EXPECTED["conversations"][1]
  text = template.render(conv)
  assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n  Add 2 and 3  <|im_end|>\n"
                  "<|im_start|>assistant\n5<|eos|><|im_start|>user\nNow 4 + 4?<|im_end|>\n"
                  "<|im_start|>assistant\n 8\n<|eos|>")
  ids, mask = chat.encode_pieces(tok, chat.conversation_pieces(template, conv, "assistant"), False)
  eos = np.flatnonzero(ids == tok.eos_id)
  assert len(eos) == 2 and mask[eos].all() and tok.eos_id not in ids[mask == 0]
  assert trained_runs(tok, ids, mask) == ["5", " 8\n"]  # (the EOS id decodes to nothing)
  assert template.render(conv[:2], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
  # plain prompt/completion: no template, loss on the completion and EOS
  pieces = chat.record_pieces(template, {"prompt": "2+2=", "completion": "4"}, "assistant", tok.eos_id)
  ids, mask = chat.encode_pieces(tok, pieces, False)
  assert tok.decode(ids[mask == 0]) == "2+2=" and ids[mask == 1].tolist() == tok.encode("4") + [tok.eos_id]


def write_jsonl(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def sft_config(tmp_path, *overrides, records=None):
  path = tmp_path / "sft.jsonl"
  if records is not None or not path.exists():  # once: a rewritten file is other data to `chat.ensure_prepared`
    write_jsonl(path, records if records is not None else synthetic.reverse_words_records(60))
  return load_config("gpt2_tiny", ["data.tokenizer=byte", "model.vocab_size=259", "data.chat_template=plain", "model.num_layers=1",
                                   f"data.chat_path={path}", "data.block_size=64", "data.batch_size=4",
                                   "data.packing=packed", "optim.label_smoothing=0", "model.dropout_rate=0",
                                   "train.sample_every_eval=false", *overrides])


def test_packed_rows_keep_examples_apart(tmp_path):
  """Brute force: every row is whole examples back to back; segments and positions restart at each; a target
  is in the loss exactly when it is the same example's next token and the mask has it (EOS included)."""
  cfg = sft_config(tmp_path, "data.block_size=128", "model.max_len=128")
  task = tasks.make_task(cfg, str(tmp_path / "run"), log=QUIET)
  tok = task.tokenizer
  stream, mask = task.streams["train"]["text"], task.streams["train"]["mask"]
  examples = list(stream.documents())
  masks = list(mask.documents())
  packed_rows = 0
  for step in range(3):
    b = task.train_batch(step)
    for r in range(b["inputs"].shape[0]):
      seg, pos, w = b["segment_ids"][r], b["positions"][r], b["weights"][r]
      starts = np.flatnonzero((pos == 0) & (seg > 0))
      ends = list(starts[1:]) + [int((seg > 0).sum())]
      packed_rows += len(starts) > 1
      for j, (a, end) in enumerate(zip(starts, ends)):
        assert (seg[a:end] == j + 1).all() and (pos[a:end] == np.arange(end - a)).all()
        ids = b["inputs"][r, a:end]
        k = next(i for i, ex in enumerate(examples) if np.array_equal(ex[:len(ids)], ids) and
                 (len(ex) == len(ids) or (len(ex) == len(ids) + 1 and end == 128)))
        ex, m = examples[k], masks[k]
        for t in range(a, end):
          i = t - a + 1  # the target's index in the example
          assert w[t] == (m[i] if i < len(ex) else 0)  # never the next example's first token
          if i < len(ex):
            assert b["targets"][r, t] == ex[i]
        assert ex[-1] == tok.eos_id and w[a + len(ex) - 2] == 1  # the EOS is a trained target
      assert (w[seg == 0] == 0).all()
  assert packed_rows  # block 128 holds two ~58-token examples


def test_empty_masks_are_counted_and_all_empty_is_one_line(tmp_path):
  records = synthetic.reverse_words_records(10) + [{"messages": [{"role": "user", "content": "hi"}]}] * 3
  logs = []
  cfg = sft_config(tmp_path, "data.train_fraction=1.0", records=records)
  tasks.make_task(cfg, str(tmp_path / "a"), log=logs.append)
  assert any("3 with no loss token" in line for line in logs), logs
  cfg = sft_config(tmp_path, "data.train_fraction=1.0", records=records[-3:])
  with pytest.raises(UserError, match="no training example has a token to train on") as e:
    tasks.make_task(cfg, str(tmp_path / "b"), log=QUIET)
  assert "\n" not in str(e.value)
  # Cut to a block too short for the answer: the example is counted as empty at batch time.
  cfg = sft_config(tmp_path, "data.train_fraction=1.0", "data.block_size=8", records=records[:10])
  with pytest.raises(UserError, match="raise data.block_size"):
    tasks.make_task(cfg, str(tmp_path / "c"), log=QUIET)


def np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_mask_reaches_the_lm_loss(tmp_path):
  """The LM loss of an SFT batch = numpy's -log p summed over the weighted targets only."""
  cfg = sft_config(tmp_path)
  task = tasks.make_task(cfg, str(tmp_path / "run"), log=QUIET)
  b = task.train_batch(0)
  model = model_lib.build_model(cfg.model)
  params = model.init(jax.random.PRNGKey(0), jnp.asarray(b["inputs"][:1]))["params"]
  loss, nll, weight = task.loss(model, params, b, {}, True, 0.0)
  logits = np.asarray(model.apply({"params": params}, b["inputs"], b["segment_ids"], b["positions"]), np.float64)
  logp = np.take_along_axis(np_log_softmax(logits), b["targets"][..., None], -1)[..., 0]
  assert float(weight) == b["weights"].sum() < b["weights"].size / 2
  np.testing.assert_allclose(float(nll), -(logp * b["weights"]).sum(), rtol=1e-5)


def test_dpo_loss_matches_the_formula():
  rng = np.random.default_rng(0)
  pc, pr, rc, rr = (rng.normal(-20, 5, 16) for _ in range(4))
  for beta in (0.1, 0.5, 2.0):
    loss, chosen, rejected = losses.dpo_loss(*(jnp.asarray(x, jnp.float32) for x in (pc, pr, rc, rr)), beta)
    margin = beta * ((pc - rc) - (pr - rr))  # beta once (MaxText's issue 1530 scaled it twice)
    np.testing.assert_allclose(loss, np.log1p(np.exp(-margin)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chosen, beta * (pc - rc), rtol=1e-5)
    np.testing.assert_allclose(rejected, beta * (pr - rr), rtol=1e-5)


def dpo_config(tmp_path, *overrides, n=64):
  path = tmp_path / "dpo.jsonl"
  if not path.exists():
    write_jsonl(path, synthetic.reverse_words_preferences(n))
  return load_config("gpt2_tiny", ["data.tokenizer=byte", "model.vocab_size=259", "data.chat_template=plain", "model.num_layers=1",
                                   f"data.chat_path={path}", "data.block_size=64", "data.batch_size=8",
                                   "train.objective=dpo", "train.dpo_from_scratch=true", "model.dropout_rate=0",
                                   "optim.learning_rate=3e-3",
                                   "train.sample_every_eval=false", *overrides])


def test_dpo_log_probs_are_summed_over_the_response_only(tmp_path):
  cfg = dpo_config(tmp_path)
  task = tasks.make_task(cfg, str(tmp_path / "run"), log=QUIET)
  b = task.train_batch(0)
  assert b["inputs"].shape == (8, 2, 64)
  tok = task.tokenizer
  for r in range(2):  # the weighted targets are exactly the answer and its EOS
    for side, key in ((0, "chosen"), (1, "rejected")):
      t = b["targets"][r, side][b["weights"][r, side] == 1]
      assert t[-1] == tok.eos_id and "Assistant" not in tok.decode(t) and "reverse" not in tok.decode(t)
  model = model_lib.build_model(cfg.model)
  params = model.init(jax.random.PRNGKey(0), jnp.asarray(b["inputs"][:1, 0]))["params"]
  got = task.sequence_log_probs(model, params, b, {}, True)
  flat = {k: v.reshape(16, 64) for k, v in b.items()}
  logits = np.asarray(model.apply({"params": params}, flat["inputs"], flat["segment_ids"], flat["positions"]),
                      np.float64)
  logp = np.take_along_axis(np_log_softmax(logits), flat["targets"][..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(got).ravel(), (logp * flat["weights"]).sum(-1), rtol=1e-5)
  loss, sums = task.preference_loss(model, params, params, b, {}, True, 0.1)
  np.testing.assert_allclose(float(loss), 8 * np.log(2), rtol=1e-6)  # policy = reference: margin 0
  assert float(sums["tokens"]) == 8


def read_metrics(workdir, key):
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [(r["step"], r[key]) for r in rows if key in r]


def resume_matches(cfg_fn, tmp_path, steps=8):
  """`steps` in one go == half of them, then a new call with all in the same workdir (test_train's standard)."""
  a = train.train_and_evaluate(cfg_fn(f"train.num_steps={steps}"), str(tmp_path / "a"), log=QUIET)
  train.train_and_evaluate(cfg_fn(f"train.num_steps={steps // 2}"), str(tmp_path / "b"), log=QUIET)
  logs = []
  b = train.train_and_evaluate(cfg_fn(f"train.num_steps={steps}"), str(tmp_path / "b"), log=logs.append)
  assert any(line.startswith("resumed from") and f"(step {steps // 2})" in line for line in logs), logs
  for x, y in zip(jax.tree.leaves(a["state"]), jax.tree.leaves(b["state"])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
  la, lb = read_metrics(str(tmp_path / "a"), "loss"), read_metrics(str(tmp_path / "b"), "loss")
  la, lb = dict(la), dict(lb)
  assert max(la) == max(lb) == steps
  before = lambda logged, s: max([k for k in logged if k < s], default=0)
  same = [s for s in la if s > steps // 2 and s in lb and before(la, s) == before(lb, s)]  # the same steps averaged
  assert same
  np.testing.assert_allclose([la[s] for s in same], [lb[s] for s in same], rtol=1e-5)
  return a, b


@pytest.mark.slow
def test_sft_resume_gives_the_same_losses(tmp_path):
  common = ("train.log_every=2", "train.checkpoint_every=4", "data.train_fraction=1.0")  # no val split: no eval
  (tmp_path / "d").mkdir()
  resume_matches(lambda n: sft_config(tmp_path / "d", n, *common), tmp_path)


@pytest.mark.slow
def test_dpo_trains_resumes_and_the_reference_never_changes(tmp_path):
  """On generated preferences (reverse the words, not copy them): reward accuracy and margin rise
  (the chosen answer's probability rises relative to the rejected one's), the reference stays the
  initial params bitwise, and a run resumed at step 10 gives the same losses and state."""
  (tmp_path / "d").mkdir()
  cfg_fn = lambda n: dpo_config(tmp_path / "d", n, "train.log_every=4", "train.checkpoint_every=10",
                                "optim.warmup_steps=2", "optim.schedule=constant")
  result, _ = resume_matches(cfg_fn, tmp_path, steps=20)
  cfg, workdir, state = cfg_fn("train.num_steps=20"), str(tmp_path / "a"), result["state"]
  _, _, _, _, _, init_fn, rng, _, state_sharding = train.setup(cfg, workdir, QUIET)
  start = jax.jit(lambda r: nn.unbox(init_fn(r)), out_shardings=state_sharding)(rng)  # the loop's initial state
  leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]
  for ref, init in zip(leaves(state["ref_params"]), leaves(start["params"])):
    np.testing.assert_array_equal(ref, init)  # bitwise: the reference is the initial policy, never updated
  assert any(not np.array_equal(a, b) for a, b in zip(leaves(state["params"]), leaves(start["params"])))
  acc = [v for _, v in read_metrics(workdir, "rewards/accuracy")]
  margin = [v for _, v in read_metrics(workdir, "rewards/margin")]
  assert acc[-1] >= 0.7 > acc[0], acc  # towards 1 with more steps (BENCHMARKS.md)
  assert margin[-1] > margin[0] and margin[-1] > 0, margin


def test_builtin_template_with_a_tokenizer_json_ends_turns_in_the_model_eos(hf_tok):
  eot = hf_tok.tok.token_to_id("<|eot_id|>")
  tok = hf_tok.use_model_ids(0, hf_tok.tok.token_to_id("<|begin_of_text|>"), eot)
  template = chat.load_template("chatml", os.path.join(FIXTURES, "tokenizer.json"), True)
  ids, mask = chat.encode_pieces(tok, chat.conversation_pieces(template, EXPECTED["conversations"][0], "assistant"),
                                 True)
  assert ids[mask == 1].tolist() == tok.encode("three two one") + [eot]


# ----------------------------------------------------------------------------
# Preparing: never reusing what another preparation left; malformed records are one line naming file:line.


def shard_tokens(ddir, manifest, split="train", field="text"):
  """The tokens of a split's field as the shards hold them: [examples] arrays."""
  from jaxformer import shards
  return [np.asarray(x) for x in shards.TokenStream(ddir, split, field, manifest).documents()]


def expected_tokens(cfg, path):
  """The ids each record of `path` gives under `cfg`'s template, rendered here independently of the shards."""
  tok = tokenizer_lib.ByteTokenizer()
  template = chat.load_template(cfg.data.chat_template, "byte", False)
  return [chat.encode_record(cfg, tok, template, r, w, False)[0] for w, r in chat.read_jsonl(path)]


def test_a_failed_prepare_is_prepared_again_not_reused(tmp_path):
  """Issue 34's scenario: a bad validation record after good training records is one line and writes no
  shard; the next run (fixed file, another template) prepares from scratch with its own template, never
  keeping the failed run's train shard (which it did, under a manifest naming the new template)."""
  good, val_bad, val_good = tmp_path / "good.jsonl", tmp_path / "val_bad.jsonl", tmp_path / "val_good.jsonl"
  write_jsonl(good, synthetic.reverse_words_records(20))
  write_jsonl(val_good, synthetic.reverse_words_records(3))
  write_jsonl(val_bad, synthetic.reverse_words_records(3) + [{"messages": [{"role": "user", "content": 5}]}])
  cfg = lambda *o: sft_config(tmp_path, f"data.chat_path={good}", *o)
  workdir, ddir = str(tmp_path / "run"), str(tmp_path / "run" / "data")
  with pytest.raises(UserError, match=rf"^{re.escape(str(val_bad))}:4: `messages\[0\]` needs a string `content`, got 5$"):
    chat.ensure_prepared(cfg(f"data.chat_val_path={val_bad}"), workdir, log=QUIET)
  assert not os.path.exists(os.path.join(ddir, "train"))  # every record is checked before a shard is written
  chatml = cfg(f"data.chat_val_path={val_good}", "data.chat_template=chatml")
  manifest = chat.ensure_prepared(chatml, workdir, log=QUIET)
  want = expected_tokens(chatml, str(good))
  got = shard_tokens(ddir, manifest)
  assert [g.tolist() for g in got] == [w.tolist() for w in want]
  assert manifest["chat"]["counts"]["train"]["tokens"] == sum(map(len, got)) == manifest["splits"]["train"]["tokens"]["text"]
  marker = os.path.join(ddir, "train", "shard-00000.json")
  written = os.stat(marker).st_mtime_ns
  assert chat.ensure_prepared(chatml, workdir, log=QUIET) == manifest and os.stat(marker).st_mtime_ns == written  # reused
  # An interrupted preparation (shards on disk, the manifest not complete) is prepared again, with this run's template.
  with open(os.path.join(ddir, "manifest.json")) as f:
    header = {**json.load(f), "complete": False}
  with open(os.path.join(ddir, "manifest.json"), "w") as f:
    json.dump(header, f)
  plain = cfg(f"data.chat_val_path={val_good}")
  manifest = chat.ensure_prepared(plain, workdir, log=QUIET)
  assert [g.tolist() for g in shard_tokens(ddir, manifest)] == [w.tolist() for w in expected_tokens(plain, str(good))]
  assert manifest["chat"]["settings"]["data.chat_template"] == "plain"


@pytest.mark.parametrize("change,key", [("data.chat_template=chatml", "data.chat_template"),
                                        ("data.loss_on=all", "data.loss_on"),
                                        ("content", "data.chat_path"),
                                        ("tokenizer", "tokenizer")])
def test_prepared_with_other_settings_is_one_line(tmp_path, change, key):
  """A complete manifest is reused only with the same template, data.loss_on, tokenizer and file content."""
  cfg = sft_config(tmp_path, records=synthetic.reverse_words_records(12))
  workdir = str(tmp_path / "run")
  chat.ensure_prepared(cfg, workdir, log=QUIET)
  overrides = []
  if change == "content":  # the same size and date, other text: only its sha256 tells
    path = tmp_path / "sft.jsonl"
    stat, text = os.stat(path), path.read_text()
    path.write_text(text.replace("reverse", "esrever", 1))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  elif change == "tokenizer":  # a char tokenizer file in place of the byte one
    tok_file = tmp_path / "tokenizer.json"
    tokenizer_lib.load_or_train_tokenizer("char", str(tok_file), ["Assistant: User reverse"], None)
    overrides += ["data.tokenizer=char", f"data.tokenizer_path={tok_file}"]
  else:
    overrides.append(change)
  with pytest.raises(UserError, match=rf"was prepared with other fine-tuning data or settings \({re.escape(key)}: ") as e:
    chat.ensure_prepared(sft_config(tmp_path, *overrides), workdir, log=QUIET)
  assert "\n" not in str(e.value)


def test_two_runs_preparing_one_folder_wait_for_each_other(tmp_path):
  """chat.ensure_prepared takes the data folder's lock (pretraining's): held elsewhere, it waits."""
  import threading
  from jaxformer import prepare
  cfg = sft_config(tmp_path, records=synthetic.reverse_words_records(12))
  ddir = tmp_path / "run" / "data"
  ddir.mkdir(parents=True)
  done = []
  with prepare.locked(str(ddir)):
    t = threading.Thread(target=lambda: done.append(chat.ensure_prepared(cfg, str(tmp_path / "run"), log=QUIET)))
    t.start()
    t.join(0.5)
    assert not done and not (ddir / "manifest.json").exists()
  t.join(30)
  assert done and done[0]["complete"]


USER = [{"role": "user", "content": "hi"}]
BAD_SFT = [  # (record, what the line says), SFT
    ("hi", "expected a JSON object"),
    ({"messages": "hi"}, r"`messages` must be a list of"),
    ({"messages": []}, r"`messages` is empty"),
    ({"messages": ["hi"]}, r"`messages\[0\]` must be a \{\"role\", \"content\"\} object, got \"hi\""),
    ({"messages": [{"role": "user"}]}, r"`messages\[0\]` needs a string `content`, it has none"),
    ({"messages": [{"content": "x"}]}, r"`messages\[0\]` needs a string `role`"),
    ({"messages": USER + [{"role": "assistant", "content": 5}]}, r"`messages\[1\]` needs a string `content`, got 5"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, r"`messages\[0\]` needs a string `role`, got \[\"user\"\]"),
    ({"prompt": USER, "completion": [{"role": "assistant", "content": 5}]}, r"`completion\[0\]` needs a string `content`"),
    ({"prompt": USER, "completion": ["hello"]}, r"`completion\[0\]` must be a \{\"role\", \"content\"\} object"),
    ({"prompt": USER, "completion": []}, r"`completion` is empty"),  # not the template's fault
    ({"prompt": [], "completion": [{"role": "assistant", "content": "a"}]}, r"`prompt` is empty"),
    ({"prompt": [5], "completion": [{"role": "assistant", "content": "a"}]}, r"`prompt\[0\]` must be a"),
    ({"prompt": "a", "completion": 5}, "must both be strings or both message lists"),
    ({"prompt": USER, "completion": "a"}, "must both be strings or both message lists"),
    ({"prompt": "a"}, "a record needs `messages` or `prompt` and `completion`"),
]
BAD_DPO = [  # DPO
    ({"prompt": USER, "chosen": 5, "rejected": "a"}, r"`chosen` must be a string or a list of messages, got 5"),
    ({"prompt": USER, "chosen": "a", "rejected": [{"role": "assistant"}]}, r"`rejected\[0\]` needs a string `content`"),
    ({"prompt": USER, "chosen": [], "rejected": "a"}, r"`chosen` is empty"),
    ({"prompt": USER, "chosen": ["a"], "rejected": "a"}, r"`chosen\[0\]` must be a"),
    ({"prompt": [{"role": "user", "content": None}], "chosen": "a", "rejected": "b"}, r"`prompt\[0\]` needs a string `content`"),
    ({"prompt": "a", "chosen": ["x"], "rejected": "b"}, r"`prompt` is a string, so `chosen` must be one too"),
    ({"prompt": "a", "chosen": "x", "rejected": 5}, r"`prompt` is a string, so `rejected` must be one too"),
    ({"prompt": 5, "chosen": "a", "rejected": "b"}, r"`prompt` must be a string or a list of messages"),
    ({"prompt": "a", "chosen": "b"}, r"a preference record needs `prompt`, `chosen` and `rejected` \(keys: prompt, chosen\)"),
    ([1, 2], "a preference record needs"),
]


@pytest.mark.parametrize("objective,record,message", [("lm", r, m) for r, m in BAD_SFT] + [("dpo", r, m) for r, m in BAD_DPO],
                         ids=[f"sft{k}" for k in range(len(BAD_SFT))] + [f"dpo{k}" for k in range(len(BAD_DPO))])
def test_every_malformed_record_is_one_line_with_its_file_and_line(tmp_path, objective, record, message):
  """Each record shape SFT and DPO read: a bad one is a UserError (the CLIs' one line, exit 2), naming the
  file and line, never a traceback (`"chosen": 5` was a TypeError, exit 1)."""
  good = (synthetic.reverse_words_preferences(2) if objective == "dpo" else synthetic.reverse_words_records(2))
  path = tmp_path / "chats.jsonl"
  write_jsonl(path, good)
  with open(path, "a") as f:
    f.write("\n" + json.dumps(record) + "\n")  # a blank line 3 still counts: the record is line 4
  cfg = sft_config(tmp_path, f"data.chat_path={path}", f"train.objective={objective}")
  with pytest.raises(UserError) as e:
    chat.ensure_prepared(cfg, str(tmp_path / "run"), log=QUIET)
  assert re.fullmatch(rf"{re.escape(str(path))}:4: .*{message}.*", str(e.value)), str(e.value)


def test_a_bad_dpo_answer_exits_2_with_one_line(tmp_path, capsys):
  """The issue's record through train.py's CLI: exit 2 and one line naming file:line (was exit 1, a TypeError)."""
  path = tmp_path / "prefs.jsonl"
  write_jsonl(path, synthetic.reverse_words_preferences(1) + [{"prompt": USER, "chosen": 5, "rejected": "a"}])
  with pytest.raises(SystemExit) as exit_info:
    train.main(["--config", "gpt2_tiny", "--workdir", str(tmp_path / "run"), "data.tokenizer=byte", "model.vocab_size=259",
                "data.chat_template=plain", "model.num_layers=1", "train.objective=dpo", "train.dpo_from_scratch=true",
                f"data.chat_path={path}"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err == f"error: {path}:2: `chosen` must be a string or a list of messages, got 5\n"


def test_a_missing_val_file_is_named_by_its_setting(tmp_path):
  cfg = sft_config(tmp_path, f"data.chat_val_path={tmp_path / 'nope_val.jsonl'}")
  with pytest.raises(UserError, match=rf"^data\.chat_val_path={re.escape(str(tmp_path / 'nope_val.jsonl'))}: file not found$"):
    chat.ensure_prepared(cfg, str(tmp_path / "run"), log=QUIET)
