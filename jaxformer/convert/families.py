"""The table of Hugging Face families `convert` reads and writes: model_type -> its module.

A family module (gpt2.py, llama.py, ...) names MODEL_TYPE, NAMES, ARCH and MOE; gives `tensors(m)`
(its HF tensors <-> our parameters), `config(hf, gen)` (config.json -> our model/data/decode fields,
optionally optim), `tokenizer(source)`, `default_ids(model)`, WANTS and `mismatches(m)` (the model
fields an exact export needs) and `hf_config(cfg, hf)`; optionally OTHER_FFN (its MoE or dense twin),
BOS_KEY, SPM_EXPORT, PEFT_FAN_IN_FAN_OUT and `generation(cfg, gen)`. Adding a family is one file and a
line here.
"""

from jaxformer.convert import gemma2, gemma3, gpt2, llama, marian, mistral, mixtral, phi3, qwen2, qwen3
from jaxformer.errors import UserError

# Export tries them in this order for a run trained here: the first whose WANTS fit (Mistral before Phi-3).
FAMILIES = {f.MODEL_TYPE: f for f in (gpt2, llama, mixtral, marian, qwen2, qwen3, mistral, phi3, gemma2, gemma3)}


def hf_model_type(hf, where):
  """config.json's model_type, refused in one line unless a family reads it."""
  kind = hf.get("model_type")
  if kind == "gemma3":  # the multimodal checkpoint: its text model is text_config, under other tensor names
    raise UserError(f"{where}: model_type 'gemma3' is Gemma 3's image-text model; jaxformer.convert reads the text "
                    "model (Gemma3ForCausalLM, model_type gemma3_text, as gemma-3-1b ships)")
  if kind not in FAMILIES:
    raise UserError(f"{where}: model_type {kind!r} is not supported; jaxformer.convert supports "
                    f"{', '.join(FAMILIES)} ({', '.join(f.NAMES for f in FAMILIES.values())})")
  return kind
