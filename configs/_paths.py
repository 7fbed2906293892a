"""Where the small real corpora live: `../shared/data` beside the repo, or $JAXFORMER_DATA."""

import os
import pathlib

DATA = pathlib.Path(os.environ.get(
    "JAXFORMER_DATA", pathlib.Path(__file__).resolve().parent.parent.parent / "shared" / "data"))


def data(relative):
  """Absolute path of a file under the data folder, as a string."""
  return str(DATA / relative)
