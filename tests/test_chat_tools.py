"""Using a fine-tuned chat model: eval.py's perplexity of an SFT run, `generate --chat`, and the chat
template `convert --to-hf` carries (rendered here as transformers renders it, without transformers)."""

import json
import os
import re

import jax
import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizerFile

from jaxformer import chat, convert, data as data_lib, decode, evaluate, generate, shards, synthetic, tasks, train
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.config import load_config

QUIET = lambda *a, **k: None
HERE = os.path.dirname(os.path.abspath(__file__))
CHAT_FIXTURES = os.path.join(HERE, "fixtures", "chat")
GPT2_FIXTURE = os.path.join(HERE, "fixtures", "hf", "gpt2")


def write_jsonl(path, records):
  with open(path, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records))


def sft_records(directory):
  """(train.jsonl, val.jsonl): 50 and 10 generated "reverse these words" chats."""
  records = synthetic.reverse_words_records(60)
  paths = os.path.join(directory, "train.jsonl"), os.path.join(directory, "val.jsonl")
  write_jsonl(paths[0], records[:50])
  write_jsonl(paths[1], records[50:])
  return paths


LLAMA3_TEMPLATE = os.path.join(CHAT_FIXTURES, "tokenizer_config.json")
HF_TOKENIZER = ("data.tokenizer=hf", f"data.tokenizer_path={CHAT_FIXTURES}/tokenizer.json", "model.vocab_size=338",
                "model.bos_id=0", "model.eos_id=1", "model.pad_id=1")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
  """One SFT run for every test here: a 1-layer gpt2_tiny on the chat fixture's tokenizer.json with Llama 3's
  template from a tokenizer_config.json (BOS <|begin_of_text|>, EOS <|end_of_text|>, turns ending in
  <|eot_id|>), held-out chats in data.chat_val_path; 40 steps at a high learning rate so that its answers
  are not one repeated token."""
  root = str(tmp_path_factory.mktemp("sft"))
  train_path, val_path = sft_records(root)
  cfg = load_config("gpt2_tiny", [*HF_TOKENIZER, f"data.chat_template={LLAMA3_TEMPLATE}", "model.num_layers=1", "data.block_size=64",
                                  "data.batch_size=4", "train.num_steps=40", "optim.learning_rate=1e-2",
                                  "train.eval_every=40", "train.checkpoint_every=40", "train.sample_every_eval=false",
                                  f"data.chat_path={train_path}", f"data.chat_val_path={val_path}"])
  workdir = os.path.join(root, "w")
  train.train_and_evaluate(cfg, workdir, log=QUIET)
  return workdir, val_path


def logged(workdir, key):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r[key] for r in map(json.loads, f) if key in r]


def one_line_error(capsys, fn, argv):
  with pytest.raises(SystemExit) as e:
    fn(argv)
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and "\n" not in err and "Traceback" not in err, err
  return err


# ----------------------------------------------------------------------------- eval.py (item 3)


def test_eval_of_an_sft_run_is_the_masked_nll_of_its_held_out_chats(sft_run, capsys):
  """The default: the val_nll the training loop logged, and by hand: each held-out chat alone through the
  model, -log p of the tokens its loss mask holds (the assistant's answer and EOS), summed over all."""
  workdir, val_path = sft_run
  result = evaluate.main(["--workdir", workdir])
  out = capsys.readouterr().out
  assert f"held-out chats ({val_path}, 10 examples)" in out and "masked NLL" in out, out
  assert result["val_nll"] == pytest.approx(logged(workdir, "val_nll")[-1], rel=1e-6)
  assert result["val_tokens"] == logged(workdir, "val_tokens")[-1]
  cfg, model, params, tok, _ = evaluate.load_run(workdir, log=QUIET)
  template, _ = generate.chat_template(cfg, workdir, tok)
  width = cfg.data.block_size
  forward = jax.jit(lambda x: model.apply({"params": params}, x))
  total, count = 0.0, 0
  for where, record in chat.read_jsonl(val_path):
    ids, mask = chat.encode_record(cfg, tok, template, record, where, True)
    ids, mask = ids[:width + 1], mask[:width + 1]  # an example keeps its first block_size + 1 tokens
    inputs = np.zeros((1, width), np.int32)
    inputs[0, :len(ids) - 1] = ids[:-1]  # (causal: the padding after it changes nothing before)
    logits = np.asarray(forward(inputs), np.float64)[0, :len(ids) - 1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    on = mask[1:] == 1  # a target is in the loss where its own mask is
    total -= np.take_along_axis(logp, ids[1:, None], -1)[on, 0].sum()
    count += int(on.sum())
  assert result["val_tokens"] == count
  assert result["val_nll"] == pytest.approx(total / count, rel=1e-5)


def test_eval_of_an_sft_run_scores_a_text_given_as_data_text_path(sft_run, tmp_path, capsys):
  """data.text_path on a fine-tuning run: that text's perplexity (read, as --text reads it), not the chat
  manifest read as a text source (a KeyError before)."""
  workdir, _ = sft_run
  text = tmp_path / "some.txt"
  text.write_text("the cat sat on the mat\nand the dog ran\n")
  by_override = evaluate.main(["--workdir", workdir, f"data.text_path={text}"])
  assert f"{text}:\nperplexity per token" in capsys.readouterr().out
  assert by_override == evaluate.main(["--workdir", workdir, "--text", str(text)])
  cfg, model, params, tok, _ = evaluate.load_run(workdir, log=QUIET)
  assert by_override == evaluate.perplexity(model, params, tok, text.read_text(), cfg.data.block_size)
  assert by_override["tokens"] == len(tok.encode(text.read_text())) - 1


def test_eval_of_an_sft_run_without_held_out_chats_is_one_line(sft_run, tmp_path, capsys):
  workdir, _ = sft_run
  err = one_line_error(capsys, evaluate.main, ["--workdir", workdir, f"data.data_dir={tmp_path / 'd'}",
                                               "data.chat_val_path=", "data.train_fraction=1.0"])
  assert "has no held-out chats to evaluate" in err and "data.train_fraction=1 held none out" in err, err
  assert "--text FILE" in err


def test_pretraining_on_a_data_dir_of_chat_shards_is_one_line(sft_run, tmp_path, capsys):
  """prepare's manifest check on the shards chat.ensure_prepared wrote: one line (a KeyError before)."""
  workdir, _ = sft_run
  text = tmp_path / "t.txt"
  text.write_text("some text\n" * 20)
  err = one_line_error(capsys, train.main, ["--config", "gpt2_tiny", "--workdir", str(tmp_path / "w"),
                                            f"data.data_dir={workdir}/data", *HF_TOKENIZER, f"data.text_path={text}"])
  assert "holds the fine-tuning shards of data.chat_path=" in err and "not" in err, err


# ----------------------------------------------------------------------------- generate --chat (item 13)


def test_a_chat_prompt_is_encoded_as_training_encoded_the_record(sft_run):
  """The generation prompt of a held-out chat's user turn = the stored example's tokens before its
  first loss token."""
  workdir, val_path = sft_run
  cfg, _, _, tok, _ = evaluate.load_run(workdir, log=QUIET)
  template, hf = generate.chat_template(cfg, workdir, tok)
  task = tasks.make_task(cfg, workdir, log=QUIET)
  ids, mask = task.streams["val"]["text"], task.streams["val"]["mask"]
  starts, lengths = data_lib.example_spans(ids)
  for k, (_, record) in enumerate(chat.read_jsonl(val_path)):
    stored = ids.read(starts[k], starts[k] + lengths[k]).tolist()
    stored_mask = mask.read(starts[k], starts[k] + lengths[k]).tolist()
    prompt = chat.prompt_ids(template, tok, record["messages"][:-1], cfg.data.add_bos, hf)
    assert stored[:len(prompt)] == prompt and not any(stored_mask[:len(prompt)]) and stored_mask[len(prompt)] == 1
    assert tok.tok.decode(prompt, skip_special_tokens=False).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_our_special_strings_in_a_chat_prompt_become_their_ids():
  """With our tokenizers a typed (or template-written) <|eos|> is the EOS id, as in training, not 7 bytes."""
  byte = tokenizer_lib.ByteTokenizer()
  plain = chat.load_template("plain", "byte", False)
  typed = chat.prompt_ids(plain, byte, [{"role": "user", "content": "a<|eos|>b"}], False, False)
  assert typed == byte.encode("User: a") + [byte.eos_id] + byte.encode("b\nAssistant: ")
  history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
  assert chat.prompt_ids(plain, byte, history, True, False) == (
      [byte.bos_id] + byte.encode("User: hi\nAssistant: yo") + [byte.eos_id] + byte.encode("User: ?\nAssistant: "))


def test_end_of_turn_ids_are_the_token_the_template_writes_after_the_answer():
  byte = tokenizer_lib.ByteTokenizer()
  for name in ("plain", "chatml"):  # the built-ins end an assistant turn in the model's EOS
    assert chat.end_of_turn_ids(chat.load_template(name, "byte", False), byte, False) == [byte.eos_id]
  hf_tok = tokenizer_lib.load_tokenizer(os.path.join(CHAT_FIXTURES, "tokenizer.json")).use_model_ids(1, 0, 1)
  llama3 = chat.load_template(LLAMA3_TEMPLATE, "", True)
  eot = hf_tok.tok.token_to_id("<|eot_id|>")
  assert chat.end_of_turn_ids(llama3, hf_tok, True) == sorted([1, eot])  # <|end_of_text|> and <|eot_id|>
  text_end = chat.ChatTemplate("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}",
                               {}, "newline")
  assert chat.end_of_turn_ids(text_end, byte, False) == [byte.eos_id]  # "\n" is text: never a stop


def test_generate_chat_answers_until_the_end_of_turn_and_prints_the_answer_only(sft_run, tmp_path, capsys,
                                                                                 monkeypatch):
  workdir, _ = sft_run
  cfg, model, params, tok, _ = evaluate.load_run(workdir, log=QUIET)
  template, hf = generate.chat_template(cfg, workdir, tok)
  conversation = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "reverse: a b"},
                  {"role": "assistant", "content": "b a"}, {"role": "user", "content": "reverse: cat dog"}]
  (tmp_path / "chat.json").write_text(json.dumps(conversation))
  calls = []
  real = decode.generate
  monkeypatch.setattr(decode, "generate", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
  # Sampled (seeded): a model this small answers greedily with one repeated token.
  argv = ["--workdir", workdir, "--temperature", "1", "--top-k", "0", "--top-p", "1", "--seed", "3",
          "--max-new-tokens", "6"]
  answers = generate.main([*argv, "--chat", "reverse: jam dog", "--chat", str(tmp_path / "chat.json")])
  out = capsys.readouterr().out
  (args, kwargs), = calls
  expected = [chat.prompt_ids(template, tok, [{"role": "user", "content": "reverse: jam dog"}], False, hf),
              chat.prompt_ids(template, tok, conversation, False, hf)]
  eot = tok.tok.token_to_id("<|eot_id|>")
  assert args[2] == expected and kwargs["eos_id"] == [tok.eos_id, eot]  # rendered prompts; stop at the turn's end
  sample = lambda prompts, **kw: np.asarray(real(model, params, prompts, 6, jax.random.PRNGKey(3), temperature=1.0,
                                                 top_k=0, top_p=1.0, **kw))
  free = sample(expected, eos_id=[-1])  # no stop: the same tokens up to where a stop would end a row
  until = lambda row, stops: next((i for i, t in enumerate(row) if t in stops), len(row))
  assert answers == [tok.decode(row[:until(row, [tok.eos_id, eot])]) for row in free.tolist()]
  assert out == "".join(f"--- {m!r}\n{a}\n" for m, a in zip(["reverse: jam dog", "reverse: cat dog"], answers))
  # A stop id ends the answer before it, and the rows stop there (PAD after): the first token of row 0
  # that is not one of the tokens before it plays the end-of-turn token.
  k = next(i for i in range(1, 6) if free[0, i] not in free[0, :i])
  stop = int(free[0, k])
  stopped = sample(expected, eos_id=[tok.eos_id, stop])  # (the same shapes: no second compile)
  assert stopped[0, :k + 1].tolist() == free[0, :k + 1].tolist() and not stopped[0, k + 1:].any()
  monkeypatch.setattr(chat, "end_of_turn_ids", lambda *a: [tok.eos_id, stop])
  answers = generate.main([*argv, "--chat", "reverse: jam dog", "--chat", str(tmp_path / "chat.json")])
  assert answers[0] == tok.decode(free[0, :k])
  assert capsys.readouterr().out.startswith(f"--- 'reverse: jam dog'\n{answers[0]}\n--- ")


def test_generate_chat_mistakes_are_one_line(sft_run, tmp_path, capsys):
  workdir, _ = sft_run
  bad = tmp_path / "bad.json"
  bad.write_text('[{"role": "user", "content": 5}]')
  err = one_line_error(capsys, generate.main, ["--workdir", workdir, "--chat", str(bad)])
  assert str(bad) in err and "`messages[0]` needs a string `content`, got 5" in err, err
  err = one_line_error(capsys, generate.main, ["--workdir", workdir, "--chat", "hi", "--prompt", "x"])
  assert "--chat" in err and "--prompt" in err


# ----------------------------------------------------------------------------- convert --to-hf (item 17)


def hf_render(config, messages, add_generation_prompt):
  """transformers' apply_chat_template(tokenize=False) of a tokenizer_config.json, re-implemented here
  (transformers 5.x `_compile_jinja_template` and `render_jinja_template`): a sandboxed environment with
  trim_blocks, lstrip_blocks and loop controls, `raise_exception`, every special-token string."""
  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
  env.globals["raise_exception"] = raise_exception
  special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in config}
  return env.from_string(config["chat_template"]).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                         **special)


@pytest.fixture(scope="module")
def exported(sft_run, tmp_path_factory):
  """The SFT run exported by `convert --to-hf` (its tokenizer_config.json, parsed)."""
  workdir, _ = sft_run
  out = str(tmp_path_factory.mktemp("hf") / "out")
  convert.main(["--to-hf", workdir, "--out", out])
  with open(os.path.join(out, "tokenizer_config.json")) as f:
    return out, json.load(f)


def test_to_hf_carries_the_chat_template_the_run_trained_with(sft_run, exported):
  """transformers' rendering of the export, tokenized as apply_chat_template tokenizes (the exported
  tokenizer.json, no special tokens added), gives the ids training stored for each held-out chat and,
  with the generation prompt, the ids `generate --chat` feeds; the text is the one training rendered."""
  workdir, val_path = sft_run
  out, config = exported
  with open(LLAMA3_TEMPLATE) as f:
    trained = json.load(f)
  assert config["chat_template"] == trained["chat_template"]
  assert config["bos_token"] == "<|begin_of_text|>" and config["eos_token"] == "<|eot_id|>"  # the template's strings
  hf_tok = HFTokenizerFile.from_file(os.path.join(out, "tokenizer.json"))
  encode = lambda text: hf_tok.encode(text, add_special_tokens=False).ids
  cfg, _, _, tok, _ = evaluate.load_run(workdir, log=QUIET)
  template, hf = generate.chat_template(cfg, workdir, tok)
  ddir = os.path.join(workdir, "data")
  ids = shards.TokenStream(ddir, "val", "text", shards.read_manifest(ddir))
  starts, lengths = data_lib.example_spans(ids)
  for k, (_, record) in enumerate(chat.read_jsonl(val_path)):
    messages = record["messages"]
    text = hf_render(config, messages, False)
    assert text == template.render(messages)
    assert encode(text) == ids.read(starts[k], starts[k] + lengths[k]).tolist()
    assert encode(hf_render(config, messages[:-1], True)) == chat.prompt_ids(template, tok, messages[:-1],
                                                                             cfg.data.add_bos, hf)


def test_an_exported_builtin_template_renders_the_model_ids_training_wrote():
  """A built-in template with a tokenizer.json (GPT-2's) and data.add_bos: our <|bos|>/<|eos|>
  placeholders become the strings of the model's ids (<|endoftext|>), and the BOS training put before
  each record (the template writes none) starts the exported template; transformers' rendering then
  tokenizes to the ids `chat.encode_record` stores."""
  tok = tokenizer_lib.load_tokenizer(os.path.join(GPT2_FIXTURE, "tokenizer.json")).use_model_ids(380, 380, 380)
  cfg = load_config("gpt2_tiny", ["data.add_bos=true", "data.chat_template=plain"])
  plain = chat.load_template("plain", "", True)
  text, special = chat.hf_template(plain, tok, True, True, tok.tok.id_to_token)
  assert special == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
  config = {"chat_template": text, **special}
  encode = lambda t: tok.tok.encode(t, add_special_tokens=False).ids
  for record in synthetic.reverse_words_records(5):
    messages = record["messages"]
    stored, _ = chat.encode_record(cfg, tok, plain, record, "x", True)
    rendered = hf_render(config, messages, False)
    assert rendered == "<|endoftext|>" + plain.render(messages).replace(chat.EOS_TEXT, "<|endoftext|>")
    prompt = hf_render(config, messages[:-1], True)
    assert encode(prompt) == chat.prompt_ids(plain, tok, messages[:-1], True, True) == stored[:len(encode(prompt))].tolist()
    # (the answer is a piece of its own in training: tokenized after the prompt, as generation continues it)
    assert encode(prompt) + encode(rendered[len(prompt):]) == stored.tolist()
  text, _ = chat.hf_template(plain, tok, True, False, tok.tok.id_to_token)
  assert text == plain.text  # without data.add_bos: the built-in template (it writes eos_token, no placeholder)


def test_to_hf_refuses_a_chat_template_changed_since_training(sft_run, tmp_path, capsys):
  workdir, _ = sft_run
  with open(LLAMA3_TEMPLATE) as f:
    config = json.load(f)
  changed = tmp_path / "tokenizer_config.json"
  changed.write_text(json.dumps({**config, "chat_template": config["chat_template"].replace("trim", "lower")}))
  saved = os.path.join(workdir, "config.json")
  with open(saved) as f:
    original = f.read()
  try:
    with open(saved, "w") as f:
      f.write(original.replace(LLAMA3_TEMPLATE, str(changed)))
    err = one_line_error(capsys, convert.main, ["--to-hf", workdir, "--out", str(tmp_path / "hf")])
  finally:
    with open(saved, "w") as f:
      f.write(original)
  assert "is not the one" in err and "trained with" in err, err
  assert not os.path.exists(tmp_path / "hf")  # refused before anything was written
