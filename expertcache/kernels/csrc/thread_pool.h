// The kernels' threads: units of work handed out through one atomic counter, where the caller never
// waits for a worker that has not started.
//
// With OpenMP (ATen's parallel_for) every call ends at a barrier that waits for all threads of the
// team: on a machine shared with other processes, a worker that is not running at that moment
// costs a scheduler time slice per call (measured on 2 busy cores: 2 threads 4-15x slower than 1).
// Here the caller works through the units itself and returns when every unit is done: a worker
// that wakes late finds nothing left and goes back to waiting. Only a unit a worker has started is
// waited for, so units are kept small (tens of microseconds). Units are handed out in increasing
// order, so a unit may wait for units of lower index (all already taken by running threads): the MoE
// kernel's down units wait for their expert's gate/up units that way.
//
// Workers: at::get_num_threads() - 1 (torch.set_num_threads / --threads), started on first use.
// After a job a worker spins for SPIN_US (the next kernel call usually comes sooner; yielding the
// core now and then), then sleeps
// on a condition variable. A forked child starts with no workers (pthread_atfork).

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pool {

struct Job {
  void (*call)(const void*, int64_t);  // call(ctx, unit)
  const void* ctx;
  int64_t n;
  int64_t helpers;  // workers with index < helpers take part
  std::atomic<int64_t> next{0}, done{0};
};

// how long an idle worker spins before it sleeps. Yardstick bf16 decode, spin times alternating in one process (quiet):
// 200 us 33.1 tok/s, 500 us 35.0, 1000 us 35.0; beside two CPU-bound processes 200 / 500 us: 17.6 / 17.5
constexpr int64_t SPIN_US = 500;

class Pool {
 public:
  template <class Fn>
  void run(int64_t n, const Fn& fn) {
    const int64_t want = count_.load(std::memory_order_relaxed);
    const int64_t nt = std::min<int64_t>(want > 0 ? want : at::get_num_threads(), n);
    if (nt <= 1 || at::in_parallel_region()) {
      for (int64_t u = 0; u < n; ++u) fn(u);
      return;
    }
    grow(nt - 1);
    Job job;
    job.call = [](const void* c, int64_t u) { (*static_cast<const Fn*>(c))(u); };
    job.ctx = &fn;
    job.n = n;
    job.helpers = nt - 1;
    current_.store(&job);
    epoch_.fetch_add(1);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> g(m_); }
      cv_.notify_all();
    }
    work(job);
    while (job.done.load(std::memory_order_acquire) < n) _mm_pause();
    current_.store(nullptr);
    while (refs_.load() > 0) _mm_pause();  // a worker between taking the job and leaving it
  }

  void set_threads(int64_t n) { count_.store(n); }  // 0: torch's thread count
  int64_t threads() const { return count_.load(); }

  void reset_after_fork() {  // the child has none of the parent's threads (all detached): forget them
    new (&m_) std::mutex();
    new (&grow_m_) std::mutex();
    new (&cv_) std::condition_variable();
    threads_.clear();
    current_.store(nullptr);
    refs_.store(0);
    sleepers_.store(0);
  }

 private:
  static void work(Job& job) {
    for (int64_t u; (u = job.next.fetch_add(1)) < job.n;) {
      job.call(job.ctx, u);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void grow(int64_t want) {
    if (int64_t(threads_.size()) >= want) return;
    std::lock_guard<std::mutex> g(grow_m_);
    while (int64_t(threads_.size()) < want) {
      const int64_t index = threads_.size();
      threads_.emplace_back([this, index] { loop(index); });
      threads_.back().detach();
    }
  }

  void loop(int64_t index) {
    uint64_t seen = 0;
    for (;;) {
      wait_for_next(seen);
      refs_.fetch_add(1);  // before reading the job: run() does not return while refs_ > 0
      seen = epoch_.load();
      Job* job = current_.load();
      if (job && index < job->helpers) work(*job);
      refs_.fetch_sub(1);
    }
  }

  // until a job newer than epoch `seen` is published (spinning first, then asleep)
  void wait_for_next(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
    for (int i = 0;; ++i) {
      if (epoch_.load(std::memory_order_relaxed) != seen) return;
      _mm_pause();
      if ((i & 255) == 255) {
        if (std::chrono::steady_clock::now() > until) break;
        std::this_thread::yield();  // a busy core: let its other threads (the caller's among them) run
      }
    }
    std::unique_lock<std::mutex> lock(m_);
    sleepers_.fetch_add(1);
    cv_.wait(lock, [&] { return epoch_.load() != seen; });
    sleepers_.fetch_sub(1);
  }

  std::vector<std::thread> threads_;
  std::mutex grow_m_, m_;
  std::condition_variable cv_;
  std::atomic<Job*> current_{nullptr};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> refs_{0}, sleepers_{0};
};

inline Pool& instance() {
  static Pool* p = [] {
    Pool* q = new Pool();  // never destroyed: detached workers outlive static destruction
    pthread_atfork(nullptr, nullptr, [] { instance().reset_after_fork(); });
    return q;
  }();
  return *p;
}

// fn(unit) for unit in [0, n), on the caller and up to at::get_num_threads() - 1 workers
template <class Fn>
void run_units(int64_t n, const Fn& fn) {
  instance().run(n, fn);
}

}  // namespace pool
