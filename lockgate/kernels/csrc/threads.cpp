// Pinning torch's intra-op threads to CPUs, one each.
//
// lockgate::bind_threads(int[] cpus) -> int[]
//
//   cpus     one CPU per torch intra-op thread (len(cpus) == at::get_num_threads() >= 1), distinct
//   returns  the kernel thread id (gettid) of the thread bound to each CPU, in cpus' order; empty
//            when the call could not bind every thread to its own CPU (the threads are then left
//            on the whole of the process's CPUs)
//
// Why: with as many threads as the process has CPUs, Linux sometimes wakes two of them onto one
// CPU and leaves another idle for tens of milliseconds: the load balancer does not move a
// recently run ("cache hot") task at once. Traced on the Zen 5 class CPU (2 vCPUs, sched_switch):
// the scheduler process's two threads time-sliced CPU 0 in 4 ms turns for ~70 ms of a 256-token
// prompt step while CPU 1 ran its idle task, and the step took 92.6 ms instead of 67-70; that was
// c = 1's slow first token. A thread pinned to its own CPU can be
// preempted by another process on it (the kernels' work stealing covers that, steal.h), but two
// of them never share one. vLLM's CPU backend pins its OpenMP threads the same way
// (VLLM_CPU_OMP_THREADS_BIND).
//
// How: one parallel region of exactly len(cpus) indices, one per thread (at::parallel_for gives
// index i to thread i); each thread sets its own affinity (sched_setaffinity on itself). The
// calling thread is thread 0 and is bound too; threads it creates later inherit its CPU.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <set>
#include <vector>

namespace lockgate {

std::vector<int64_t> bind_threads(at::IntArrayRef cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n >= 1 && n == at::get_num_threads(), "bind_threads: one CPU per torch thread (", at::get_num_threads(),
              "), got ", n);
  TORCH_CHECK(!at::in_parallel_region(), "bind_threads: not from inside a parallel region");
  TORCH_CHECK(std::set<int64_t>(cpus.begin(), cpus.end()).size() == cpus.size(), "bind_threads: CPUs must be distinct");
  for (int64_t c : cpus) TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "bind_threads: no CPU ", c);
  std::vector<int64_t> tids(static_cast<size_t>(n), -1);
  std::atomic<bool> ok{true};
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    if (end - begin != 1) {  // not one index per thread: bind nobody
      ok = false;
      return;
    }
    tids[static_cast<size_t>(begin)] = static_cast<int64_t>(syscall(SYS_gettid));
  });
  if (!ok || std::set<int64_t>(tids.begin(), tids.end()).size() != tids.size()) return {};
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t) {
    if (static_cast<int64_t>(syscall(SYS_gettid)) != tids[static_cast<size_t>(begin)]) {
      ok = false;  // the indices went to other threads this time: do not trust the mapping
      return;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[static_cast<size_t>(begin)]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) ok = false;
  });
  if (!ok) {  // undo: every thread back on the CPUs it may use
    cpu_set_t all;
    CPU_ZERO(&all);
    for (int64_t c : cpus) CPU_SET(static_cast<int>(c), &all);
    at::parallel_for(0, n, 1, [&](int64_t, int64_t) { sched_setaffinity(0, sizeof(all), &all); });
    return {};
  }
  return tids;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) { m.def("bind_threads(int[] cpus) -> int[]", &lockgate::bind_threads); }
