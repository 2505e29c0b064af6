// SwiGLU's silu(gate) * up on the calling thread for decode-sized inputs.
//
// torch.ops.pdserve.silu_mul(gate_up [T, 2N], max_serial_numel) -> [T, N]
//
// The values come from torch's own silu and mul kernels (bit-identical to F.silu(gate) * up,
// which is what transformers computes). What changes is only where they run: below
// max_serial_numel elements the two ops run on this thread (c10::ParallelGuard keeps ATen
// from opening an OpenMP region), so a decode step does not fork and join the thread team
// twice per layer for ~0.1 MB of work. On a shared, busy host each fork/join waits for the
// slowest thread's time slice; a small serial op does not.
#include "ops.h"
#include <ATen/ATen.h>
#include <c10/util/ParallelGuard.h>
#include <torch/library.h>

namespace pdserve {

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t max_serial_numel) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up must end in an even [.., 2N] dimension");
  const int64_t n = gate_up.size(-1) / 2;
  const at::Tensor gate = gate_up.narrow(-1, 0, n), up = gate_up.narrow(-1, n, n);
  if (gate_up.numel() > max_serial_numel) return at::silu(gate).mul_(up);
  c10::ParallelGuard serial(true);
  return at::silu(gate).mul_(up);
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) { m.def("silu_mul(Tensor gate_up, int max_serial_numel) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("silu_mul", &pdserve::silu_mul); }
