"""Command lines: dotted overrides are accepted before, between and after the flags."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_OVERRIDES
from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import decode
from jaxformer import evaluate
from jaxformer import generate
from jaxformer import inspect as inspect_lib
from jaxformer import model as model_lib
from jaxformer import tokenizer as tokenizer_lib
from jaxformer import train
from jaxformer.errors import UserError

# The same command in every order a user might type it (the report: the last failed).
TRAIN_ORDERS = [
    ["--config", "gpt2_tiny", "--workdir", "runs/x", "data.batch_size=16", "mesh.data=1"],
    ["data.batch_size=16", "mesh.data=1", "--config", "gpt2_tiny", "--workdir", "runs/x"],
    ["--config", "gpt2_tiny", "data.batch_size=16", "--workdir", "runs/x", "mesh.data=1"],
    ["data.batch_size=16", "--config", "gpt2_tiny", "mesh.data=1", "--workdir", "runs/x"],
]


@pytest.mark.parametrize("argv", TRAIN_ORDERS)
def test_train_accepts_overrides_anywhere(argv):
  args = train.parse_args(argv)
  assert (args.config, args.workdir, args.overrides) == ("gpt2_tiny", "runs/x", ["data.batch_size=16", "mesh.data=1"])


@pytest.mark.parametrize("argv", [
    ["--workdir", "w", "--split", "dev", "decode.alpha=1.0", "--beam", "2", "decode.max_extra_len=9"],
    ["decode.alpha=1.0", "--workdir", "w", "decode.max_extra_len=9", "--split", "dev", "--beam", "2"],
    ["--workdir", "w", "--split", "dev", "--beam", "2", "decode.alpha=1.0", "decode.max_extra_len=9"],
])
def test_eval_accepts_overrides_anywhere(argv):
  args = evaluate.parse_args(argv)
  assert (args.workdir, args.split, args.beam) == ("w", "dev", 2)
  assert args.overrides == ["decode.alpha=1.0", "decode.max_extra_len=9"]


@pytest.mark.parametrize("argv", [
    ["--workdir", "w", "--prompt", "a", "decode.max_new_tokens=5", "--prompt", "b"],
    ["decode.max_new_tokens=5", "--workdir", "w", "--prompt", "a", "--prompt", "b"],
    ["--prompt", "a", "--prompt", "b", "--workdir", "w", "decode.max_new_tokens=5"],
])
def test_generate_accepts_overrides_anywhere(argv):
  args = generate.parse_args(argv)
  assert (args.workdir, args.prompt, args.overrides) == ("w", ["a", "b"], ["decode.max_new_tokens=5"])


def test_inspect_accepts_overrides_after_flags(capsys):
  inspect_lib.main(["--config", "gpt2_tiny", "--dtype", "float32", "model.num_layers=1", "--batch", "2",
                    "model.d_model=64"])
  out = capsys.readouterr().out
  assert out.startswith("gpt2_tiny: decoder_only, 1 layers, d_model 64")


def test_train_main_applies_an_override_after_workdir(tmp_path):
  """The issue's failing shape end to end: an override after --workdir reaches the run's config."""
  workdir = str(tmp_path / "run")
  train.main(["--config", "tiny_encdec", *TINY_OVERRIDES[:2], "--workdir", workdir, "train.num_steps=2",
              "train.log_every=1", "train.checkpoint_every=2", "model.num_layers=1"])
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  assert saved["train"]["num_steps"] == 2 and saved["model"]["num_layers"] == 1


def test_eval_overrides_are_decode_and_data_only(tiny_run):
  workdir = tiny_run[0]
  cfg = evaluate.load_run(workdir, log=lambda *a: None, overrides=["decode.alpha=1.5"])[0]
  assert cfg.decode.alpha == 1.5
  with pytest.raises(UserError, match="decode.*, data.* and model.quant_activations overrides only"):
    evaluate.load_run(workdir, log=lambda *a: None, overrides=["model.d_model=8"])


@pytest.fixture(scope="module")
def lm_workdir(tmp_path_factory):
  """A decoder-only workdir made by hand (no training): gpt2_tiny with random params, a char tokenizer."""
  workdir = tmp_path_factory.mktemp("lm_run")
  tok = tokenizer_lib.CharTokenizer.train(["First Citizen:\nBefore we proceed any further, hear me speak.\n"])
  cfg = config_lib.load_config("gpt2_tiny", [f"model.vocab_size={tok.vocab_size}"])
  tok.save(str(workdir / "tokenizer.json"))
  model = model_lib.build_model(cfg.model)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
  rng = np.random.default_rng(0)  # random params (std 0.3) without compiling an init
  params = jax.tree.map(lambda s: np.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), nn.unbox(shapes))
  checkpoint_lib.save_params(str(workdir), params, step=1)
  (workdir / "config.json").write_text(config_lib.to_json(cfg))
  return str(workdir)


def test_decode_overrides_reach_generate(lm_workdir, monkeypatch):
  """`decode.temperature/top_k/top_p/max_new_tokens` of the run's config (and their overrides) are what
  generate samples with; a flag, when given, wins (the issue: decode.temperature=0 still sampled at 0.8)."""
  run = lambda *argv: generate.main(["--workdir", lm_workdir, "--prompt", "First", *argv])
  greedy = run("decode.temperature=0", "decode.max_new_tokens=12")  # real decoding, one compile
  assert greedy == run("--temperature", "0", "--max-new-tokens", "12")  # the flags: the same greedy tokens
  seen = []

  def spy(model, params, prompts, max_new_tokens, rng, **kwargs):  # records what generate was asked for
    seen.append((max_new_tokens, kwargs["temperature"], kwargs["top_k"], kwargs["top_p"]))
    return np.zeros((len(prompts), max_new_tokens), np.int32)

  monkeypatch.setattr(decode, "generate", spy)
  defaults = config_lib.DecodeConfig()
  run()
  assert seen[-1] == (defaults.max_new_tokens, defaults.temperature, defaults.top_k, defaults.top_p)  # not 0.8
  run("decode.temperature=0", "decode.top_k=3", "decode.top_p=0.5", "decode.max_new_tokens=12")
  assert seen[-1] == (12, 0.0, 3, 0.5)
  run("decode.temperature=0", "--temperature", "0.7", "decode.top_k=2", "--top-k", "5", "decode.max_new_tokens=4",
      "--top-p", "0.9", "--max-new-tokens", "7")
  assert seen[-1] == (7, 0.7, 5, 0.9)  # flags override the config
  with pytest.raises(SystemExit):  # a flag gets the range check of its decode.* field: one line, exit 2
    run("--top-p", "0")
