"""GPT-2 small's shape on WikiText-103 (Merity et al. 2016; raw, 103M words of Wikipedia articles).

Data: `wikitext`/`wikitext-103-raw-v1` streamed from the Hugging Face hub with its own validation
split, a 32k sentencepiece BPE trained on a sample of 500k rows, prepared once into uint16 shards
(~0.3 GB; README). Packed rows: consecutive 1,024-token windows in a shuffled order, each token a
target once per epoch. The hub's rows are lines, not articles, so attention runs across them
(data.use_segments=false), as over one stream of text.
"""

from jaxformer.config import replace
from jaxformer.configs import gpt2_small


def get_config():
  return replace(gpt2_small.get_config(), name="wikitext103", **{
      "model.vocab_size": 32000,
      "data.hub_name": "wikitext", "data.hub_config": "wikitext-103-raw-v1", "data.train_fraction": 0.9,
      "data.tokenizer_sample_docs": 500_000, "data.packing": "packed", "data.use_segments": False,
      "data.batch_size": 128, "data.num_proc": 2,
      "train.num_steps": 50000, "train.eval_every": 1000, "train.checkpoint_every": 1000})
