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
//
// Timing (off unless EXPERTCACHE_POOL_STATS=1 at the first job): per job site (the Fn type, named by
// its invoker's address), jobs, units, the units the helpers took, and the job's wall time split into
// the caller's own work, its wait after it (the helpers' last units, or a helper that has not let go
// of the job) and the delay until a helper took its first unit. Read and reset through
// expertcache_pool_stats (fast_kernels.cpp; bench/decode_breakdown.py --moe-gap).

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
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
  std::atomic<int64_t> helper_units{0}, first_helper_ns{0}, helper_cpu_ns{0};  // timing only
};

struct SiteStats {  // one job site's sums (timing on)
  const void* site = nullptr;
  int64_t jobs = 0, units = 0, helper_units = 0, ns = 0, caller_work_ns = 0, wait_ns = 0, helper_start_ns = 0,
          work_cpu_ns = 0;  // CPU time in units, caller and helpers (a descheduled thread's wait not counted)
};
constexpr int MAX_SITES = 64;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t cpu_ns() {  // this thread's CPU time
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

inline bool stats_on() {
  static const bool on = [] {
    const char* e = std::getenv("EXPERTCACHE_POOL_STATS");
    return e != nullptr && e[0] == '1';
  }();
  return on;
}

// how long an idle worker spins before it sleeps. Yardstick bf16 decode, spin times alternating in one process (quiet):
// 200 us 33.1 tok/s, 500 us 35.0, 1000 us 35.0; beside two CPU-bound processes 200 / 500 us: 17.6 / 17.5
constexpr int64_t SPIN_US = 500;

class Pool {
 public:
  template <class Fn>
  void run(int64_t n, const Fn& fn) {
    const int64_t want = count_.load(std::memory_order_relaxed);
    const int64_t nt = std::min<int64_t>(want > 0 ? want : at::get_num_threads(), n);
    const bool timed = stats_on();
    const int64_t t0 = timed ? now_ns() : 0, c0 = timed ? cpu_ns() : 0;
    Job job;
    job.call = [](const void* c, int64_t u) { (*static_cast<const Fn*>(c))(u); };
    job.ctx = &fn;
    job.n = n;
    job.helpers = nt - 1;
    if (nt <= 1 || at::in_parallel_region()) {
      for (int64_t u = 0; u < n; ++u) fn(u);
      if (timed) record(job, t0, now_ns(), now_ns(), cpu_ns() - c0);
      return;
    }
    grow(nt - 1);
    current_.store(&job);
    epoch_.fetch_add(1);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> g(m_); }
      cv_.notify_all();
    }
    work(job);
    const int64_t t1 = timed ? now_ns() : 0, c1 = timed ? cpu_ns() : 0;
    while (job.done.load(std::memory_order_acquire) < n) _mm_pause();
    current_.store(nullptr);
    while (refs_.load() > 0) _mm_pause();  // a worker between taking the job and leaving it
    if (timed) record(job, t0, t1, now_ns(), c1 - c0);
  }

  // the sums of up to `max` sites into out (timing on) -> the number of sites; reset: zero them after
  int copy_stats(SiteStats* out, int max, bool reset) {
    std::lock_guard<std::mutex> g(stats_m_);
    int k = 0;
    for (int i = 0; i < MAX_SITES && k < max; ++i)
      if (stats_[i].site) out[k++] = stats_[i];
    if (reset)
      for (auto& st : stats_) st = SiteStats{};
    return k;
  }

  void set_threads(int64_t n) { count_.store(n); }  // 0: torch's thread count
  int64_t threads() const { return count_.load(); }

  void reset_after_fork() {  // the child has none of the parent's threads (all detached): forget them
    new (&m_) std::mutex();
    new (&grow_m_) std::mutex();
    new (&stats_m_) std::mutex();
    new (&cv_) std::condition_variable();
    threads_.clear();
    current_.store(nullptr);
    refs_.store(0);
    sleepers_.store(0);
  }

 private:
  static void work(Job& job, bool helper = false) {
    int64_t mine = 0;
    const int64_t c0 = helper && stats_on() ? cpu_ns() : 0;
    for (int64_t u; (u = job.next.fetch_add(1)) < job.n; ++mine) {
      if (helper && mine == 0 && stats_on()) {
        int64_t zero = 0;
        job.first_helper_ns.compare_exchange_strong(zero, now_ns());
      }
      job.call(job.ctx, u);
      job.done.fetch_add(1, std::memory_order_release);
    }
    if (helper && mine) {
      job.helper_units.fetch_add(mine);
      if (stats_on()) job.helper_cpu_ns.fetch_add(cpu_ns() - c0);
    }
  }

  void record(const Job& job, int64_t t0, int64_t t1, int64_t t2, int64_t caller_cpu) {
    std::lock_guard<std::mutex> g(stats_m_);
    const void* site = reinterpret_cast<const void*>(job.call);
    int i = int((reinterpret_cast<uintptr_t>(site) >> 4) % MAX_SITES);
    for (int probe = 0; probe < MAX_SITES && stats_[i].site && stats_[i].site != site; ++probe) i = (i + 1) % MAX_SITES;
    SiteStats& st = stats_[i];
    if (st.site && st.site != site) return;  // table full
    st.site = site;
    st.jobs += 1;
    st.units += job.n;
    st.helper_units += job.helper_units.load();
    st.ns += t2 - t0;
    st.caller_work_ns += t1 - t0;
    st.wait_ns += t2 - t1;
    st.work_cpu_ns += caller_cpu + job.helper_cpu_ns.load();
    const int64_t h = job.first_helper_ns.load();
    st.helper_start_ns += h ? h - t0 : t2 - t0;  // no helper took a unit: the whole job
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
      if (job && index < job->helpers) work(*job, true);
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
  std::mutex grow_m_, m_, stats_m_;
  SiteStats stats_[MAX_SITES];
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
