// Pins the calling thread's intra-op (OpenMP) team, one core per thread.
//
// torch.ops.pdserve.pin_intra_op_threads(cores) -> tids
//
// Runs one at::parallel_for index per thread of the team the calling thread opens (index i on
// team thread i, the caller being thread 0) and sets that thread's affinity to cores[i]
// (sched_setaffinity on the thread itself); a core of -1 leaves that thread as it is. Returns
// each thread's kernel thread id in team order, so the caller can check the team was whole
// (distinct ids) and read the affinity back from /proc. GOMP keeps one team per calling
// thread, so this pins the team of the thread that runs the engine's steps only.
#include <ATen/Parallel.h>
#include <sched.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace pdserve {
namespace {

int pin_self(int64_t core) {
  if (core < 0) return 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<int>(core), &set);
  return sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
}

std::vector<int64_t> pin_intra_op_threads(std::vector<int64_t> cores) {
  const int64_t n = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cores.size()) == n, "pin_intra_op_threads: give one core per intra-op thread (",
              n, "), got ", cores.size());
  for (int64_t core : cores) TORCH_CHECK(core >= -1 && core < CPU_SETSIZE, "core out of range: ", core);
  std::vector<int64_t> tids(n, -1);
  std::vector<int> errs(n, 0);
  auto pin = [&](int64_t i) {
    errs[i] = pin_self(cores[i]);
    tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
  };
  if (n == 1) {
    pin(0);
  } else {
    at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) pin(i);
    });
  }
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(errs[i] == 0, "sched_setaffinity to core ", cores[i], " failed: ", std::strerror(errs[i]));
  return tids;
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("pin_intra_op_threads(int[] cores) -> int[]", &pdserve::pin_intra_op_threads);
}
