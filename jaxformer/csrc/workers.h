// The CPU kernels' worker threads (jaxformer/csrc: qmatmul.cc, paged_attention.cc share one pool).
#ifndef JAXFORMER_CSRC_WORKERS_H_
#define JAXFORMER_CSRC_WORKERS_H_

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace jaxformer {

// Our own workers for the split decode products, not XLA's pool: a decode step makes ~70 short calls (50-300 us
// each), and waking a sleeping pool thread for each cost tens of microseconds (a 64 x 64 product took 53 us
// through the pool, 2 us inline). (The blocked prefill product, milliseconds a call, runs on XLA's pool instead:
// qmatmul.cc's PoolFor.) A worker spins (yielding its core to anything runnable) for kSpin after
// each job, so the next call finds it awake, then sleeps on a condition variable: an idle process burns
// nothing. One caller at a time: a second concurrent caller (another XLA execution) runs inline.
class Workers {
 public:
  static Workers& Get() {
    static Workers* workers = new Workers();  // one per process; never destroyed: threads may still wait at exit
    return *workers;
  }
  int64_t size() const { return static_cast<int64_t>(threads_) + 1; }  // workers plus the caller

  // Runs job(c) for c in [0, chunks) on the workers and this thread; false (nothing run) when busy.
  bool Run(int64_t chunks, const std::function<void(int64_t)>& job) {
    std::unique_lock<std::mutex> busy(run_, std::try_to_lock);
    if (!busy.owns_lock() || getpid() != pid_) return false;  // busy, or a forked child (no workers)
    job_ = &job;
    done_.store(0, std::memory_order_relaxed);
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation = generation_.load(std::memory_order_relaxed) + 1;
      // chunks are claimed from `ticket_` = generation << 32 | chunks << 16 | next chunk, one atomic: a
      // worker still holding an older generation cannot claim (or count) a chunk of this job
      ticket_.store(generation << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_release);
      generation_.store(generation, std::memory_order_release);
    }
    cv_.notify_all();
    Claim(generation);
    while (done_.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
    return true;
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(300);
  Workers() : pid_(getpid()) {
    threads_ = std::min(std::max(1u, std::thread::hardware_concurrency()), 64u) - 1;
    for (unsigned i = 0; i < threads_; ++i) std::thread([this] { Loop(); }).detach();
  }
  void Claim(uint64_t generation) {
    for (uint64_t t = ticket_.load(std::memory_order_acquire);;) {
      if ((t >> 32) != generation || (t & 0xffff) >= ((t >> 16) & 0xffff)) return;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        (*job_)(static_cast<int64_t>(t & 0xffff));
        done_.fetch_add(1, std::memory_order_acq_rel);
        t = ticket_.load(std::memory_order_acquire);
      }
    }
  }
  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      while (generation_.load(std::memory_order_acquire) == seen) {
        if (std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        } else {
          std::this_thread::yield();
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      Claim(seen);
    }
  }
  unsigned threads_ = 0;
  const pid_t pid_;
  std::mutex run_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0}, ticket_{0};
  std::atomic<int64_t> done_{0};
  const std::function<void(int64_t)>* job_ = nullptr;
};

// Runs f(begin, end) over [0, n) (at least `grain` items per thread) split across the workers and this thread; returns when all are done.
// Products of fewer than JF_INLINE_BYTES weight bytes run on the calling thread alone (splitting them saves
// less than the hand-over costs).
#ifndef JF_INLINE_BYTES
#define JF_INLINE_BYTES (1 << 18)
#endif
template <typename F>
inline void ParallelFor(int64_t n, int64_t bytes, F f, int64_t grain = 16) {
  Workers& workers = Workers::Get();
  const int64_t chunks = bytes < JF_INLINE_BYTES ? 1 : std::min<int64_t>(workers.size(), std::max<int64_t>(1, n / grain));
  auto bound = [&](int64_t c) { return n * c / chunks; };
  if (chunks > 1 && workers.Run(chunks, [&](int64_t c) { f(bound(c), bound(c + 1)); })) return;
  f(0, n);
}

}  // namespace jaxformer

#endif  // JAXFORMER_CSRC_WORKERS_H_
