// W8A8Linear's kernel call as a C++ op: FBGEMM's dynamic int8 linear on packed weights named by a handle.
// Called from Python instead, each call paid a trip through the interpreter (sparsegen/quant/fast.py, _native_kernels).
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;
std::shared_mutex lock;  // (a server's threads call and build models at once)
std::unordered_map<int64_t, Packed> held;

void hold(int64_t handle, Packed packed) {
  std::unique_lock guard(lock);
  held[handle] = std::move(packed);
}

void release(int64_t handle) {
  std::unique_lock guard(lock);
  held.erase(handle);
}

at::Tensor w8a8_linear(const at::Tensor& x, int64_t handle, int64_t out_features) {
  Packed packed;
  {
    std::shared_lock guard(lock);
    auto found = held.find(handle);
    TORCH_CHECK(found != held.end(), "sparsegen::w8a8_linear: no packed weights hold handle ", handle);
    packed = found->second;
  }
  return packed->apply_dynamic(x, /*reduce_range=*/true);  // (7-bit inputs: AVX2's 16-bit pair sums)
}

}  // namespace

TORCH_LIBRARY(sparsegen_fbgemm, m) {
  m.def("hold(int handle, __torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> ()", hold);
  m.def("release(int handle) -> ()", release);
}

TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("w8a8_linear", w8a8_linear);
}
