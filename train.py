"""Train a model: `python train.py [--config NAME] [--workdir DIR] [section.field=value ...]`.

With no arguments it runs the offline demo (`configs/default.py`)."""

from jaxformer.train import main

if __name__ == "__main__":
  main()
