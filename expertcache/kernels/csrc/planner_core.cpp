// The step planner's device-tier policies in C++ (experts/policy.py `NativePolicy`): lru, the lfru
// family (lfru, lfu, lfru-admit) and adaptive over lfru-family candidates, with the decisions of the
// Python policies (the reference; tests/test_planner.py compares every placement, victim and
// refusal), and one layer step's table accesses in one call (`step`).
//
// Legend: E experts of the layer, C slots of the tier, t the layer's step time.
//   slot_of [E] (-1 absent): this core's copy of the Python SlotTable's; kept by insert(e, t, slot),
//   remove(e) and step(), the only ways the table changes.
// A scored policy ranks residents by (rank, last use, slot, expert) (experts/policy.py `_Scored`):
// rank = log(score) + t_score * lam with lam = -log(decay) (score itself where decay = 1), a key
// that changes only on a use, so a min-heap with lazy deletion holds the order. The arithmetic is
// Python's (libm pow / log, no fused multiply-add), so equal inputs give equal keys.
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "registry.h"

namespace {

constexpr double NEG_INF = -std::numeric_limits<double>::infinity();
constexpr double POS_INF = std::numeric_limits<double>::infinity();

struct Entry {
  double rank, last;
  int64_t slot;
  int e;
  uint64_t id;  // live while the expert's current entry id equals it (lazy deletion)
};

inline bool less_key(const Entry& a, const Entry& b) {  // Python's tuple order of (rank, last, slot, e)
  if (a.rank != b.rank) return a.rank < b.rank;
  if (a.last != b.last) return a.last < b.last;
  if (a.slot != b.slot) return a.slot < b.slot;
  return a.e < b.e;
}
struct Greater {  // std heaps are max-heaps: this comparator makes a min-heap
  bool operator()(const Entry& a, const Entry& b) const { return less_key(b, a); }
};

// What adaptive's candidates share (kept by the leader): last use, residents, fresh inserts.
// The least live entry of a lazy-deletion min-heap whose expert is not pinned (-1: none): stale entries
// (their expert's live id moved on) are dropped, pinned ones set aside and pushed back.
inline int least_unpinned(std::vector<Entry>& heap, const std::vector<uint64_t>& live,
                          const std::vector<char>& pinned) {
  std::vector<Entry> aside;
  int victim = -1;
  while (!heap.empty()) {
    const Entry& x = heap.front();
    if (!pinned[x.e] && live[x.e] == x.id) {
      victim = x.e;  // its entry stays on top: the caller retires it through `live`
      break;
    }
    if (pinned[x.e] && live[x.e] == x.id) aside.push_back(x);
    std::pop_heap(heap.begin(), heap.end(), Greater());
    heap.pop_back();
  }
  for (const Entry& x : aside) {
    heap.push_back(x);
    std::push_heap(heap.begin(), heap.end(), Greater());
  }
  return victim;
}

struct Shared {
  std::vector<double> last_use;
  std::vector<char> resident, is_fresh;
  std::vector<Entry> fresh_entry;
  std::vector<int> fresh;  // experts inserted at the current time and not used since (order unused)
  int n_resident = 0;
  explicit Shared(int E) : last_use(E, NEG_INF), resident(E, 0), is_fresh(E, 0), fresh_entry(E) {}
  void fresh_pop(int e) {
    if (!is_fresh[e]) return;
    is_fresh[e] = 0;
    fresh.erase(std::find(fresh.begin(), fresh.end(), e));
  }
};

// One lfru-family policy (policy.py LFRU / LFU / LFRUAdmit over _Scored).
struct Ranker {
  Shared* sh;
  const std::vector<int>* slot_of;
  double decay, lam;
  bool admission;
  int capacity;
  std::vector<double> score;
  std::vector<int64_t> t_score;
  int64_t now = 0;
  bool ranking = true;
  std::vector<Entry> heap;
  std::vector<uint64_t> live;
  uint64_t next_id = 1;

  Ranker(Shared* s, const std::vector<int>* so, int E, int cap, double d, double l, bool adm)
      : sh(s), slot_of(so), decay(d), lam(l), admission(adm), capacity(cap), score(E, 0.0), t_score(E, 0),
        live(E, 0) {}

  double rank_of(double s, int64_t t) const {
    if (lam == 0.0) return s;
    return s > 0 ? std::log(s) + static_cast<double>(t) * lam : NEG_INF;
  }
  Entry make_entry(int e) {
    return Entry{rank_of(score[e], t_score[e]), sh->last_use[e], (*slot_of)[e], e, next_id++};
  }
  void push_entry(const Entry& x) {
    live[x.e] = x.id;
    heap.push_back(x);
    std::push_heap(heap.begin(), heap.end(), Greater());
  }
  void pop() {
    std::pop_heap(heap.begin(), heap.end(), Greater());
    heap.pop_back();
  }
  void push(int e) {
    push_entry(make_entry(e));
    if (heap.size() > static_cast<size_t>(4 * sh->n_resident + 64)) rebuild();
  }
  void rebuild() {  // every resident's live entry afresh; fresh experts stay aside
    std::fill(live.begin(), live.end(), 0);
    for (int e : sh->fresh) sh->fresh_entry[e] = make_entry(e);
    heap.clear();
    for (int e = 0; e < static_cast<int>(score.size()); ++e)
      if (sh->resident[e] && !sh->is_fresh[e]) {
        Entry x = make_entry(e);
        live[e] = x.id;
        heap.push_back(x);
      }
    std::make_heap(heap.begin(), heap.end(), Greater());
  }
  void set_ranking(bool on) {
    if (on && !ranking) {
      ranking = true;
      rebuild();
    } else if (!on && ranking) {
      ranking = false;
      heap.clear();
      std::fill(live.begin(), live.end(), 0);
    }
  }
  void clock(int64_t t) {
    if (t <= now) return;
    now = t;
    if (sh->fresh.empty()) return;
    if (ranking)
      for (int e : sh->fresh) push_entry(sh->fresh_entry[e]);
    for (int e : sh->fresh) sh->is_fresh[e] = 0;
    sh->fresh.clear();
  }
  const Entry* top() {
    while (!heap.empty()) {
      const Entry& x = heap.front();
      if (live[x.e] == x.id) return &heap.front();
      pop();
    }
    return nullptr;
  }
  void note(int e, int64_t t) {
    score[e] = score[e] * std::pow(decay, static_cast<double>(t - t_score[e])) + 1.0;
    t_score[e] = t;
  }
  void touch(int e, int64_t t) {
    if (t > now) clock(t);
    sh->fresh_pop(e);
    sh->last_use[e] = static_cast<double>(t);
    note(e, t);
    if (ranking && sh->resident[e]) push(e);
  }
  void insert(int e, int64_t t) {  // as _Scored.insert: a set add and a dict store (both idempotent)
    clock(t);
    if (!sh->resident[e]) {
      sh->resident[e] = 1;
      sh->n_resident += 1;
    }
    if (t == now) {
      if (!sh->is_fresh[e]) {
        sh->is_fresh[e] = 1;
        sh->fresh.push_back(e);
      }
      if (ranking) sh->fresh_entry[e] = make_entry(e);
    } else if (ranking) {
      push(e);
    }
  }
  void remove(int e) {
    if (sh->resident[e]) {
      sh->resident[e] = 0;
      sh->n_resident -= 1;
    }
    sh->fresh_pop(e);
    live[e] = 0;
  }
  bool admit(int e, int64_t t, bool prefetch) {
    clock(t);
    if (!admission || prefetch || sh->n_resident < capacity) return true;
    double mine = score[e] * std::pow(decay, static_cast<double>(t - t_score[e])) + 1.0;
    if (!ranking) set_ranking(true);
    const Entry* tp = top();
    double least = POS_INF;
    for (int f : sh->fresh) least = std::min(least, sh->fresh_entry[f].rank);
    if (tp != nullptr) least = std::min(least, tp->rank);
    if (rank_of(mine, t) >= least) return true;
    score[e] = mine;  // a refused use still counts
    t_score[e] = t;
    return false;
  }
  int choose(const std::vector<char>& pinned) {
    if (!ranking) set_ranking(true);
    int victim = least_unpinned(heap, live, pinned);
    if (victim < 0) {  // every older candidate pinned: the least of this step's inserts
      const Entry* best = nullptr;
      for (int f : sh->fresh)
        if (!pinned[f] && (best == nullptr || less_key(sh->fresh_entry[f], *best))) best = &sh->fresh_entry[f];
      if (best != nullptr) victim = best->e;
    }
    return victim;
  }
};

// policy.py _GhostLFRU: a cache of C slots run by an lfru-family policy, for its hit count only.
struct Ghost {
  double decay, lam;
  bool admission;
  int capacity;
  std::vector<double> score, last;
  std::vector<int64_t> t_score;
  std::vector<int> slot_of, free_slots;
  std::vector<uint64_t> live;
  std::vector<Entry> heap;
  std::vector<char> pinned;
  uint64_t next_id = 1;

  Ghost(int E, int cap, double d, double l, bool adm)
      : decay(d), lam(l), admission(adm), capacity(cap), score(E, 0.0), last(E, NEG_INF), t_score(E, 0),
        slot_of(E, -1), live(E, 0), pinned(E, 0) {
    for (int s = cap - 1; s >= 0; --s) free_slots.push_back(s);
  }
  void pop() {
    std::pop_heap(heap.begin(), heap.end(), Greater());
    heap.pop_back();
  }
  int step(const std::vector<int>& uses, int64_t t) {
    int hits = 0;
    for (int e : uses) {
      int s = slot_of[e];
      if (s >= 0) {
        hits += 1;
      } else {
        if (admission && free_slots.empty()) {
          double mine = score[e] * std::pow(decay, static_cast<double>(t - t_score[e])) + 1.0;
          while (live[heap.front().e] != heap.front().id) pop();
          double r = lam == 0.0 ? mine : std::log(mine) + static_cast<double>(t) * lam;
          if (r < heap.front().rank) {
            score[e] = mine;
            t_score[e] = t;
            continue;
          }
        }
        if (!free_slots.empty()) {
          s = free_slots.back();
          free_slots.pop_back();
        } else {
          int v = least_unpinned(heap, live, pinned);
          if (v < 0) continue;  // every slot pinned
          s = slot_of[v];
          slot_of[v] = -1;
          live[v] = 0;
        }
        slot_of[e] = s;
      }
      double sc = score[e] = score[e] * std::pow(decay, static_cast<double>(t - t_score[e])) + 1.0;
      t_score[e] = t;
      last[e] = static_cast<double>(t);
      Entry x{lam == 0.0 ? sc : std::log(sc) + static_cast<double>(t) * lam, static_cast<double>(t), s, e,
              next_id++};
      live[e] = x.id;
      heap.push_back(x);
      std::push_heap(heap.begin(), heap.end(), Greater());
      pinned[e] = 1;
    }
    for (int e : uses) pinned[e] = 0;
    if (heap.size() > static_cast<size_t>(4 * capacity + 64)) {  // drop the stale entries
      std::vector<Entry> keep;
      for (const Entry& x : heap)
        if (live[x.e] == x.id) keep.push_back(x);
      heap.swap(keep);
      std::make_heap(heap.begin(), heap.end(), Greater());
    }
    return hits;
  }
};

struct Impl {
  virtual ~Impl() = default;
  virtual void touch(int e, int64_t t) = 0;
  virtual void insert(int e, int64_t t) = 0;
  virtual void remove(int e) = 0;
  virtual bool admit(int e, int64_t t, bool prefetch) = 0;
  virtual int choose(const std::vector<char>& pinned) = 0;
  virtual int leader() const { return 0; }
};

struct Lru : Impl {  // policy.py LRU: an OrderedDict as a linked list over experts
  std::vector<int> prev, next;
  std::vector<char> in;
  int head = -1, tail = -1;
  explicit Lru(int E) : prev(E, -1), next(E, -1), in(E, 0) {}
  void unlink(int e) {
    (prev[e] >= 0 ? next[prev[e]] : head) = next[e];
    (next[e] >= 0 ? prev[next[e]] : tail) = prev[e];
    in[e] = 0;
  }
  void append(int e) {
    prev[e] = tail;
    next[e] = -1;
    (tail >= 0 ? next[tail] : head) = e;
    tail = e;
    in[e] = 1;
  }
  void touch(int e, int64_t) override {
    if (in[e]) {
      unlink(e);
      append(e);
    }
  }
  void insert(int e, int64_t) override {
    if (in[e]) unlink(e);
    append(e);
  }
  void remove(int e) override {
    if (in[e]) unlink(e);
  }
  bool admit(int, int64_t, bool) override { return true; }
  int choose(const std::vector<char>& pinned) override {
    for (int e = head; e >= 0; e = next[e])
      if (!pinned[e]) return e;
    return -1;
  }
};

struct Scored : Impl {  // one lfru-family policy alone
  Shared sh;
  Ranker r;
  Scored(int E, int cap, const std::vector<int>* so, double d, double l, bool adm)
      : sh(E), r(&sh, so, E, cap, d, l, adm) {}
  void touch(int e, int64_t t) override { r.touch(e, t); }
  void insert(int e, int64_t t) override { r.insert(e, t); }
  void remove(int e) override { r.remove(e); }
  bool admit(int e, int64_t t, bool p) override { return r.admit(e, t, p); }
  int choose(const std::vector<char>& pinned) override { return r.choose(pinned); }
};

// policy.py Adaptive with lfru-family candidates (their shared mode): the leader ranks, the followers
// keep their scores, one ghost per candidate counts the hits it would have had.
struct Adaptive : Impl {
  Shared sh;
  std::vector<std::unique_ptr<Ranker>> rankers;
  std::vector<std::unique_ptr<Ghost>> ghosts;
  std::vector<double> score;
  std::vector<char> watched;
  std::vector<int> uses;
  double decay;
  int64_t t = 0, pending_t = 0;
  bool has_t = false, has_pending_t = false;
  int lead = 0, pending = -1;

  Adaptive(int E, int cap, const std::vector<int>* so, const std::vector<double>& decays,
           const std::vector<double>& lams, const std::vector<bool>& adm, double d, const std::vector<bool>& w,
           int gcap)
      : sh(E), score(decays.size(), 0.0), watched(w.begin(), w.end()), decay(d) {
    for (size_t k = 0; k < decays.size(); ++k) {
      rankers.emplace_back(new Ranker(&sh, so, E, cap, decays[k], lams[k], adm[k]));
      ghosts.emplace_back(new Ghost(E, gcap, decays[k], lams[k], adm[k]));
      rankers[k]->set_ranking(k == 0);
    }
  }
  void new_step(int64_t now) {
    if (!uses.empty()) {
      for (size_t k = 0; k < ghosts.size(); ++k) score[k] += ghosts[k]->step(uses, t);
      uses.clear();
    }
    if (has_t) {
      double d = std::pow(decay, static_cast<double>(now - t));
      int best = 0;
      for (size_t k = 0; k < score.size(); ++k) {
        score[k] = score[k] * d;
        if (score[k] > score[best]) best = static_cast<int>(k);
      }
      if (best != lead) {
        Ranker &old = *rankers[lead], &neu = *rankers[best];
        old.set_ranking(false);
        neu.now = old.now;
        neu.set_ranking(true);
        lead = best;
      }
    }
    t = now;
    has_t = true;
  }
  void use(int e, int64_t now) {
    if (!has_t || now != t) new_step(now);
    if (watched[e]) uses.push_back(e);
  }
  void touch(int e, int64_t now) override {
    if (pending != e || !has_pending_t || pending_t != now) use(e, now);
    pending = -1;
    rankers[lead]->touch(e, now);
    for (size_t k = 0; k < rankers.size(); ++k)
      if (static_cast<int>(k) != lead) rankers[k]->note(e, now);
  }
  void insert(int e, int64_t now) override { rankers[lead]->insert(e, now); }
  void remove(int e) override { rankers[lead]->remove(e); }
  bool admit(int e, int64_t now, bool prefetch) override {
    if (!prefetch) {
      use(e, now);
      pending = e;
      pending_t = now;
      has_pending_t = true;
    }
    return rankers[lead]->admit(e, now, prefetch);
  }
  int choose(const std::vector<char>& pinned) override { return rankers[lead]->choose(pinned); }
  int leader() const override { return lead; }
};

// One layer's device-tier policy with its copy of the table's slot_of (the Python SlotTable stays the
// table of record; `step` returns what it must apply).
class PlannerCore {
 public:
  explicit PlannerCore(int E) : slot_of_(E, -1), pinned_(E, 0) {}
  std::vector<int> slot_of_;
  std::vector<char> pinned_;
  std::unique_ptr<Impl> impl_;

  void touch(int e, int64_t t) { impl_->touch(check(e), t); }
  void insert(int e, int64_t t, int slot) {
    slot_of_[check(e)] = slot;
    impl_->insert(e, t);
  }
  void remove(int e) {
    slot_of_[check(e)] = -1;
    impl_->remove(e);
  }
  bool admit(int e, int64_t t, bool prefetch) { return impl_->admit(check(e), t, prefetch); }
  int choose(const std::vector<int>& pinned) {
    for (int e : pinned) pinned_[check(e)] = 1;
    int v = impl_->choose(pinned_);
    for (int e : pinned) pinned_[e] = 0;
    return v;
  }
  int leader() const { return impl_->leader(); }

  // One layer step's table accesses, in the planner's order: the hits (touched and pinned), then each
  // miss by its mode (0: bypassed, no placement; 1: accessed; 2: accessed only while a free slot is
  // left, else bypassed). `free`: the table's free slots (taken from the back), `pinned`: experts
  // pinned already. -> per miss (slot, evicted): slot -2 bypassed, -1 not placed; then how many free
  // slots were taken.
  std::vector<int> step(const std::vector<int>& hits, const std::vector<int>& misses,
                        const std::vector<int>& modes, const std::vector<int>& free,
                        const std::vector<int>& pinned, int64_t t) {
    if (modes.size() != misses.size()) throw std::invalid_argument("step: modes and misses differ in length");
    std::vector<int> out;
    out.reserve(2 * misses.size() + 1);
    std::vector<int> placed;
    for (int e : pinned) pinned_[check(e)] = 1;
    size_t nfree = free.size();
    for (int e : hits) {
      impl_->touch(check(e), t);
      pinned_[e] = 1;
    }
    for (size_t j = 0; j < misses.size(); ++j) {
      int e = check(misses[j]);
      if (modes[j] == 0 || (modes[j] == 2 && nfree == 0)) {
        out.push_back(-2);
        out.push_back(-1);
        continue;
      }
      int s = -1, ev = -1;
      if (impl_->admit(e, t, false)) {
        if (nfree > 0) {
          s = free[--nfree];
        } else {
          ev = impl_->choose(pinned_);
          if (ev >= 0) {
            s = slot_of_[ev];
            slot_of_[ev] = -1;
            impl_->remove(ev);
          }
        }
      }
      if (s >= 0) {
        slot_of_[e] = s;
        impl_->insert(e, t);
        impl_->touch(e, t);
        pinned_[e] = 1;
        placed.push_back(e);
      } else {
        ev = -1;
      }
      out.push_back(s);
      out.push_back(ev);
    }
    for (int e : pinned) pinned_[e] = 0;
    for (int e : hits) pinned_[e] = 0;
    for (int e : placed) pinned_[e] = 0;
    out.push_back(static_cast<int>(free.size() - nfree));
    return out;
  }

 private:
  int check(int e) const {
    if (e < 0 || e >= static_cast<int>(slot_of_.size()))
      throw std::out_of_range("planner core: expert id " + std::to_string(e) + " outside 0.." +
                              std::to_string(slot_of_.size() - 1));
    return e;
  }
};

}  // namespace

void register_planner_core(py::module_& m) {
  py::class_<PlannerCore>(m, "PlannerCore")
      .def_static(
          "lru",
          [](int E) {
            auto* c = new PlannerCore(E);
            c->impl_.reset(new Lru(E));
            return c;
          },
          py::return_value_policy::take_ownership)
      .def_static(
          "scored",
          [](int E, int cap, double decay, double lam, bool admission) {
            auto* c = new PlannerCore(E);
            c->impl_.reset(new Scored(E, cap, &c->slot_of_, decay, lam, admission));
            return c;
          },
          py::return_value_policy::take_ownership)
      .def_static(
          "adaptive",
          [](int E, int cap, std::vector<double> decays, std::vector<double> lams, std::vector<bool> admission,
             double decay, std::vector<bool> watched, int ghost_capacity) {
            if (decays.empty() || lams.size() != decays.size() || admission.size() != decays.size() ||
                static_cast<int>(watched.size()) != E)
              throw std::invalid_argument("PlannerCore.adaptive: one decay, lam and admission per candidate, "
                                          "one watched flag per expert");
            auto* c = new PlannerCore(E);
            c->impl_.reset(
                new Adaptive(E, cap, &c->slot_of_, decays, lams, admission, decay, watched, ghost_capacity));
            return c;
          },
          py::return_value_policy::take_ownership)
      .def("touch", &PlannerCore::touch)
      .def("insert", &PlannerCore::insert)
      .def("remove", &PlannerCore::remove)
      .def("admit", &PlannerCore::admit)
      .def("choose", &PlannerCore::choose)
      .def("leader", &PlannerCore::leader)
      .def("step", &PlannerCore::step);
}
