"""`python -m jaxformer.convert`: the command line of import (--from-hf), export (--to-hf) and --peft."""

import argparse

from jaxformer.convert import hf_in, hf_out, peft
from jaxformer.errors import UserError, cli


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Convert Hugging Face checkpoints (GPT-2, Llama, Mixtral, Marian) to and "
                                               "from jaxformer workdirs.")
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--from-hf", metavar="HF_DIR", help="a local Hugging Face model folder to import")
  group.add_argument("--to-hf", metavar="WORKDIR", help="a jaxformer workdir to export")
  parser.add_argument("--workdir", help="with --from-hf: the new jaxformer workdir")
  parser.add_argument("--out", help="with --to-hf: the new Hugging Face folder")
  parser.add_argument("--step", type=int, default=None, help="with --to-hf: checkpoint step (default: latest)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                      help="with --to-hf: tensor dtype written")
  parser.add_argument("--max-shard-mb", type=int, default=2048, help="with --to-hf: safetensors shard size")
  parser.add_argument("--tokenizer", metavar="PATH", help="with --from-hf: the tokenizer to import (a tokenizer.json "
                      "or tokenizer.model, or a folder holding it) when HF_DIR has none")
  for _, key, flag in hf_in.IDS:
    parser.add_argument(flag, type=int, default=None, metavar="N",
                        help=f"with --from-hf: the id when config.json's {key} is null (overrides it)")
  parser.add_argument("--peft", action="store_true",
                      help="with --to-hf of a LoRA run: write its adapters as a PEFT adapter (not the merged model)")
  return parser.parse_intermixed_args(argv)


@cli
def main(argv):
  """The `python -m jaxformer.convert` entry point."""
  args = parse_args(argv)
  if args.from_hf:
    if not args.workdir:
      raise UserError("--from-hf needs --workdir W (the jaxformer workdir to write)")
    ids = {"bos_id": args.bos_id, "eos_id": args.eos_id, "pad_id": args.pad_id}
    return hf_in.from_hf(args.from_hf, args.workdir, ids=ids, tokenizer=args.tokenizer)
  if not args.out:
    raise UserError("--to-hf needs --out DIR (the Hugging Face folder to write)")
  if args.peft:
    return peft.to_peft(args.to_hf, args.out, args.step, args.dtype)
  return hf_out.to_hf(args.to_hf, args.out, args.step, args.dtype, args.max_shard_mb)
