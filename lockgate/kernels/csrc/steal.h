// Work ranges that idle threads steal from, for kernels whose threads would otherwise wait on one
// that the OS has descheduled.
//
// On a machine with as many busy threads as cores, any other process that runs (the server's API
// and detokenizer processes, the benchmark client, a neighbour on the host) takes a core from one of
// the kernel's threads for a while. With a fixed split, the other thread finishes its share and
// waits for the descheduled one at the end of the parallel region: the step loses the whole time
// slice on both cores. With StealRanges each worker starts on its own contiguous range of units
// (front to back: the same order and the same prefetching as a fixed split when nobody is
// descheduled) and, once its range is empty, takes units from the back of another worker's range,
// so a descheduled worker's unstarted units are done by the one that is running.
//
// steal_for is at::parallel_for with stealing, for loops over independent rows.
//
// Invariants: every unit in [0, units) is handed out exactly once (a compare-and-swap per claim on
// the owner's (front, back) pair); which worker runs a unit is the only thing stealing changes, so a
// kernel whose units' results do not depend on the thread (lockgate's all do) gives the same bits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace lockgate {

class StealRanges {
 public:
  // units split into `workers` contiguous ranges by `bounds` (workers + 1 non-decreasing entries,
  // bounds[0] = 0, bounds[workers] = units).
  StealRanges(const int64_t* bounds, int64_t workers) : workers_(workers), r_(new Range[workers]) {
    TORCH_INTERNAL_ASSERT(bounds[workers] < (int64_t{1} << 31), "StealRanges: too many units for its 32-bit halves");
    for (int64_t w = 0; w < workers; ++w) r_[w].v.store(pack(bounds[w], bounds[w + 1]), std::memory_order_relaxed);
  }

  // The next unit for worker w: the front of its own range while it lasts, then the back of the
  // others' (the next worker's first); -1 when every unit is taken. `own` says which it was.
  int64_t next(int64_t w, bool* own) {
    int64_t u = take(w, true);
    *own = u >= 0;
    for (int64_t i = 1; u < 0 && i < workers_; ++i) u = take((w + i) % workers_, false);
    return u;
  }

  // The unit worker w takes next from its own range, or -1 if none is left there (for prefetching).
  int64_t peek(int64_t w) const {
    const uint64_t v = r_[w].v.load(std::memory_order_relaxed);
    return front(v) < back(v) ? front(v) : -1;
  }

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> v;
  };
  static uint64_t pack(int64_t f, int64_t b) { return (static_cast<uint64_t>(f) << 32) | static_cast<uint32_t>(b); }
  static int64_t front(uint64_t v) { return static_cast<int64_t>(v >> 32); }
  static int64_t back(uint64_t v) { return static_cast<int64_t>(v & 0xffffffffu); }

  int64_t take(int64_t w, bool from_front) {
    std::atomic<uint64_t>& a = r_[w].v;
    uint64_t v = a.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = front(v), b = back(v);
      if (f >= b) return -1;
      const uint64_t n = from_front ? pack(f + 1, b) : pack(f, b - 1);
      if (a.compare_exchange_weak(v, n, std::memory_order_relaxed)) return from_front ? f : b - 1;
    }
  }

  int64_t workers_;
  std::unique_ptr<Range[]> r_;
};

// Units of [0, n) for StealRanges: each worker's run of rows as at::parallel_for splits n among
// `workers` (ceil(n / workers) each, in order), cut into pieces of up to `piece` rows. Unit u covers
// rows start[u] .. start[u + 1] - 1 (a worker's last unit ends where the next worker's run begins);
// worker w's own units are bounds[w] .. bounds[w + 1] - 1.
struct StealSplit {
  std::vector<int64_t> start, bounds;
  StealSplit(int64_t n, int64_t workers, int64_t piece) : bounds{0} {
    const int64_t per = (n + workers - 1) / workers;
    start.reserve(static_cast<size_t>(workers * ((per + piece - 1) / piece) + 1));
    for (int64_t w = 0; w < workers; ++w) {
      for (int64_t r = w * per; r < std::min(n, (w + 1) * per); r += piece) start.push_back(r);
      bounds.push_back(static_cast<int64_t>(start.size()));
    }
    start.push_back(n);
  }
};

// at::parallel_for(begin, end, grain, f) with stealing: the same workers (at most one per `grain`
// rows), each starting on exactly the rows at::parallel_for would give it, cut into up to
// kStealPieces pieces so that an idle worker can take the unstarted pieces of a descheduled one.
// f(b, e) is called once per piece; inside a parallel region, or with one worker, f(begin, end)
// runs here.
constexpr int64_t kStealPieces = 8;

template <typename F>
void steal_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin, g = std::max<int64_t>(1, grain);
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (n + g - 1) / g);
  if (workers <= 1 || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t per = (n + workers - 1) / workers;
  const StealSplit split(n, workers, std::max<int64_t>(1, (per + kStealPieces - 1) / kStealPieces));
  StealRanges ranges(split.bounds.data(), workers);
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      bool own = false;
      for (int64_t u = ranges.next(w, &own); u >= 0; u = ranges.next(w, &own))
        f(begin + split.start[u], begin + split.start[u + 1]);
    }
  });
}

}  // namespace lockgate
