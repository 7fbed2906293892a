"""Command lines: dotted overrides are accepted before, between and after the flags."""

import json
import os

import pytest

from conftest import TINY_OVERRIDES
from jaxformer import evaluate
from jaxformer import generate
from jaxformer import inspect as inspect_lib
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
  with pytest.raises(UserError, match="decode.* and data.* overrides only"):
    evaluate.load_run(workdir, log=lambda *a: None, overrides=["model.d_model=8"])
