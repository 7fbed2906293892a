"""One config system: frozen dataclasses, named recipes in `configs/`, dotted overrides.

A recipe is a file `configs/<name>.py` with a function `get_config() -> Config` (the
folder is installed as the package `jaxformer.configs`, so a wheel carries the recipes).
`load_config("wmt_base", ["model.num_layers=2"])` resolves it; an unknown key or a
value of the wrong type is a `UserError` naming the closest valid key.
"""

import dataclasses
import importlib.util
import json
import os
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
                                    # | geglu (tanh-GELU gate: Gemma)
  norm: str = "layernorm"           # layernorm | rmsnorm
  norm_position: str = "post"       # post (paper) | pre
  norm_eps: float = 1e-6
  use_bias: bool = True             # biases in attention and FFN projections
  qkv_bias: bool = False            # biases on the q/k/v projections alone (Qwen2); use_bias puts them everywhere
  qk_norm: bool = False             # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
  norm_unit_offset: bool = False    # RMSNorm gains are 1 + w, w starting at 0 (Gemma)
  post_norms: bool = False          # pre-norm with a second norm on each sublayer's output, before the residual (Gemma 2/3)
  sliding_window: int = 0           # > 0: a local layer's query sees its last this-many keys, itself included (Mistral: 4096)
  attention_pattern: str = ""       # local/global per layer, cycled: "local,global" (Gemma 2); "" -> every layer
                                    # local when sliding_window > 0, else global
  attn_softcap: float = 0.0         # > 0: attention logits become c * tanh(logits / c) (Gemma 2: 50)
  final_softcap: float = 0.0        # > 0: the same on the output logits (Gemma 2: 30)
  query_pre_attn_scalar: float | None = None  # attention logits scaled by this^-0.5 (Gemma); None -> head_dim
  position: str = "sinusoidal"      # sinusoidal | learned | rope | alibi | none
  sinusoidal_layout: str = "interleaved"  # interleaved (paper: sin 2i, cos 2i+1) | concat (tensor2tensor) | marian
  max_len: int = 1024               # learned-position table size
  rope_theta: float = 10000.0
  rope_local_theta: float | None = None  # local layers' RoPE base, unscaled (Gemma 3: 10000); None -> as global layers
  rope_scaling: str = "none"        # none | linear | ntk | yarn | llama3
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
  quant_activations: str = "float"  # int8 | int16: a quantized workdir's products of 16+ rows (prefill, eval) on
                                    # integer activations, per 32 inputs (CPU, AVX-512 VNNI; qmatmul.matmul)
  attention_impl: str = "auto"      # auto | einsum (dense) | tiled | xla | cudnn | splash (layers.choose_attention)
  scan_layers: bool = False         # the blocks of each stack under nn.scan, params stacked on a `layers` axis
  remat: str = "none"               # none | full | dots_saveable | dots_with_no_batch_dims_saveable (per block)
  logits_chunk: int = 0             # > 0: output projection + loss over this many tokens at a time; 0: automatic
  moe_experts: int = 0              # > 0: mixture-of-experts FFNs with this many experts (decoder_only; jaxformer.moe)
  moe_top_k: int = 2                # experts per token (Mixtral: 2)
  moe_shared_experts: int = 0       # experts of d_ff every token also passes through (DeepSeek), as one FFN
  moe_every: int = 1                # layers i with i % moe_every == moe_every - 1 are MoE (2: every other layer)
  moe_capacity_factor: float = 0.0  # 0: dropless (ragged_dot); c > 0: ceil(c x tokens x top_k / experts) per expert
  moe_dispatch: str = "gspmd"       # expert parallelism: gspmd (the compiler places it) | all_to_all (shard_map)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def gated(self) -> bool:
    """Whether the FFN is gated (two input projections, wi_gate and wi_up: SwiGLU, GeGLU)."""
    return self.activation in ("swiglu", "geglu")

  def layer_is_local(self, i) -> bool:
    """Whether layer i attends within `sliding_window` (a local layer) rather than to every earlier key."""
    if not self.sliding_window:
      return False
    if not self.attention_pattern:
      return True
    kinds = [k.strip() for k in self.attention_pattern.split(",")]
    return kinds[i % len(kinds)] == "local"

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
  # Fine-tuning (lm): JSON lines of `messages` or `prompt`/`completion` (SFT), or `prompt`/`chosen`/
  # `rejected` (train.objective=dpo); the rows are whole examples (data.packing=packed packs several)
  chat_path: str = ""
  chat_val_path: str = ""           # "" -> a seeded 1 - train_fraction of chat_path's records
  chat_template: str = ""           # chatml | plain | a tokenizer_config.json or .jinja; "" -> beside the tokenizer
  loss_on: str = "assistant"        # assistant (every assistant turn) | completion (the last one) | all


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
  moe_aux_loss: float = 0.01        # load-balancing loss coefficient (Switch: 0.01), per target token
  moe_z_loss: float = 0.0           # router z-loss coefficient (ST-MoE: 0.001)


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
  host_timeout_s: int = 30          # multi-host: a process silent this long is dead, and the others stop
  steps_per_call: int = 1           # lm: steps fused into one jitted lax.scan (same result, less per-call cost)
  max_minutes: float = 0.0          # stop (with a checkpoint) after this much training time; 0 = no limit
  sample_every_eval: bool = True    # lm: print a sample at eval time
  eval_bleu_sentences: int = 0      # translation: greedy BLEU on this many dev sentences at each eval
  eval_harness_tasks: str = ""      # lm: lm-evaluation-harness tasks (comma-separated) run at eval steps (jaxformer.harness)
  eval_harness_every: int = 0       # steps between harness runs, a multiple of eval_every; 0 = every eval
  eval_harness_limit: int = 0       # documents per harness task; 0 = all
  eval_harness_fewshot: int = -1    # few-shot examples; -1 = each task's own
  eval_harness_include_path: str = ""  # a folder of task YAML files of your own (local data files)
  final_eval_split: str = ""        # translation: beam-search BLEU on this split when training ends
  objective: str = "lm"             # lm (next-token loss, masked for SFT) | dpo (data.chat_path of preference pairs)
  dpo_beta: float = 0.1             # DPO's beta (Rafailov et al. 2023), applied once to the log-ratio margin
  dpo_reference: str = ""           # DPO's frozen reference: a workdir's latest params; "" -> the initial params (LoRA: the base)
  dpo_from_scratch: bool = False    # DPO without train.init_from: random policy and reference, on purpose (else refused)
  lora_rank: int = 0                # > 0: train LoRA adapters of this rank on a frozen train.init_from (jaxformer.lora)
  lora_alpha: float = 16.0          # the adapters' product is scaled by lora_alpha / lora_rank
  lora_base_dtype: str = "float32"  # float32 | bfloat16: the frozen base's storage (adapters, Adam stay float32)
  # re.search over kernel paths (.../query/kernel) and MoE expert weights (.../moe/wi_gate, no /kernel)
  lora_targets: str = r"(query|key|value|out|wi|wi_gate|wi_up|wo)(/kernel)?$"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh: -1 fills the devices the other axes leave."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1                   # MoE experts sharded over this axis (the batch too)


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
  if path.suffix == ".json":  # a workdir's saved config given by the user, e.g. one written by jaxformer.convert
    with open(path) as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise UserError(f"config file {name_or_path} is not valid JSON ({e})") from e
    cfg = from_dict(d, where=str(name_or_path))  # strict: an unknown key is an error, as in a recipe
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
  """Catches bad values and combinations that would otherwise fail deep inside jit (or train on NaN)."""
  _validate_types(cfg)  # first: the checks below compare numbers
  _validate_ranges(cfg)
  m = cfg.model
  choices = {"arch": ("encoder_decoder", "decoder_only"),
             "activation": ("relu", "gelu", "gelu_exact", "silu", "swiglu", "geglu"),
             "norm": ("layernorm", "rmsnorm"), "norm_position": ("post", "pre"),
             "position": ("sinusoidal", "learned", "rope", "alibi", "none"),
             "rope_scaling": ("none", "linear", "ntk", "yarn", "llama3"), "dtype": ("float32", "bfloat16"),
             "matmul_dtype": ("float32", "bfloat16"), "quant_activations": ("float", "int8", "int16"),
             "attention_impl": ("auto", "einsum", "tiled", "xla", "cudnn", "splash"),
             "sinusoidal_layout": ("interleaved", "concat", "marian"),
             "kernel_init": ("xavier_uniform", "normal"),
             "remat": ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"),
             "moe_dispatch": ("gspmd", "all_to_all")}
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
  _validate_layer_features(m)
  if m.logits_chunk < 0:
    raise UserError(f"model.logits_chunk={m.logits_chunk} must be >= 0 (0: automatic, see README)")
  if m.moe_experts:
    _validate_moe(cfg)
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
  if cfg.data.loss_on not in ("assistant", "completion", "all"):
    raise UserError(f"data.loss_on={cfg.data.loss_on!r}: choose assistant, completion or all")
  if cfg.train.objective not in ("lm", "dpo"):
    raise UserError(f"train.objective={cfg.train.objective!r}: choose lm or dpo")
  if (cfg.data.chat_path or cfg.train.objective == "dpo") and cfg.data.task != "lm":
    raise UserError("data.chat_path and train.objective=dpo need data.task=lm (a decoder-only model)")
  if cfg.train.objective == "dpo" and not cfg.data.chat_path:
    raise UserError("train.objective=dpo needs data.chat_path=FILE.jsonl of {\"prompt\", \"chosen\", \"rejected\"}")
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
  if (cfg.train.lora_rank and cfg.train.objective == "dpo" and cfg.train.dpo_reference
      and os.path.abspath(cfg.train.dpo_reference) != os.path.abspath(cfg.train.init_from)):
    raise UserError(f"train.dpo_reference={cfg.train.dpo_reference} with train.lora_rank: DPO with LoRA takes "
                    "train.init_from with the adapters off as its reference (no second copy of the weights); "
                    "drop train.dpo_reference, or set train.lora_rank=0")
  if cfg.train.lora_base_dtype not in ("float32", "bfloat16"):
    raise UserError(f"train.lora_base_dtype={cfg.train.lora_base_dtype!r}: choose float32 or bfloat16")
  if cfg.train.lora_rank:  # (train.init_from, the frozen base, is checked when training starts: inspect needs none)
    try:
      re.compile(cfg.train.lora_targets)
    except re.error as e:
      raise UserError(f"train.lora_targets={cfg.train.lora_targets!r} is not a regular expression ({e})") from e
  if cfg.train.lease_timeout_s <= 0:
    raise UserError(f"train.lease_timeout_s={cfg.train.lease_timeout_s:g} must be positive (seconds)")
  if m.position == "learned":  # jnp.take past the table is NaN: every step would be non-finite
    length, name = ((cfg.data.block_size, "data.block_size") if cfg.data.task == "lm"
                    else (cfg.data.max_len, "data.max_len"))
    if length > m.max_len:
      raise UserError(f"{name}={length} is longer than the learned-position table (model.max_len={m.max_len}): "
                      f"set {name} <= {m.max_len} or model.max_len >= {length}")
  o = cfg.optim
  if o.optimizer not in ("adam", "adamw"):
    raise UserError(f"optim.optimizer={o.optimizer!r}: choose adam or adamw")
  if o.optimizer == "adam" and o.weight_decay:
    raise UserError(f"optim.weight_decay={o.weight_decay:g} needs optim.optimizer=adamw (Adam has no decoupled "
                    "weight decay): set optim.optimizer=adamw or optim.weight_decay=0")


def _validate_types(cfg):
  """Every field holds its annotated type (a recipe or a JSON config can hold anything);
  an int stands for a float, a bool never for an int."""
  for section in dataclasses.fields(Config):
    node = getattr(cfg, section.name)
    if not dataclasses.is_dataclass(node):
      if not isinstance(node, str):
        raise UserError(f"config {section.name}={node!r}: expected str")
      continue
    for name, annotation in typing.get_type_hints(type(node)).items():
      value = getattr(node, name)
      if not _has_type(value, annotation):
        raise UserError(f"{section.name}.{name}={value!r} ({type(value).__name__}): expected {_type_name(annotation)}")


def _has_type(value, annotation):
  options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
  for typ in options:
    if typ is type(None) and value is None:
      return True
    if typ is bool and isinstance(value, bool):
      return True
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
      return True
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
      return True
    if typ is str and isinstance(value, str):
      return True
  return False


def _type_name(annotation):
  options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
  return " or ".join("None" if t is type(None) else t.__name__ for t in options)


# The valid range of every numeric field, per section: (field, lowest, highest, what to say), bounds
# inclusive (None: unbounded). Written so a NaN fails too (`not lo <= x`). A field of `X | None` is
# checked when set. Choices (str fields) and cross-field rules are checked in `_validate`.
_POSITIVE, _COUNT = "must be at least 1", "must be 0 or more"
_TINY, _BELOW_1 = 5e-324, 1.0 - 2.0 ** -53   # the smallest float above 0 and the largest below 1
_RANGES = {
    "model": [("vocab_size", 1, None, _POSITIVE), ("d_model", 1, None, _POSITIVE),
              ("num_heads", 1, None, _POSITIVE), ("num_kv_heads", 1, None, "must be at least 1 (or None: num_heads)"),
              ("head_dim", 1, None, "must be at least 1 (or None: d_model // num_heads)"),
              ("num_layers", 1, None, _POSITIVE), ("num_encoder_layers", 1, None, "must be at least 1 (or None)"),
              ("d_ff", 1, None, _POSITIVE), ("norm_eps", _TINY, None, "must be positive"),
              ("max_len", 1, None, _POSITIVE), ("rope_theta", _TINY, None, "must be positive"),
              ("rope_scaling_factor", _TINY, None, "must be positive"), ("rope_original_max_len", 1, None, _POSITIVE),
              ("rope_low_freq_factor", _TINY, None, "must be positive"),
              ("rope_high_freq_factor", _TINY, None, "must be positive"),
              ("rope_beta_fast", _TINY, None, "must be positive"), ("rope_beta_slow", _TINY, None, "must be positive"),
              ("rope_attention_factor", _TINY, None, "must be positive (or None: the yarn default)"),
              ("rope_mscale", 0.0, None, _COUNT), ("rope_mscale_all_dim", 0.0, None, _COUNT),
              ("sliding_window", 0, None, "must be 0 (off) or a window in tokens"),
              ("attn_softcap", 0.0, None, "must be 0 (off) or positive"),
              ("final_softcap", 0.0, None, "must be 0 (off) or positive"),
              ("query_pre_attn_scalar", _TINY, None, "must be positive (or None: head_dim)"),
              ("rope_local_theta", _TINY, None, "must be positive (or None: rope_theta)"),
              ("init_std", 0.0, None, _COUNT), ("dropout_rate", 0.0, _BELOW_1, "must be in [0, 1)"),
              ("attention_dropout_rate", 0.0, _BELOW_1, "must be in [0, 1)"),
              ("moe_experts", 0, None, "must be 0 (dense) or more"), ("moe_top_k", 1, None, _POSITIVE),
              ("moe_shared_experts", 0, None, _COUNT), ("moe_every", 1, None, _POSITIVE),
              ("moe_capacity_factor", 0.0, None, "must be 0 (dropless) or more")],
    "data": [("tokenizer_sample_docs", 1, None, _POSITIVE), ("shard_tokens", 1, None, _POSITIVE),
             ("max_len", 2, None, "must be at least 2 (a token and EOS)"),
             ("tokens_per_batch", 1, None, _POSITIVE), ("batch_multiple", 1, None, _POSITIVE),
             ("batch_size", 1, None, _POSITIVE), ("block_size", 1, None, _POSITIVE),
             ("synthetic_size", 1, None, _POSITIVE)],
    "optim": [("learning_rate", 0.0, None, _COUNT), ("min_learning_rate", 0.0, None, _COUNT),
              ("warmup_steps", 0, None, _COUNT), ("b1", 0.0, _BELOW_1, "must be in [0, 1)"),
              ("b2", 0.0, _BELOW_1, "must be in [0, 1)"),
              ("eps", _TINY, None, "must be positive (Adam divides by sqrt(v) + eps)"),
              ("weight_decay", 0.0, None, _COUNT), ("grad_clip", 0.0, None, "must be 0 (off) or more"),
              ("grad_accum_steps", 1, None, _POSITIVE), ("label_smoothing", 0.0, _BELOW_1, "must be in [0, 1)"),
              ("moe_aux_loss", 0.0, None, _COUNT), ("moe_z_loss", 0.0, None, _COUNT)],
    "train": [("num_steps", 1, None, _POSITIVE), ("log_every", 1, None, "must be at least 1 (steps)"),
              ("eval_every", 1, None, "must be at least 1 (steps)"),
              ("eval_batches", 0, None, "must be 0 (the whole dev set) or more"),
              ("checkpoint_every", 1, None, "must be at least 1 (steps)"), ("keep_checkpoints", 1, None, _POSITIVE),
              ("seed", 0, None, _COUNT), ("steps_per_call", 1, None, _POSITIVE),
              ("max_minutes", 0.0, None, "must be 0 (no limit) or more"), ("eval_bleu_sentences", 0, None, _COUNT),
              ("eval_harness_every", 0, None, "must be 0 (every eval) or a multiple of train.eval_every"),
              ("eval_harness_limit", 0, None, "must be 0 (all documents) or more"),
              ("eval_harness_fewshot", -1, None, "must be -1 (each task's own) or a count"),
              ("host_timeout_s", 2, None, "must be at least 2 (seconds: the peer watch beats once a second)"),
              ("dpo_beta", _TINY, None, "must be positive (DPO's beta scales the log-ratio margin)"),
              ("lora_rank", 0, None, "must be 0 (off) or a positive rank"),
              ("lora_alpha", _TINY, None, "must be positive (the adapters are scaled by lora_alpha / lora_rank)")],
    "decode": [("beam_size", 1, None, _POSITIVE), ("alpha", 0.0, None, _COUNT), ("max_extra_len", 0, None, _COUNT),
               ("batch_size", 1, None, _POSITIVE), ("temperature", 0.0, None, "must be 0 (greedy) or more"),
               ("top_k", 0, None, "must be 0 (off) or more"), ("top_p", _TINY, 1.0, "must be in (0, 1]"),
               ("max_new_tokens", 1, None, _POSITIVE), ("max_cache_len", 1, None, _POSITIVE)],
}


def _validate_ranges(cfg):
  """Counts, intervals, sizes and rates in their valid ranges (`_RANGES`), and the mesh axes."""
  for section, rules in _RANGES.items():
    node = getattr(cfg, section)
    for name, lo, hi, what in rules:
      value = getattr(node, name)
      if value is None:
        continue
      if not ((lo is None or lo <= value) and (hi is None or value <= hi)):
        raise UserError(f"{section}.{name}={value!r} {what}")
  for name in ("data", "fsdp", "tensor", "expert"):
    value = getattr(cfg.mesh, name)
    if value != -1 and value < 1:
      raise UserError(f"mesh.{name}={value} must be at least 1, or -1 (the devices the other axes leave)")
  if cfg.optim.schedule == "rsqrt" and cfg.optim.warmup_steps < 1:
    raise UserError(f"optim.warmup_steps={cfg.optim.warmup_steps} must be at least 1 with optim.schedule=rsqrt "
                    "(it scales by warmup_steps^-1.5)")
  t = cfg.train
  if t.eval_harness_every and t.eval_harness_every % t.eval_every:
    raise UserError(f"train.eval_harness_every={t.eval_harness_every} must be a multiple of "
                    f"train.eval_every={t.eval_every} (harness tasks run at eval steps)")
  if t.eval_harness_tasks and (cfg.data.task != "lm" or cfg.model.arch != "decoder_only" or t.objective == "dpo"):
    raise UserError(f"train.eval_harness_tasks={t.eval_harness_tasks!r} runs language-model tasks: it needs "
                    "data.task=lm with a decoder-only model and train.objective=lm")
  m = cfg.model
  if m.rope_scaling == "llama3" and not m.rope_high_freq_factor > m.rope_low_freq_factor:
    raise UserError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be larger than "
                    f"model.rope_low_freq_factor={m.rope_low_freq_factor} (llama3 divides by their difference)")


def _validate_layer_features(m):
  """The attention variants of today's open models (issue 36): windows, patterns, norms."""
  kinds = [k.strip() for k in m.attention_pattern.split(",")] if m.attention_pattern else []
  if any(k not in ("local", "global") for k in kinds):
    raise UserError(f"model.attention_pattern={m.attention_pattern!r}: a comma-separated cycle of local and global "
                    "(e.g. local,global)")
  if "local" in kinds and not m.sliding_window:
    raise UserError(f"model.attention_pattern={m.attention_pattern!r} has local layers: set model.sliding_window "
                    "(their window, in tokens)")
  if m.sliding_window and m.arch != "decoder_only":
    raise UserError(f"model.sliding_window={m.sliding_window} needs model.arch=decoder_only")
  if m.scan_layers and len({m.layer_is_local(i) for i in range(m.num_layers)}) > 1:
    raise UserError(f"model.scan_layers=true scans one block: it needs every layer of one kind, and "
                    f"model.attention_pattern={m.attention_pattern!r} mixes local and global: set model.scan_layers=false")
  if m.rope_local_theta is not None and not m.sliding_window:
    raise UserError(f"model.rope_local_theta={m.rope_local_theta:g} is the RoPE base of local layers: "
                    "it needs model.sliding_window")
  if m.norm_unit_offset and m.norm != "rmsnorm":
    raise UserError("model.norm_unit_offset=true (gains 1 + w) is an RMSNorm variant: set model.norm=rmsnorm")
  if m.post_norms and m.norm_position != "pre":
    raise UserError("model.post_norms=true adds norms to a pre-norm block: set model.norm_position=pre")
  if m.qk_norm and m.norm != "rmsnorm":
    raise UserError("model.qk_norm=true is an RMSNorm over each head: set model.norm=rmsnorm")


def _validate_moe(cfg):
  """The MoE fields (model.moe_*), when model.moe_experts > 0."""
  m = cfg.model
  if m.moe_experts < 0 or m.arch != "decoder_only":
    raise UserError(f"model.moe_experts={m.moe_experts}: mixture of experts needs model.arch=decoder_only"
                    " and a positive expert count (0 = dense)")
  if not 1 <= m.moe_top_k <= m.moe_experts:
    raise UserError(f"model.moe_top_k={m.moe_top_k} must be between 1 and model.moe_experts={m.moe_experts}")
  if m.moe_every < 1 or m.moe_every > m.num_layers:
    raise UserError(f"model.moe_every={m.moe_every} must be between 1 and model.num_layers={m.num_layers}")
  if m.scan_layers and m.moe_every != 1:
    raise UserError(f"model.scan_layers=true scans one block: it needs model.moe_every=1 (got {m.moe_every})")
  if m.moe_shared_experts < 0 or m.moe_capacity_factor < 0:
    raise UserError("model.moe_shared_experts and model.moe_capacity_factor must be >= 0")
  if cfg.train.objective == "dpo":
    raise UserError("train.objective=dpo is not supported with model.moe_experts > 0 yet (the preference loss "
                    "adds no router losses): fine-tune a dense model, or use train.objective=lm")
  if m.moe_dispatch == "all_to_all" and m.moe_capacity_factor > 0:
    raise UserError(f"model.moe_dispatch=all_to_all is dropless: it needs model.moe_capacity_factor=0 "
                    f"(got {m.moe_capacity_factor}); use model.moe_dispatch=gspmd for capacity mode")
  if cfg.mesh.expert > 1 and m.moe_experts % cfg.mesh.expert:
    raise UserError(f"model.moe_experts={m.moe_experts} must be a multiple of mesh.expert={cfg.mesh.expert}")


def check_backend(model_cfg, backend):
  """One line before anything compiles: `splash` needs a TPU and `cudnn` a GPU and bfloat16 (`backend`:
  the platform the program runs on; a compile for a TPU topology from this CPU does not call this).

  The platform is checked first: on a CPU, `cudnn` is wrong whatever the dtype, so asking for
  bfloat16 there would send the user to a second error."""
  m = model_cfg
  need = {"splash": "tpu", "cudnn": "gpu"}.get(m.attention_impl)
  if need and backend != need:
    raise UserError(f"model.attention_impl={m.attention_impl} runs on {need.upper()} only, and this "
                    f"program runs on {backend}: use model.attention_impl=auto (or tiled)")
  if m.attention_impl == "cudnn" and m.dtype != "bfloat16":
    raise UserError(f"model.attention_impl=cudnn needs model.dtype=bfloat16 (cuDNN flash attention has no "
                    f"{m.dtype} kernel): set model.dtype=bfloat16 or model.attention_impl=auto")


def to_dict(cfg):
  """The config as nested dicts (printed and saved with each run)."""
  return dataclasses.asdict(cfg)


def to_json(cfg):
  return json.dumps(to_dict(cfg), indent=2)


# Fields a past version saved in config.json and this one no longer has ("section.field" -> why):
# skipped with a warning when a saved config is read. Removing a field from a dataclass above
# means adding it here, so runs saved before still evaluate. (None removed so far.)
REMOVED_FIELDS = {}


def from_dict(d, where="config", strict=True, warn=print):
  """Inverse of `to_dict`: a `Config` from nested dicts (a run's saved config.json).

  Every value is checked as a recipe's is (types in `_validate`); an int stands for a float.
  A field in `REMOVED_FIELDS` is skipped with a warning. Any other unknown section or field is
  a `UserError` naming the closest valid key (`strict`, for a config the user gives), or, for the
  config.json a workdir holds (read by eval, generate, train.init_from), skipped with a warning:
  a run saved by another version of jaxformer still evaluates, and says what it ignored.
  """
  if not isinstance(d, dict):
    raise UserError(f"{where}: expected a JSON object of config sections, got {type(d).__name__}")
  hints = typing.get_type_hints(Config)
  kwargs = {}
  for key, value in d.items():
    if key not in hints:
      _unknown(key, list(hints), where, strict, warn)
    elif not dataclasses.is_dataclass(hints[key]):
      kwargs[key] = value
    elif not isinstance(value, dict):
      raise UserError(f"{where}: {key} must be a section (a JSON object of fields), got {value!r}")
    else:
      cls, fields = hints[key], typing.get_type_hints(hints[key])
      known = {}
      for name, v in value.items():
        if name not in fields:
          _unknown(f"{key}.{name}", [f"{key}.{f}" for f in fields], where, strict, warn)
          continue
        if fields[name] is float and isinstance(v, int) and not isinstance(v, bool):
          v = float(v)  # JSON written by hand: 1 for 1.0
        known[name] = v
      kwargs[key] = cls(**known)
  return Config(**kwargs)


def _unknown(key, valid, where, strict, warn):
  if key in REMOVED_FIELDS:
    warn(f"warning: {where}: skipping {key}, removed from jaxformer ({REMOVED_FIELDS[key]})")
  elif strict:
    raise UserError(f"{where}: unknown config key {key!r}{closest(key, valid)}")
  else:
    warn(f"warning: {where}: skipping unknown config key {key!r} (saved by another version of jaxformer?)")


def load_saved_config(path, warn=print):
  """The config a workdir saved (`WORKDIR/config.json`), read leniently (see `from_dict`), not validated."""
  with open(path) as f:
    try:
      d = json.load(f)
    except json.JSONDecodeError as e:
      raise UserError(f"{path} is not valid JSON ({e}): is it a jaxformer config.json?") from e
  return from_dict(d, where=str(path), strict=False, warn=warn)
