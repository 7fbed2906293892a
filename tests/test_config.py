"""Tests for jaxformer.config: recipes, dotted overrides, errors, serialization, CLI errors."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxformer import config as config_lib
from jaxformer.config import Config, UserError, apply_override, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPES = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if not p.stem.startswith("_"))


def test_available_configs_lists_the_directory():
  assert RECIPES and config_lib.available_configs() == RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_every_config_loads_and_round_trips(name):
  cfg = load_config(name)
  assert isinstance(cfg, Config) and cfg.name == name
  assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg
  assert config_lib.from_dict(json.loads(config_lib.to_json(cfg))) == cfg


def test_overrides_set_nested_fields_with_their_types():
  base = load_config("tiny_encdec")
  cfg = load_config("tiny_encdec", ["model.num_layers=3", "model.num_kv_heads=2", "model.use_bias=false",
                                    "optim.label_smoothing=0.25", "optim.learning_rate=2",
                                    "data.hub_name=wmt16", "train.num_steps=1_000"])
  assert type(cfg.model.num_layers) is int and cfg.model.num_layers == 3
  assert type(cfg.model.num_kv_heads) is int and cfg.model.num_kv_heads == 2
  assert cfg.model.use_bias is False
  assert type(cfg.optim.label_smoothing) is float and cfg.optim.label_smoothing == 0.25
  assert type(cfg.optim.learning_rate) is float and cfg.optim.learning_rate == 2.0
  assert cfg.data.hub_name == "wmt16" and cfg.train.num_steps == 1000
  # Everything else is untouched, and the original is not mutated (frozen).
  changed = {("model", "num_layers"), ("model", "num_kv_heads"), ("model", "use_bias"),
             ("optim", "label_smoothing"), ("optim", "learning_rate"), ("data", "hub_name"),
             ("train", "num_steps")}
  for section in ("model", "data", "optim", "train", "mesh", "decode"):
    for f in dataclasses.fields(getattr(cfg, section)):
      if (section, f.name) not in changed:
        assert getattr(getattr(cfg, section), f.name) == getattr(getattr(base, section), f.name)
  assert base.model.num_layers == 2 and base.model.use_bias is True
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.model.num_layers = 5


def test_optional_fields_accept_none():
  cfg = load_config("llama_tiny", ["model.num_kv_heads=none"])
  assert cfg.model.num_kv_heads is None and cfg.model.kv_heads == cfg.model.num_heads
  assert apply_override(cfg, "model.head_dim=Null").model.head_dim is None
  assert apply_override(cfg, "model.use_bias=1").model.use_bias is True


def test_replace_takes_dotted_keys():
  cfg = config_lib.replace(Config(), name="x", **{"model.d_model": 64, "train.seed": 3})
  assert (cfg.name, cfg.model.d_model, cfg.train.seed) == ("x", 64, 3)
  assert cfg.model.num_heads == Config().model.num_heads


@pytest.mark.parametrize("override,suggestion", [
    ("model.num_layer=2", "model.num_layers"),
    ("model.d_modle=64", "model.d_model"),
    ("optim.warmup=10", "optim.warmup_steps"),
    ("num_layers=2", "model.num_layers"),  # a bare field name: searched in every section
])
def test_unknown_key_names_the_closest(override, suggestion):
  with pytest.raises(UserError, match=f"did you mean '{suggestion}'"):
    load_config("tiny_encdec", [override])


@pytest.mark.parametrize("override,expected", [
    ("model.num_layers=two", "expected int"),
    ("model.d_model=1.5", "expected int"),
    ("model.use_bias=maybe", "expected bool"),
    ("optim.learning_rate=fast", "expected float"),
    ("model.num_layers=none", "expected int"),  # not Optional
    ("model=3", "is a section"),
    ("model.d_model.x=3", "is a field, not a section"),
    ("model.num_layers", "section.field=value"),
])
def test_bad_values_fail_clearly(override, expected):
  with pytest.raises(UserError, match=expected):
    load_config("tiny_encdec", [override])


@pytest.mark.parametrize("override,expected", [
    ("model.num_heads=3", "divisible"),
    ("model.num_kv_heads=3", "multiple"),
    ("model.activation=tanh", "choose one of"),
    ("data.task=lm", "needs model.arch=decoder_only"),
    ("train.nan_policy=ignore", "skip or stop"),
    ("train.max_skipped_steps=-1", r"must be 0 \(never stop\) or more"),
    ("train.lease_timeout_s=0", "must be positive"),
    ("model.attention_impl=cudnn", "needs model.dtype=bfloat16"),
    ("model.attention_impl=flash", "choose one of auto, einsum, tiled"),
])
def test_inconsistent_configs_are_rejected(override, expected):
  with pytest.raises(UserError, match=expected):
    load_config("tiny_encdec", [override])


def test_attention_kernels_for_another_backend_are_a_one_line_error_at_setup():
  """splash needs a TPU, cudnn a GPU: said before anything compiles (train.setup calls this)."""
  from jaxformer import config  # pylint: disable=g-import-not-at-top
  splash = load_config("tiny_encdec", ["model.attention_impl=splash"]).model
  cudnn = load_config("tiny_encdec", ["model.attention_impl=cudnn", "model.dtype=bfloat16"]).model
  with pytest.raises(UserError, match="runs on TPU only, and this program runs on cpu"):
    config.check_backend(splash, "cpu")
  with pytest.raises(UserError, match="runs on GPU only"):
    config.check_backend(cudnn, "tpu")
  config.check_backend(splash, "tpu")
  config.check_backend(cudnn, "gpu")
  config.check_backend(load_config("tiny_encdec", ["model.attention_impl=tiled"]).model, "cpu")


def test_unknown_config_name_suggests_the_closest():
  with pytest.raises(UserError, match="did you mean 'tiny_encdec'") as e:
    load_config("tiny_encdc")
  assert "available:" in str(e.value) and "gpt2_tiny" in str(e.value)


def test_from_dict_ignores_unknown_keys():
  d = config_lib.to_dict(load_config("gpt2_tiny"))
  d["model"]["removed_option"] = 1
  d["extra_section"] = {"x": 1}
  assert config_lib.from_dict(d) == load_config("gpt2_tiny")


def test_cli_unknown_config_is_one_line_exit_2(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "nope",
                         "--workdir", str(tmp_path / "w")],
                        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: unknown config 'nope'"), proc.stderr
  assert "Traceback" not in proc.stderr + proc.stdout
  assert not (tmp_path / "w").exists()
