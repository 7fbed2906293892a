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
    ("train.host_timeout_s=1", "must be at least 2"),
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
  # On the wrong platform the platform is the one line, whatever the dtype; on a GPU, the dtype.
  cudnn_f32 = load_config("tiny_encdec", ["model.attention_impl=cudnn"]).model
  with pytest.raises(UserError, match="runs on GPU only, and this program runs on cpu"):
    config.check_backend(cudnn_f32, "cpu")
  with pytest.raises(UserError, match="needs model.dtype=bfloat16"):
    config.check_backend(cudnn_f32, "gpu")
  config.check_backend(load_config("tiny_encdec", ["model.attention_impl=tiled"]).model, "cpu")


def test_unknown_config_name_suggests_the_closest():
  with pytest.raises(UserError, match="did you mean 'tiny_encdec'") as e:
    load_config("tiny_encdc")
  assert "available:" in str(e.value) and "gpt2_tiny" in str(e.value)


def test_a_workdirs_saved_config_skips_unknown_keys_with_a_warning(tmp_path):
  """eval/generate/train.init_from read WORKDIR/config.json leniently: a run saved by another
  version still loads, and each skipped key is named (never silently dropped)."""
  d = config_lib.to_dict(load_config("gpt2_tiny"))
  d["model"]["removed_option"] = 1
  d["extra_section"] = {"x": 1}
  (tmp_path / "config.json").write_text(json.dumps(d))
  warnings = []
  assert config_lib.load_saved_config(tmp_path / "config.json", warn=warnings.append) == load_config("gpt2_tiny")
  assert len(warnings) == 2 and "'model.removed_option'" in warnings[0] and "'extra_section'" in warnings[1]


def test_a_removed_field_is_skipped_with_a_warning_even_in_a_user_config(monkeypatch):
  monkeypatch.setitem(config_lib.REMOVED_FIELDS, "model.old_knob", "replaced by model.new_knob")
  d = config_lib.to_dict(load_config("gpt2_tiny"))
  d["model"]["old_knob"] = 3
  warnings = []
  assert config_lib.from_dict(d, warn=warnings.append) == load_config("gpt2_tiny")
  assert warnings and "replaced by model.new_knob" in warnings[0]


def _saved(tmp_path, section, field, value, name="gpt2_tiny"):
  d = config_lib.to_dict(load_config(name))
  d[section][field] = value
  path = tmp_path / "config.json"
  path.write_text(json.dumps(d))
  return str(path)


@pytest.mark.parametrize("section,field,value,expected", [
    ("model", "num_layer", 2, r"unknown config key 'model.num_layer' \(did you mean 'model.num_layers'\?\)"),
    ("optim", "warmup", 10, "did you mean 'optim.warmup_steps'"),
    ("model", "num_layers", "2", r"model.num_layers='2' \(str\): expected int"),
    ("model", "num_layers", 2.5, "expected int"),
    ("model", "use_bias", 1, "expected bool"),
    ("model", "num_kv_heads", "none", "expected int or None"),
    ("train", "num_steps", True, "expected int"),  # a bool is not a count
    ("optim", "learning_rate", "fast", "expected float"),
    ("data", "text_path", None, "expected str"),
    ("train", "log_every", 0, "must be at least 1"),  # the same range checks as a recipe
])
def test_a_user_given_json_config_is_checked_like_a_recipe(tmp_path, section, field, value, expected):
  """`train.py --config runs/x/config.json`: unknown keys and wrong types are one-line errors."""
  with pytest.raises(UserError, match=expected):
    load_config(_saved(tmp_path, section, field, value))


def test_a_json_config_may_write_an_int_for_a_float(tmp_path):
  cfg = load_config(_saved(tmp_path, "optim", "learning_rate", 2))
  assert type(cfg.optim.learning_rate) is float and cfg.optim.learning_rate == 2.0


def test_a_json_config_section_must_be_an_object(tmp_path):
  d = config_lib.to_dict(load_config("gpt2_tiny"))
  d["model"] = 3
  (tmp_path / "bad.json").write_text(json.dumps(d))
  with pytest.raises(UserError, match="model must be a section"):
    load_config(str(tmp_path / "bad.json"))
  (tmp_path / "broken.json").write_text("{")
  with pytest.raises(UserError, match="is not valid JSON"):
    load_config(str(tmp_path / "broken.json"))


def test_a_recipe_with_a_wrongly_typed_field_is_refused(tmp_path):
  """Types are checked in `_validate`, so a .py recipe (dataclasses check nothing) is covered too."""
  (tmp_path / "r.py").write_text("from jaxformer import config\n"
                                 "def get_config():\n"
                                 "  return config.replace(config.load_config('gpt2_tiny'), **{'data.block_size': '32'})\n")
  with pytest.raises(UserError, match=r"data.block_size='32' \(str\): expected int"):
    load_config(str(tmp_path / "r.py"))


@pytest.mark.parametrize("name,overrides,expected", [
    ("gpt2_tiny", ["model.max_len=32", "data.block_size=64"],
     r"data.block_size=64 is longer than the learned-position table \(model.max_len=32\)"),
    ("tiny_encdec", ["model.position=learned", "model.max_len=16"],
     r"data.max_len=32 is longer than the learned-position table \(model.max_len=16\)"),
])
def test_lengths_past_a_learned_position_table_are_refused(name, overrides, expected):
  with pytest.raises(UserError, match=expected):
    load_config(name, overrides)


def test_lengths_within_the_table_or_other_positions_are_fine():
  assert load_config("gpt2_tiny", ["model.max_len=32", "data.block_size=32"]).data.block_size == 32
  assert load_config("gpt2_tiny", ["model.position=rope", "model.max_len=32", "data.block_size=64"])
  assert load_config("tiny_encdec", ["model.max_len=16"])  # sinusoidal: no table


# One bad value per numeric field that a run uses (ZeroDivisionError, NaN or a crash deep inside
# jit or the data pipeline before this check); see config._RANGES for every field's range.
BAD_NUMBERS = [
    ("train.log_every=0", "train.log_every=0 must be at least 1"),
    ("train.eval_every=0", "train.eval_every=0 must be at least 1"),
    ("train.checkpoint_every=0", "train.checkpoint_every=0 must be at least 1"),
    ("train.num_steps=0", "train.num_steps=0 must be at least 1"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints=0 must be at least 1"),
    ("train.steps_per_call=0", "train.steps_per_call=0 must be at least 1"),
    ("train.eval_batches=-1", "train.eval_batches=-1 must be 0"),
    ("train.seed=-1", "train.seed=-1 must be 0 or more"),
    ("train.max_minutes=-1", "train.max_minutes=-1.0 must be 0"),
    ("train.eval_bleu_sentences=-2", "must be 0 or more"),
    ("optim.grad_accum_steps=0", "optim.grad_accum_steps=0 must be at least 1"),
    ("optim.learning_rate=-1", "optim.learning_rate=-1.0 must be 0 or more"),
    ("optim.learning_rate=nan", "optim.learning_rate=nan must be 0 or more"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be 0 or more"),
    ("optim.warmup_steps=0", r"must be at least 1 with optim.schedule=rsqrt"),
    ("optim.b1=1", r"optim.b1=1.0 must be in \[0, 1\)"),
    ("optim.b2=1.5", r"optim.b2=1.5 must be in \[0, 1\)"),
    ("optim.eps=0", "optim.eps=0.0 must be positive"),
    ("optim.grad_clip=-1", "must be 0 \\(off\\) or more"),
    ("optim.label_smoothing=1", r"must be in \[0, 1\)"),
    ("data.batch_size=0", "data.batch_size=0 must be at least 1"),
    ("data.tokens_per_batch=0", "data.tokens_per_batch=0 must be at least 1"),
    ("data.batch_multiple=0", "data.batch_multiple=0 must be at least 1"),
    ("data.block_size=0", "data.block_size=0 must be at least 1"),
    ("data.max_len=1", "data.max_len=1 must be at least 2"),
    ("data.shard_tokens=0", "must be at least 1"),
    ("data.tokenizer_sample_docs=0", "must be at least 1"),
    ("data.synthetic_size=0", "must be at least 1"),
    ("model.vocab_size=0", "model.vocab_size=0 must be at least 1"),
    ("model.d_model=0", "model.d_model=0 must be at least 1"),
    ("model.num_heads=0", "model.num_heads=0 must be at least 1"),
    ("model.num_kv_heads=0", "model.num_kv_heads=0 must be at least 1"),
    ("model.head_dim=0", "model.head_dim=0 must be at least 1"),
    ("model.num_layers=0", "model.num_layers=0 must be at least 1"),
    ("model.num_encoder_layers=0", "must be at least 1"),
    ("model.d_ff=0", "model.d_ff=0 must be at least 1"),
    ("model.max_len=0", "model.max_len=0 must be at least 1"),
    ("model.norm_eps=0", "must be positive"),
    ("model.dropout_rate=1", r"model.dropout_rate=1.0 must be in \[0, 1\)"),
    ("model.attention_dropout_rate=-0.1", r"must be in \[0, 1\)"),
    ("model.init_std=-1", "must be 0 or more"),
    ("model.rope_theta=0", "must be positive"),
    ("model.rope_scaling_factor=0", "must be positive"),
    ("decode.beam_size=0", "decode.beam_size=0 must be at least 1"),
    ("decode.batch_size=0", "decode.batch_size=0 must be at least 1"),
    ("decode.max_new_tokens=0", "decode.max_new_tokens=0 must be at least 1"),
    ("decode.max_cache_len=0", "must be at least 1"),
    ("decode.max_extra_len=-1", "must be 0 or more"),
    ("decode.temperature=-0.5", r"decode.temperature=-0.5 must be 0 \(greedy\) or more"),
    ("decode.top_k=-1", "must be 0"),
    ("decode.top_p=0", r"decode.top_p=0.0 must be in \(0, 1\]"),
    ("decode.top_p=1.5", r"must be in \(0, 1\]"),
    ("decode.alpha=-1", "must be 0 or more"),
    ("mesh.data=0", r"mesh.data=0 must be at least 1, or -1"),
    ("mesh.fsdp=-2", "mesh.fsdp=-2 must be at least 1"),
]


@pytest.mark.parametrize("override,expected", BAD_NUMBERS)
def test_every_count_interval_and_rate_is_validated(override, expected):
  with pytest.raises(UserError, match=expected):
    load_config("tiny_encdec", [override])


def test_every_numeric_field_has_a_decided_range():
  """A new int/float field gets a range in config._RANGES (or a check of its own, listed here)."""
  own_check = {"model.pad_id", "model.bos_id", "model.eos_id", "model.logits_chunk", "data.train_fraction",
               "data.num_proc", "train.max_skipped_steps", "train.lease_timeout_s",
               "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.expert"}  # num_proc: any value (<= 1: in-process)
  ranged = {f"{section}.{rule[0]}" for section, rules in config_lib._RANGES.items() for rule in rules}
  import typing
  for section in ("model", "data", "optim", "train", "mesh", "decode"):
    for name, hint in typing.get_type_hints(type(getattr(Config(), section))).items():
      if set(typing.get_args(hint) or (hint,)) & {int, float}:
        assert f"{section}.{name}" in ranged | own_check, f"{section}.{name} has no decided range"


@pytest.mark.parametrize("override", ["train.eval_batches=0", "optim.grad_clip=0", "decode.temperature=0",
                                      "decode.top_k=0", "decode.top_p=1", "decode.max_extra_len=0",
                                      "mesh.data=-1", "train.max_minutes=0", "model.num_kv_heads=none"])
def test_boundary_values_that_mean_something_are_accepted(override):
  load_config("tiny_encdec", [override])


def test_the_optimizer_is_validated():
  with pytest.raises(UserError, match="optim.optimizer='sgd': choose adam or adamw"):
    load_config("tiny_encdec", ["optim.optimizer=sgd"])
  with pytest.raises(UserError, match=r"optim.weight_decay=0.1 needs optim.optimizer=adamw"):
    load_config("tiny_encdec", ["optim.weight_decay=0.1"])  # tiny_encdec: adam
  assert load_config("tiny_encdec", ["optim.optimizer=adamw", "optim.weight_decay=0.1"]).optim.weight_decay == 0.1


def test_cli_bad_interval_is_one_line_before_any_work(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "tiny_encdec",
                         "--workdir", str(tmp_path / "w"), "train.log_every=0"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip() == "error: train.log_every=0 must be at least 1 (steps)", proc.stderr
  assert not (tmp_path / "w").exists()


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
