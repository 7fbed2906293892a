"""Tests for jaxformer.hub: a machine without network gets one line in seconds, a filled cache still works."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxformer import config as config_lib
from jaxformer import data
from jaxformer import hub
from jaxformer import tasks
from jaxformer.errors import UserError

datasets = pytest.importorskip("datasets")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
UNREACHABLE = "http://127.0.0.1:9"  # The discard port: nothing listens there.


def closed_port():
  """A local port with no listener (bound, then released)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def listener():
  """A local TCP port that accepts connections."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]


@pytest.fixture
def no_proxy_env(monkeypatch):
  for v in PROXY_VARS:
    monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv(v.upper(), raising=False)


def test_reachable(listener, no_proxy_env, monkeypatch):
  assert hub.reachable(f"http://127.0.0.1:{listener}")
  assert not hub.reachable(f"http://127.0.0.1:{closed_port()}")
  assert not hub.reachable("https://hub.invalid", timeout=2)  # .invalid never resolves.
  assert not hub.reachable("huggingface.co")  # No scheme: no host to try (not the loopback).
  # Through a proxy the first hop is the proxy, unless NO_PROXY exempts the host.
  monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{listener}")
  assert hub.reachable("https://hub.invalid", timeout=2)
  monkeypatch.setenv("NO_PROXY", "hub.invalid")
  assert not hub.reachable("https://hub.invalid", timeout=2)


def run_train_wmt_base(tmp_path, **env):
  """`train.py --config wmt_base` with an empty datasets cache: (returncode, stderr, seconds)."""
  base = {k: v for k, v in os.environ.items()
          if not k.startswith("HF_") and k.lower() not in PROXY_VARS and k != "TRANSFORMERS_OFFLINE"}
  base.update(HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"),
              JAX_PLATFORMS="cpu", **env)
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "train.py", "--config", "wmt_base", "--workdir", str(tmp_path / "run")],
                        cwd=ROOT, env=base, capture_output=True, text=True, timeout=120)
  return proc.returncode, proc.stderr, time.perf_counter() - start


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_DATASETS_OFFLINE": "1"},
                                 {"HF_ENDPOINT": UNREACHABLE}])
def test_wmt_base_without_hub_fails_fast_with_one_line(tmp_path, env):
  rc, stderr, seconds = run_train_wmt_base(tmp_path, **env)
  assert rc == 2, stderr
  assert stderr.startswith("error:") and stderr.count("\n") == 1, stderr
  assert "Retrying" not in stderr and "wmt14/de-en" in stderr
  # Says how to go on: local files, or a filled cache in offline mode.
  assert "data.source=local data.train_src=" in stderr and "HF_DATASETS_OFFLINE" in stderr
  # Only catches huggingface_hub's retry loop (~25 s of back-off); this is not a speed test.
  assert seconds < 20


def fill_fake_cache(cache_dir, tmp_path):
  """Writes a tiny `wmt14`/`de-en` into a datasets cache the way load_dataset leaves one, without network."""
  src = tmp_path / "jsonl"
  src.mkdir()
  splits = {"train": 5, "validation": 2, "test": 3}
  for split, n in splits.items():
    with open(src / f"{split}.jsonl", "w") as f:
      for i in range(n):
        f.write(json.dumps({"translation": {"de": f"hallo {split} {i}", "en": f"hello {split} {i}"}}) + "\n")
  build = tmp_path / "build"
  datasets.load_dataset("json", data_files={s: str(src / f"{s}.jsonl") for s in splits}, cache_dir=str(build))
  built = next(p for p in build.glob("json/*/*/*") if (p / "dataset_info.json").exists())
  # Cached hub datasets live in <cache>/<name>/<config>/<version>/<hash>/<name>-<split>.arrow.
  dst = cache_dir / "wmt14" / "de-en" / built.parts[-2] / built.parts[-1]
  dst.mkdir(parents=True)
  for f in built.glob("json-*.arrow"):
    (dst / f.name.replace("json-", "wmt14-")).write_bytes(f.read_bytes())
  info = json.loads((built / "dataset_info.json").read_text())
  info.update(config_name="de-en", builder_name="wmt14", dataset_name="wmt14")
  (dst / "dataset_info.json").write_text(json.dumps(info))


def test_filled_cache_works_offline(tmp_path):
  cache = tmp_path / "cache"
  fill_fake_cache(cache, tmp_path)
  env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
  env.update(HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(cache), HF_ENDPOINT=UNREACHABLE)
  code = ("import json; from jaxformer import data; "
          "print(json.dumps([data.load_translation('hf:wmt14', s, 'en', 'de') for s in ('validation', 'test')]))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  (dev_en, dev_de), (test_en, _) = json.loads(proc.stdout)
  assert dev_en == ["hello validation 0", "hello validation 1"] and dev_de[1] == "hallo validation 1"
  assert len(test_en) == 3


def test_offline_mode_asks_the_cache_first(monkeypatch):
  # With offline mode on, nothing is refused up front: datasets gets to read its cache.
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(hub, "reachable", lambda *a, **k: pytest.fail("checked the network in offline mode"))
  calls = []

  def not_cached(name, config, split=None):
    calls.append((name, config, split))
    raise ConnectionError("Couldn't reach 'wikitext' on the Hub (OfflineModeIsEnabled)")

  monkeypatch.setattr(datasets, "load_dataset", not_cached)
  with pytest.raises(UserError, match=r"wikitext/wikitext-103-raw-v1 from the datasets cache .* offline mode.*"
                                      r"data\.source=local data\.text_path="):
    tasks.LMTask(config_lib.load_config("wikitext103"), "unused")
  assert calls == [("wikitext", "wikitext-103-raw-v1", None)]


def test_unreachable_hub_refused_before_load_dataset(monkeypatch):
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(datasets.config, "HF_ENDPOINT", UNREACHABLE)
  monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("load_dataset called"))
  with pytest.raises(UserError, match=r"hub \(http://127\.0\.0\.1:9\) is not reachable.*data\.text_path=FILE.*"
                                      r"HF_DATASETS_OFFLINE=1"):
    tasks.LMTask(config_lib.load_config("wikitext103"), "unused")
  with pytest.raises(UserError, match=r"wmt14/de-en split 'test'.*data\.train_src=FILE\.en data\.train_tgt=FILE\.de"):
    data.load_translation("hf:wmt14", "test", "en", "de")


def test_online_failure_keeps_datasets_message(monkeypatch):
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(hub, "reachable", lambda *a, **k: True)

  def missing(name, config, split=None):
    raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub\nsecond line")

  monkeypatch.setattr(datasets, "load_dataset", missing)
  with pytest.raises(UserError, match=r"could not load wmt41/de-en split 'train' from the Hugging Face hub "
                                      r"\(FileNotFoundError: Dataset 'wmt41' doesn't exist on the Hub\); check the name"
                     ) as e:
    data.load_translation("hf:wmt41", "train", "en", "de")
  assert "\n" not in str(e.value)
