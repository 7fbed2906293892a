"""Hugging Face hub datasets: a quick reachability check, then `datasets.load_dataset`."""

import os
import socket
import threading
import urllib.parse
import urllib.request

from jaxformer.errors import UserError

REACH_TIMEOUT_S = 5.0  # For the TCP connection, DNS included; huggingface_hub's own timeout is 10 s.


def reachable(url: str, timeout: float = REACH_TIMEOUT_S) -> bool:
  """Whether a TCP connection to `url`'s host (or the proxy the environment sets for it) opens in time.

  One connection attempt, no retries: a machine without a route (DNS failure,
  refused or dropped connection) answers False within `timeout` seconds.
  """
  parts = urllib.parse.urlsplit(url)
  host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
  if not host:  # A malformed HF_ENDPOINT; getaddrinfo(None) would test the loopback instead.
    return False
  # huggingface_hub's HTTP client honours HTTPS_PROXY/ALL_PROXY/NO_PROXY; then the first hop is the proxy.
  proxies = urllib.request.getproxies()
  proxy = proxies.get(parts.scheme) or proxies.get("all")
  if proxy and not urllib.request.proxy_bypass(host):
    p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    host, port = p.hostname, p.port or (443 if p.scheme == "https" else 80)
  ok = []

  def connect():
    try:
      socket.create_connection((host, port), timeout=timeout).close()
      ok.append(True)
    except (OSError, ValueError):
      pass

  # A thread bounds the DNS lookup too, which the socket timeout does not cover.
  t = threading.Thread(target=connect, daemon=True)
  t.start()
  t.join(timeout)
  return bool(ok)


def load_dataset(name: str, config: str, split: str | None = None, *, local_hint: str):
  """`datasets.load_dataset(name, config, split=split)`, failing fast with one line when it cannot work.

  With HF_DATASETS_OFFLINE=1 or HF_HUB_OFFLINE=1, datasets reads its cache and
  nothing is checked first. Otherwise the hub endpoint (HF_ENDPOINT) must
  accept a connection before datasets starts its retry loop (about 30 s of
  warnings on a machine without network); datasets keeps its retries for
  transient errors once the hub is reachable.

  Args:
    name, config, split: as for `datasets.load_dataset`.
    local_hint: how to run the recipe from local files instead, e.g.
      "set data.source=local data.text_path=FILE".
  Returns:
    A `datasets.Dataset` (with `split`) or `DatasetDict`.
  """
  return _load(name, config, split, local_hint)


# datasets' packaged builders: with data_files they read local files and need no network.
PACKAGED = ("text", "json", "csv", "parquet", "arrow")


def load_streaming(name: str, config: str | None = None, *, data_files=None, streaming: bool = True,
                   local_hint: str, **kwargs):
  """All splits of a dataset as iterables of rows, read as they are consumed: the streaming variant
  of `load_dataset`, with the same fast one-line failures.

  `datasets.load_dataset(name, config, data_files=..., streaming=True, **kwargs)`: rows come off the
  hub (or local files, for name "text"/"json" with `data_files`) without a full download first.
  In offline mode (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE), and with `streaming=False`, datasets
  reads (or first fills) its cache instead, since streaming always asks the hub.
  Returns:
    A `datasets.IterableDatasetDict` or `DatasetDict`: split name -> rows (dicts).
  """
  import datasets  # Lazy, as above.
  if data_files:
    kwargs["data_files"] = data_files
  if streaming and not datasets.config.HF_HUB_OFFLINE:
    kwargs["streaming"] = True
  return _load(name, config, None, local_hint, needs_hub=not (name in PACKAGED and data_files), **kwargs)


def _load(name, config, split, local_hint, needs_hub=True, **kwargs):
  import datasets  # Lazy: a heavy import, only hub users pay for it.
  what = f"{name}/{config}" + (f" split '{split}'" if split else "")
  cache_hint = "or, with a filled datasets cache, run with HF_DATASETS_OFFLINE=1"
  offline = datasets.config.HF_HUB_OFFLINE  # HF_DATASETS_OFFLINE, else HF_HUB_OFFLINE, as datasets reads them.
  endpoint = datasets.config.HF_ENDPOINT
  # A local dataset directory (which datasets loads before asking the hub) needs no network.
  if needs_hub and not offline and not os.path.isdir(name) and not reachable(endpoint):
    raise UserError(f"cannot load {what}: the Hugging Face hub ({endpoint}) is not reachable from here; "
                    f"{local_hint}, {cache_hint}")
  try:
    return datasets.load_dataset(name, config, split=split, **kwargs)
  except Exception as e:  # Auth, unknown name/config/split, not in the cache, a network error after retries.
    msg = str(e).strip().split("\n")[0][:200]
    if offline:
      raise UserError(f"could not load {what} from the datasets cache {datasets.config.HF_DATASETS_CACHE} in "
                      f"offline mode (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE; {type(e).__name__}: {msg}); "
                      f"fill the cache while online, or {local_hint}") from e
    raise UserError(f"could not load {what} from the Hugging Face hub ({type(e).__name__}: {msg}); "
                    f"check the name, or {local_hint}") from e
