"""One config system: frozen dataclasses, named recipes in `configs/`, dotted overrides.

A recipe is a file `configs/<name>.py` with a function `get_config() -> Config` (the
folder is installed as the package `jaxformer.configs`, so a wheel carries the recipes).
`load_config("wmt_base", ["model.num_layers=2"])` resolves it; an unknown key or a
value of the wrong type is a `UserError` naming the closest valid key.
"""

import dataclasses
import importlib.util
import json
import pathlib
import re
import types
import typing

import jaxformer.configs
from jaxformer.errors import UserError, closest

CONFIG_DIR = pathlib.Path(jaxformer.configs.__path__[0])


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture. Defaults are the paper's base model (Vaswani et al. 2017)."""
  arch: str = "encoder_decoder"     # encoder_decoder | decoder_only
  vocab_size: int = 37000
  pad_id: int = 0                   # padding: masks default to `ids != pad_id` (Marian: pad 58100)
  bos_id: int = 1                   # BOS / decoder start token (Marian: the pad token)
  eos_id: int = 2                   # end of sequence (Marian: 0)
  d_model: int = 512
  num_heads: int = 8
  num_kv_heads: int | None = None   # None -> num_heads (MHA); 1 -> MQA; else GQA
  head_dim: int | None = None       # None -> d_model // num_heads
  num_layers: int = 6               # decoder layers (and encoder layers by default)
  num_encoder_layers: int | None = None
  d_ff: int = 2048
  activation: str = "relu"          # relu | gelu (tanh approx.) | gelu_exact (erf) | silu (= swish: OPUS-MT) | swiglu
  norm: str = "layernorm"           # layernorm | rmsnorm
  norm_position: str = "post"       # post (paper) | pre
  norm_eps: float = 1e-6
  use_bias: bool = True             # biases in attention and FFN projections
  position: str = "sinusoidal"      # sinusoidal | learned | rope | alibi | none
  sinusoidal_layout: str = "interleaved"  # interleaved (paper: sin 2i, cos 2i+1) | concat (tensor2tensor) | marian
  max_len: int = 1024               # learned-position table size
  rope_theta: float = 10000.0
  rope_scaling: str = "none"        # none | ntk | yarn | llama3
  rope_scaling_factor: float = 1.0
  rope_original_max_len: int = 8192
  rope_beta_fast: float = 32.0      # yarn: dims turning more often than this over the original length are kept
  rope_beta_slow: float = 1.0       # yarn: dims turning less often than this are interpolated by the factor
  rope_truncate: bool = True        # yarn: round the ramp's ends to whole dims (HF `truncate`)
  rope_attention_factor: float | None = None  # yarn: cos/sin scale; None -> 0.1 ln(s) + 1 (or the mscale ratio)
  rope_mscale: float = 0.0          # yarn: with rope_mscale_all_dim, the factor is m(s, mscale) / m(s, mscale_all_dim)
  rope_mscale_all_dim: float = 0.0
  rope_low_freq_factor: float = 1.0   # llama3: wavelengths above original_max_len / this are interpolated
  rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept
  share_embeddings: bool = True     # encoder input and decoder input share one table
  tie_output: bool = True           # output projection = embedding transposed
  logits_bias: bool = False         # a trained bias [vocab] added to the logits (Marian's final_logits_bias)
  scale_embeddings: bool = True     # multiply embeddings by sqrt(d_model) (paper)
  kernel_init: str = "xavier_uniform"  # xavier_uniform | normal (std init_std)
  init_std: float = 0.02
  dropout_rate: float = 0.1         # residual + embedding dropout (paper's P_drop)
  attention_dropout_rate: float = 0.0
  dtype: str = "float32"            # compute dtype; parameters stay float32
  matmul_dtype: str = "float32"     # bfloat16: products on bf16 operands, f32 accumulation (CPU/TPU path)
  attention_impl: str = "auto"      # auto | xla | cudnn | einsum
  scan_layers: bool = False         # the blocks of each stack under nn.scan, params stacked on a `layers` axis
  remat: str = "none"               # none | full | dots_saveable | dots_with_no_batch_dims_saveable (per block)
  logits_chunk: int = 0             # > 0: output projection + loss over this many tokens at a time; 0: automatic

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def encoder_layers(self) -> int:
    if self.arch != "encoder_decoder":
      return 0
    return self.num_layers if self.num_encoder_layers is None else self.num_encoder_layers


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the text comes from and how it becomes batches."""
  task: str = "translation"         # translation | lm
  source: str = "local"             # local | hub | synthetic
  hub_name: str = "wmt14"           # datasets.load_dataset(hub_name, hub_config)
  hub_config: str = "de-en"
  src_lang: str = "en"
  tgt_lang: str = "de"
  train_src: str = ""               # local parallel files (translation)
  train_tgt: str = ""
  dev_src: str = ""
  dev_tgt: str = ""
  test_src: str = ""
  test_tgt: str = ""
  text_path: str = ""               # lm, local: text files (globs, comma-separated; .gz, .jsonl read too)
  doc_per: str = "file"             # lm, local text: a document per file | line
  text_field: str = "text"          # lm: the field of .jsonl lines / hub rows that holds the document
  hub_data_files: str = ""          # hub: local files for a packaged builder (hub_name=text|json), globs
  streaming: bool = True            # hub: stream rows (datasets streaming=True) instead of downloading first
  train_fraction: float = 0.9       # lm: one document: its first fraction of characters trains (nanoGPT);
                                    # several: a seeded random fraction of documents (unless a val split exists)
  tokenizer: str = "sentencepiece"  # sentencepiece | char | byte | hf (tokenizer.json) | marian (converted models)
  tokenizer_path: str = ""          # "" -> <data_dir or workdir>/tokenizer.model (spm) or .json (char, hf, marian)
  tokenizer_sample_docs: int = 500000  # sentencepiece trains on a seeded random sample of this many documents
  add_bos: bool = False             # lm: BOS before each document and prompt (Llama's convention)
  data_dir: str = ""                # prepared token shards (python -m jaxformer.prepare); "" -> <workdir>/data
  shard_tokens: int = 100_000_000   # a shard closes at the first document boundary past this many tokens
  packing: str = "random_windows"   # lm: random_windows (nanoGPT) | packed (consecutive rows, shuffled order)
  max_len: int = 256                # longest pair kept (tokens, per side)
  tokens_per_batch: int = 25000     # translation: per side, per optimizer step
  batch_multiple: int = 8           # bucket batch sizes are multiples of this
  batch_size: int = 12              # lm: rows per optimizer step
  block_size: int = 64              # lm: tokens per row
  use_segments: bool = True         # lm: no attention across document boundaries
  num_proc: int = 2                 # prepare: tokenizer worker processes (<= 1: in the calling process)
  synthetic_size: int = 20000       # synthetic: number of generated pairs


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """The one place the optimizer is described (built in `jaxformer.optim`)."""
  optimizer: str = "adam"           # adam | adamw
  schedule: str = "rsqrt"           # rsqrt (paper) | cosine | constant
  learning_rate: float = 1.0        # rsqrt: scale of d_model^-0.5 * min(...); else the peak
  min_learning_rate: float = 0.0    # cosine: final value
  warmup_steps: int = 4000
  b1: float = 0.9
  b2: float = 0.98
  eps: float = 1e-9
  weight_decay: float = 0.0
  grad_clip: float = 0.0            # global-norm clipping; 0 = off (paper)
  grad_accum_steps: int = 1
  label_smoothing: float = 0.1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The loop."""
  num_steps: int = 100000
  log_every: int = 100
  eval_every: int = 1000
  eval_batches: int = 0             # 0 = the whole dev set
  checkpoint_every: int = 1000
  keep_checkpoints: int = 20        # the paper averages the last 5 (base) / 20 (big)
  seed: int = 0
  init_from: str = ""               # a workdir (e.g. from jaxformer.convert): start from its params, fresh optimizer
  nan_policy: str = "skip"          # skip | stop
  max_skipped_steps: int = 10       # stop after this many skipped (non-finite) steps in a row; 0 = never
  lease_timeout_s: float = 300.0    # a workdir lease held from another host is stale when not refreshed for this long
  steps_per_call: int = 1           # lm: steps fused into one jitted lax.scan (same result, less per-call cost)
  max_minutes: float = 0.0          # stop (with a checkpoint) after this much training time; 0 = no limit
  sample_every_eval: bool = True    # lm: print a sample at eval time
  eval_bleu_sentences: int = 0      # translation: greedy BLEU on this many dev sentences at each eval
  final_eval_split: str = ""        # translation: beam-search BLEU on this split when training ends
  lora_rank: int = 0                # > 0: train LoRA adapters of this rank on a frozen train.init_from (jaxformer.lora)
  lora_alpha: float = 16.0          # the adapters' product is scaled by lora_alpha / lora_rank
  lora_targets: str = r"(query|key|value|out|wi|wi_gate|wi_up|wo)/kernel$"  # re.search over kernel paths


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh: -1 fills the devices the other axes leave."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Beam search and sampling (paper: beam 4, alpha 0.6, max = source + 50)."""
  beam_size: int = 4
  alpha: float = 0.6
  length_penalty: str = "gnmt"      # gnmt: logp / ((5 + len) / 6)^alpha (paper) | hf: logp / len^alpha, HF's beam rules
  hf_early_stopping: str = "false"  # length_penalty=hf: HF's early_stopping, false (its heuristic) | true | never
  suppress_pad: bool = False        # never generate the pad id (Marian's generation_config bans it)
  max_extra_len: int = 50
  batch_size: int = 64
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 256
  # KV-cache slots per row a sample may use (prefix + prompt + new tokens - 1) with RoPE, ALiBi,
  # sinusoidal or no positions; learned positions never need more than model.max_len (they slide).
  max_cache_len: int = 8192


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole recipe."""
  name: str = "custom"
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  mesh: MeshConfig = MeshConfig()
  decode: DecodeConfig = DecodeConfig()


def replace(cfg, **changes):
  """`dataclasses.replace` that also takes dotted keys: replace(cfg, **{"model.d_model": 64})."""
  nested = {}
  for key, value in changes.items():
    head, _, rest = key.partition(".")
    if rest:
      nested.setdefault(head, {})[rest] = value
    else:
      nested[head] = value
  for head, sub in list(nested.items()):
    if isinstance(sub, dict):
      nested[head] = replace(getattr(cfg, head), **sub)
  return dataclasses.replace(cfg, **nested)


def available_configs():
  """Names of the recipes in `configs/`."""
  return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def _parse_value(key, text, annotation):
  """Parses `text` as `annotation` (int, float, bool, str or `X | None`)."""
  options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
  if type(None) in options and text.lower() in ("none", "null"):
    return None
  for typ in options:
    if typ is bool:
      if text.lower() in ("true", "1", "yes"):
        return True
      if text.lower() in ("false", "0", "no"):
        return False
    elif typ is int:
      try:
        return int(text.replace("_", ""))
      except ValueError:
        pass
    elif typ is float:
      try:
        return float(text)
      except ValueError:
        pass
    elif typ is str:
      return text
  names = "/".join(getattr(t, "__name__", str(t)) for t in options)
  raise UserError(f"override {key}={text!r}: expected {names}")


def apply_override(cfg, override):
  """Applies one `a.b=value` string to a Config; errors name the closest key."""
  if "=" not in override:
    raise UserError(f"override {override!r} must look like section.field=value (e.g. model.num_layers=2)")
  key, text = override.split("=", 1)
  parts = key.strip().split(".")
  node, path = cfg, []
  for i, part in enumerate(parts):
    fields = {f.name: f for f in dataclasses.fields(node)}
    if part not in fields:
      valid = [".".join(path + [f]) for f in fields]
      if not path:  # suggest across all sections for a bare field name
        valid += [f"{s}.{f.name}" for s in fields if dataclasses.is_dataclass(getattr(node, s))
                  for f in dataclasses.fields(getattr(node, s))]
      raise UserError(f"unknown config key {key!r}{closest('.'.join(path + [part]), valid)}")
    path.append(part)
    value = getattr(node, part)
    if dataclasses.is_dataclass(value):
      if i == len(parts) - 1:
        raise UserError(f"{key!r} is a section; set one of its fields, e.g. {key}.{dataclasses.fields(value)[0].name}=...")
      node = value
    elif i != len(parts) - 1:
      raise UserError(f"unknown config key {key!r}: {'.'.join(path)} is a field, not a section")
  hints = typing.get_type_hints(type(node))
  parsed = _parse_value(key, text.strip(), hints[parts[-1]])
  return replace(cfg, **{key.strip(): parsed})


def load_config(name_or_path, overrides=()):
  """Loads a recipe by name (`configs/<name>.py`), a `.py` path or a run's `config.json`, then applies overrides."""
  path = pathlib.Path(name_or_path)
  if path.suffix in (".py", ".json") and not path.exists():
    raise UserError(f"config file {name_or_path} not found")
  if path.suffix == ".json":  # a workdir's saved config, e.g. one written by jaxformer.convert
    with open(path) as f:
      cfg = from_dict(json.load(f))
  else:
    if path.suffix == ".py":
      spec = importlib.util.spec_from_file_location(f"jaxformer_config_{path.stem}", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
    elif name_or_path in available_configs():
      module = importlib.import_module(f"jaxformer.configs.{name_or_path}")
    else:
      raise UserError(f"unknown config {name_or_path!r}{closest(str(name_or_path), available_configs())};"
                      f" available: {', '.join(available_configs())}")
    cfg = module.get_config()
  for override in overrides:
    cfg = apply_override(cfg, override)
  _validate(cfg)
  return cfg


def _validate(cfg):
  """Catches combinations that would otherwise fail deep inside jit."""
  m = cfg.model
  choices = {"arch": ("encoder_decoder", "decoder_only"),
             "activation": ("relu", "gelu", "gelu_exact", "silu", "swiglu"),
             "norm": ("layernorm", "rmsnorm"), "norm_position": ("post", "pre"),
             "position": ("sinusoidal", "learned", "rope", "alibi", "none"),
             "rope_scaling": ("none", "ntk", "yarn", "llama3"), "dtype": ("float32", "bfloat16"),
             "matmul_dtype": ("float32", "bfloat16"),
             "attention_impl": ("auto", "xla", "cudnn", "einsum"),
             "sinusoidal_layout": ("interleaved", "concat", "marian"),
             "kernel_init": ("xavier_uniform", "normal"),
             "remat": ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")}
  for field, allowed in choices.items():
    if getattr(m, field) not in allowed:
      raise UserError(f"model.{field}={getattr(m, field)!r}: choose one of {', '.join(allowed)}")
  for name in ("pad_id", "bos_id", "eos_id"):
    if not 0 <= getattr(m, name) < m.vocab_size:
      raise UserError(f"model.{name}={getattr(m, name)} is not a token id of model.vocab_size={m.vocab_size}")
  if m.num_heads % m.kv_heads:
    raise UserError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.kv_heads}")
  if m.head_dim is None and m.d_model % m.num_heads:
    raise UserError(f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads} (or set model.head_dim)")
  if m.logits_chunk < 0:
    raise UserError(f"model.logits_chunk={m.logits_chunk} must be >= 0 (0: automatic, see README)")
  if cfg.data.task not in ("translation", "lm"):
    raise UserError(f"data.task={cfg.data.task!r}: choose translation or lm")
  for field, allowed in (("doc_per", ("file", "line")), ("packing", ("random_windows", "packed"))):
    if getattr(cfg.data, field) not in allowed:
      raise UserError(f"data.{field}={getattr(cfg.data, field)!r}: choose one of {', '.join(allowed)}")
  if not 0.0 < cfg.data.train_fraction <= 1.0:
    raise UserError(f"data.train_fraction={cfg.data.train_fraction}: must be in (0, 1]")
  if (cfg.data.task == "lm") != (m.arch == "decoder_only"):
    raise UserError(f"data.task={cfg.data.task!r} needs model.arch="
                    f"{'decoder_only' if cfg.data.task == 'lm' else 'encoder_decoder'}")
  if cfg.decode.length_penalty not in ("gnmt", "hf"):
    raise UserError(f"decode.length_penalty={cfg.decode.length_penalty!r}: choose gnmt or hf")
  if cfg.decode.hf_early_stopping not in ("false", "true", "never"):
    raise UserError(f"decode.hf_early_stopping={cfg.decode.hf_early_stopping!r}: choose false, true or never")
  if cfg.optim.schedule not in ("rsqrt", "cosine", "constant"):
    raise UserError(f"optim.schedule={cfg.optim.schedule!r}: choose rsqrt, cosine or constant")
  if cfg.train.nan_policy not in ("skip", "stop"):
    raise UserError(f"train.nan_policy={cfg.train.nan_policy!r}: choose skip or stop")
  if cfg.train.max_skipped_steps < 0:
    raise UserError(f"train.max_skipped_steps={cfg.train.max_skipped_steps} must be 0 (never stop) or more")
  if cfg.train.lora_rank < 0:
    raise UserError(f"train.lora_rank={cfg.train.lora_rank} must be 0 (off) or a positive rank")
  if cfg.train.lora_rank:  # (train.init_from, the frozen base, is checked when training starts: inspect needs none)
    try:
      re.compile(cfg.train.lora_targets)
    except re.error as e:
      raise UserError(f"train.lora_targets={cfg.train.lora_targets!r} is not a regular expression ({e})") from e
  if cfg.train.lease_timeout_s <= 0:
    raise UserError(f"train.lease_timeout_s={cfg.train.lease_timeout_s:g} must be positive (seconds)")


def to_dict(cfg):
  """The config as nested dicts (printed and saved with each run)."""
  return dataclasses.asdict(cfg)


def to_json(cfg):
  return json.dumps(to_dict(cfg), indent=2)


def from_dict(d):
  """Inverse of `to_dict` (used to reload the config saved in a workdir)."""
  sections = {f.name: f.type for f in dataclasses.fields(Config)}
  kwargs = {}
  for key, value in d.items():
    if isinstance(value, dict) and key in sections:  # a removed section is skipped, like a removed field
      cls = typing.get_type_hints(Config)[key]
      known = {f.name for f in dataclasses.fields(cls)}
      kwargs[key] = cls(**{k: v for k, v in value.items() if k in known})
    elif key in sections:
      kwargs[key] = value
  return Config(**kwargs)
