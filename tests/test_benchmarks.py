"""The benchmark helpers that shape what is measured (no timing is asserted)."""

import importlib.util
import os
import re
import subprocess
import types

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_random_translation_batch_is_a_real_teacher_forced_batch():
  train_step = _load("train_step")
  like = dict.fromkeys(["inputs", "targets", "decoder_inputs", "inputs_segmentation", "targets_segmentation",
                        "inputs_position", "targets_position"])
  b = train_step.random_batch(like, [4, 5, 6], vocab=50, seed=0)
  assert b["inputs"].shape == (4, 5) and b["targets"].shape == (4, 6)
  assert set(b) == set(like)
  np.testing.assert_array_equal(b["decoder_inputs"][:, 0], 1)  # BOS, then the targets shifted right
  np.testing.assert_array_equal(b["decoder_inputs"][:, 1:], b["targets"][:, :-1])
  np.testing.assert_array_equal(b["targets_position"][2], np.arange(6))
  assert b["inputs_segmentation"].all() and b["targets_segmentation"].all()  # every slot real
  assert 3 <= b["inputs"].min() and b["targets"].max() < 50  # no PAD/BOS/EOS ids, inside the vocab


def test_random_lm_batch_shifts_by_one():
  train_step = _load("train_step")
  b = train_step.random_batch(dict.fromkeys(["inputs", "targets", "positions", "segment_ids"]), [3, 8], 68, 1)
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  np.testing.assert_array_equal(b["positions"][1], np.arange(8))
  assert b["segment_ids"].shape == (3, 8) and b["segment_ids"].all()


def test_train_step_also_rejects_a_data_change():
  """--also variants share the batches, so an override of the data is refused up front."""
  train_step = _load("train_step")
  with pytest.raises(SystemExit, match="not the data"):
    train_step.main(["--config", "gpt2_tiny", "--also", "data.batch_size=3", "--fast"])


@pytest.mark.slow
def test_device_check_smoke_run_on_cpu(capsys):
  """`--fast`: both train programs and the decode line on tiny configs; MFU and roofline printed."""
  # Kernels beside auto: tiled for the LM only (--kernels applies to both programs; one extra compile
  # is enough to check the side-by-side table and its verdict line).
  device_check = _load("device_check")
  device_check.FAST = {"gpt2_small": device_check.FAST["gpt2_small"]}
  device_check.main(["--fast", "--kernels", "tiled"])
  out = capsys.readouterr().out
  assert re.search(r"^gpt2_small/auto\s+[\d.]+\s+[\d,]+\s+[\d.]+\s+[\d.]+%", out, re.M), out
  assert re.search(r"^gpt2_small/tiled\s+[\d.]+", out, re.M), out
  assert re.search(r"^gpt2_small: fastest kernel request (auto|tiled) .* auto [\d.]+ ms = [\d.]+x", out, re.M), out
  assert re.search(r"decode gpt2_tiny batch 1.*roofline", out), out
  assert re.search(r"kernel: attention: tiled .*model.attention_impl=tiled: requested", out), out
  assert out.count("kernel: ") >= 3, out


def test_revisions_ab_runs_both_revisions_alternately_and_reads_their_tables(tmp_path, capsys):
  """revisions_ab.py: a table-printing command at HEAD and in the working tree, medians and the ratio."""
  ab = _load("revisions_ab")
  text = "gpt2: x\n\n          first call s  median s\nKV cache (prefill + decode)   1.500   0.2500  1,024  note\n"
  assert ab.rows(text) == {"KV cache (prefill + decode)": [1.5, 0.25, 1024.0]}
  script = tmp_path / "table.py"  # prints the revision's README size: the two trees differ if the tree is dirty
  script.write_text("import os\nprint(f'row one    {os.path.getsize(\"README.md\")}    2.0')\n")
  ab.main(["--before", "HEAD", "--rounds", "2", "--", str(script)])
  out = capsys.readouterr().out
  assert out.count(" before done") == 2 and out.count(" after done") == 2, out
  head = len(subprocess.run(["git", "show", "HEAD:README.md"], capture_output=True, check=True,
                            cwd=ROOT).stdout)
  now = os.path.getsize(os.path.join(ROOT, "README.md"))
  line = re.search(r"^row one\s+before\s+(\S+)\s+(\S+) \| after\s+(\S+)\s+(\S+) \| after/before (\S+)$", out, re.M)
  assert line, out
  assert float(line[1]) == pytest.approx(head, rel=1e-3) and float(line[3]) == pytest.approx(now, rel=1e-3)
  assert float(line[5]) == pytest.approx(1.0)  # --column 1: the 2.0's


def test_ab_function_traces_the_old_function_for_before(tmp_path, monkeypatch, capsys):
  """ab_function.py swaps MODULE.NAME for the 'before' step and puts today's back."""
  from jaxformer import losses  # pylint: disable=g-import-not-at-top
  ab = _load("ab_function")
  text = tmp_path / "corpus.txt"
  text.write_text("to be, or not to be, that is the question.\n" * 100)
  args = ["--config", "gpt2_tiny", f"data.text_path={text}", "--steps-per-call", "1", "--rounds", "1",
          "--steps", "1"]
  with pytest.raises(SystemExit, match="MODULE.NAME"):
    ab.main(["--before", "HEAD", "--function", "cross_entropy", *args])
  with pytest.raises(SystemExit, match="has no nope today"):
    ab.main(["--before", "HEAD", "--function", "losses.nope", *args])
  today, calls = losses.cross_entropy, []
  def old(*a, **kw):
    calls.append(1)
    return today(*a, **kw)
  monkeypatch.setattr(ab, "load_revision", lambda rev, module_name: types.SimpleNamespace(cross_entropy=old))
  ab.main(["--before", "REV", "--function", "losses.cross_entropy", *args])
  assert calls, "the 'before' step was not traced with the old function"
  assert losses.cross_entropy is today
  out = capsys.readouterr().out
  assert "losses.cross_entropy at REV vs today" in out and "after / before" in out
  assert re.search(r"temp memory [1-9][\d,]* -> [1-9][\d,]* MiB", out), out  # XLA's memory analysis, both steps


def test_prepare_benchmark_makes_a_seeded_corpus_outside_the_repository(tmp_path):
  bench = _load("prepare")
  if not os.path.isdir(bench.DEFAULT_DATA):
    pytest.skip("shared data absent")
  for name in ("a.txt", "b.txt"):
    bench.make_corpus(str(tmp_path / name), 300_000, bench.DEFAULT_DATA)
  text = (tmp_path / "a.txt").read_bytes()
  assert text == (tmp_path / "b.txt").read_bytes() and len(text) >= 300_000  # seeded
  docs = text.decode().split("\n")[:-1]
  assert len(docs) > 10 and all(d.strip() for d in docs)  # a document per line
  assert bench.digest(str(tmp_path)) == {n: __import__("hashlib").sha256((tmp_path / n).read_bytes()).hexdigest()
                                         for n in ("a.txt", "b.txt")}
  with pytest.raises(SystemExit, match="inside the repository"):
    bench.main(["--dir", os.path.join(ROOT, "corpus")])


def test_decode_vs_hf_writes_the_weights_transformers_reads_and_counts_the_roofline(tmp_path):
  """The peer gets our very weights (written through convert's tables, read back by its importer),
  and a step's roofline bytes are every weight once except the input embedding (untied) table."""
  import jax
  from jaxformer import convert
  bench = _load("decode_vs_hf")
  cfg, _, params = bench.build("llama_tiny", [])
  hf_dir = bench.write_hf(cfg, params, "llama", str(tmp_path / "hf"))
  back = convert.read_params(convert.SafetensorsReader(hf_dir), cfg, "llama", hf_dir)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, params)
  seconds, weights, kv = bench.roofline(cfg, params, batch=2, context=10, bandwidth=1e9, peak=1e30)
  m = cfg.model
  everything = sum(x.nbytes for x in jax.tree.leaves(params))
  assert weights == everything - m.vocab_size * m.d_model * 4  # the untied input table: one row per token
  assert kv == 2 * m.num_layers * m.kv_heads * m.dim_per_head * 4 * 10 * 2
  assert seconds == pytest.approx((weights + kv) / 1e9)
  assert bench.compare([[1, 2, 3]], [[1, 2, 3]]) == "identical"
  assert bench.compare([[1, 2, 3]], [[1, 5, 3]]) == "differ from token 1"


def test_decode_profile_sums_kernel_kinds_of_a_trace(tmp_path):
  import gzip
  import json
  bench = _load("decode_profile")
  (tmp_path / "plugins" / "profile").mkdir(parents=True)
  events = [{"ph": "X", "name": "ynn_fusion.1", "dur": 1000}, {"ph": "X", "name": "ynn_fusion", "dur": 500},
            {"ph": "X", "name": "gather_bitcast_fusion.12", "dur": 250},
            {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 9999}, {"ph": "X", "name": "$api.py:1 f", "dur": 7},
            {"ph": "i", "name": "dot"}]
  with gzip.open(tmp_path / "plugins" / "profile" / "host.perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert bench.kernel_times(str(tmp_path)) == {"ynn_fusion": pytest.approx(0.0015),
                                               "gather_bitcast_fusion": pytest.approx(0.00025)}


def test_sliding_window_counts_the_key_blocks_the_kernel_visits():
  """A 1k window over 16k tokens in 512-row blocks: 3 key blocks per query block (1 and 2 at the start)."""
  bench = _load("sliding_window")
  mean, most, blocks, rows = bench.key_blocks(16384, 1024)
  assert (blocks, rows, most) == (32, 512, 3) and mean == pytest.approx((1 + 2 + 3 * 30) / 32)
  assert bench.key_blocks(1024, 0)[:3] == (1.5, 2, 2)  # causal: the blocks up to the diagonal
  assert bench.keys_per_query(1024, 0) == pytest.approx(512.5)
  assert bench.keys_per_query(8, 4) == pytest.approx((1 + 2 + 3 + 4 * 5) / 8)
  with pytest.raises(SystemExit, match="multiple"):
    bench.configurations(types.SimpleNamespace(length=1000, short=300, rows=1, window=10))


@pytest.mark.slow
def test_sliding_window_smoke_run_on_cpu(tmp_path, capsys):
  """`--fast`: the three train steps (window, full, short rows) at 2k tokens, the table and the JSON."""
  import json  # pylint: disable=g-import-not-at-top
  bench = _load("sliding_window")
  out = tmp_path / "sliding_window.json"
  bench.main(["--fast", "--out", str(out)])
  text = capsys.readouterr().out
  assert re.search(r"^1 x 2,048, window 256\s+[\d.]+", text, re.M), text
  assert re.search(r"^8 x 256, full causal\s+[\d.]+", text, re.M), text
  assert "window / short, per token: " in text, text
  results = json.loads(out.read_text())["results"]
  assert [r["name"] for r in results] == ["window", "full", "short"]
  assert len({r["tokens_per_step"] for r in results}) == 1  # the same tokens per step in all three
  assert all(r["memory"]["temp"] > 0 and r["step_s"] > 0 for r in results)
  assert results[0]["key_blocks_mean"] < results[1]["key_blocks_mean"]  # the window skips key blocks
