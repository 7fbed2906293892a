"""Batched translation for `jaxformer.serve`: queued requests beam-searched together with the run's decode settings.

A translation run has no KV cache to share across requests, so there is no continuous batching
here: requests wait in a queue, and a worker thread takes as many as fill `max_batch` sentences
(at least one request) and translates them in one `evaluate.translate` call, with the run's
decode.* settings (beam size, alpha, length penalty, max_extra_len, suppress_pad) and a fixed
row count, so every call runs one of the programs `warm_up` compiled.
"""

import collections
import threading
import time

from jaxformer import evaluate
from jaxformer.errors import UserError


class Job:
  """One request: its sentences, then its translations (or an error) once `done` is set."""

  def __init__(self, texts):
    self.texts = list(texts)
    self.translations = None
    self.error = None
    self.done = threading.Event()
    self.submitted = time.perf_counter()


class TranslationBatcher:
  """The queue and worker thread that translate requests for one run (model, params, tokenizer, cfg)."""

  def __init__(self, cfg, model, params, tokenizer, max_batch=8, max_waiting=256):
    self.cfg, self.model, self.params, self.tokenizer = cfg, model, params, tokenizer
    self.max_batch, self.max_waiting = max_batch, max_waiting
    self.waiting = collections.deque()
    self.busy = 0  # sentences being translated now
    self._cv = threading.Condition()
    self._thread = None
    self._stop = False
    # The longest source (tokens + EOS) the model's position table holds.
    self.max_source_len = cfg.model.max_len
    self.stats = {"sentences": 0, "source_tokens": 0}

  def check(self, texts):
    """Raises UserError (one line naming the limit) for a request this run cannot translate."""
    if not texts:
      raise UserError("'text' is empty: send a string or a non-empty list of strings")
    for i, t in enumerate(texts):
      n = len(self.tokenizer.encode(t)) + 1
      if n > self.max_source_len:
        raise UserError(f"'text'[{i}] is {n} tokens with EOS, above this model's {self.max_source_len}")
    if len(self.waiting) >= self.max_waiting:
      raise OverflowError(f"{len(self.waiting)} requests are waiting (--max-waiting {self.max_waiting})")

  def translate(self, texts):
    """Sentences -> translations in one `evaluate.translate` call with the run's decode settings."""
    d = self.cfg.decode
    return evaluate.translate(self.model, self.params, self.tokenizer, texts, d.beam_size, d.alpha, d.max_extra_len,
                              batch_size=self.max_batch, length_penalty=d.length_penalty,
                              early_stopping=d.hf_early_stopping, suppress_pad=d.suppress_pad)

  def warm_up(self):
    """Compiles the programs of every source width the model can take (evaluate's fixed widths); -> seconds."""
    start = time.perf_counter()
    d, eos = self.cfg.decode, self.tokenizer.eos_id
    for width in evaluate.source_widths(self.max_source_len):
      ids = [[eos + 1] * (min(width, self.max_source_len) - 1) + [eos]]  # a source that pads to this width
      evaluate.translate_ids(self.model, self.params, ids, d.beam_size, d.alpha, d.max_extra_len, self.max_batch,
                             length_penalty=d.length_penalty, early_stopping=d.hf_early_stopping,
                             suppress_pad=d.suppress_pad)
    return time.perf_counter() - start

  def submit(self, texts):
    """Queues a request (checked) -> its Job."""
    job = Job(texts)
    with self._cv:
      self.waiting.append(job)
      self._cv.notify()
    return job

  def start(self):
    """Starts the worker thread."""
    self._thread = threading.Thread(target=self._loop, name="jaxformer-translate", daemon=True)
    self._thread.start()

  def stop(self):
    """Stops the worker thread after the batch it is translating."""
    with self._cv:
      self._stop = True
      self._cv.notify()
    if self._thread is not None:
      self._thread.join()

  def _take(self):
    """The next batch of jobs: the first waiting one, then others while the sentences fit in max_batch."""
    jobs = [self.waiting.popleft()]
    total = len(jobs[0].texts)
    while self.waiting and total + len(self.waiting[0].texts) <= self.max_batch:
      total += len(self.waiting[0].texts)
      jobs.append(self.waiting.popleft())
    return jobs

  def _loop(self):
    while True:
      with self._cv:
        self._cv.wait_for(lambda: self.waiting or self._stop)
        if self._stop and not self.waiting:
          return
        jobs = self._take()
        self.busy = sum(len(j.texts) for j in jobs)
      texts = [t for j in jobs for t in j.texts]
      try:
        out = self.translate(texts)
      except Exception as e:  # pylint: disable=broad-except
        for j in jobs:
          j.error = e
          j.done.set()
      else:
        self.stats["sentences"] += len(texts)
        self.stats["source_tokens"] += sum(len(self.tokenizer.encode(t)) + 1 for t in texts)
        for j in jobs:
          j.translations, out = out[:len(j.texts)], out[len(j.texts):]
          j.done.set()
      finally:
        self.busy = 0
