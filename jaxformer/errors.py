"""User-facing errors: one line that says what to fix, exit code 2, no traceback."""

import difflib
import functools
import os
import sys


class UserError(Exception):
  """Bad input from the user (config, data, checkpoint, flags).

  The CLI entry points catch it and print `error: <message>` on one line and
  exit with code 2; `--debug` (or JAXFORMER_DEBUG=1) shows the traceback.
  """


def closest(name, candidates):
  """Returns ` (did you mean 'x'?)` for the closest candidate, or ''."""
  match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
  return f" (did you mean '{match[0]}'?)" if match else ""


def cli(main):
  """Decorates a CLI `main(argv)`: UserError -> one-line message, exit 2."""

  @functools.wraps(main)
  def wrapper(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("JAXFORMER_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    try:
      return main(argv)
    except UserError as e:
      if debug:
        raise
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)

  return wrapper
