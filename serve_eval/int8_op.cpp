// draftsmith_int8::linear(rows, key): fbgemm's dynamic int8 product of `rows` with the weight registered
// under `key`, from C++ (serve_eval/int8.py builds this file once per machine and loads it).
//
// It computes exactly what quantized::linear_dynamic(rows, packed, reduce_range=True) computes: the same
// packed weight, the same call. What it saves is the crossing into Python: a compiled graph cannot hold
// fbgemm's packed object, so it names the weight by an integer key, and an operator implemented in
// Python costs ~20 us a call to reach (a draft makes six such products); this one is reached from the
// graph's wrapper like any ATen operator.
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

std::mutex& guard() {
  static std::mutex m;
  return m;
}

std::unordered_map<int64_t, Packed>& weights() {
  static std::unordered_map<int64_t, Packed> table;
  return table;
}

void put(int64_t key, const Packed& packed) {
  std::lock_guard<std::mutex> lock(guard());
  weights()[key] = packed;
}

void drop(int64_t key) {
  std::lock_guard<std::mutex> lock(guard());
  weights().erase(key);
}

at::Tensor linear(const at::Tensor& rows, int64_t key) {
  Packed packed;
  {
    std::lock_guard<std::mutex> lock(guard());
    auto found = weights().find(key);
    TORCH_CHECK(found != weights().end(), "draftsmith_int8::linear: no weight registered under key ", key);
    packed = found->second;
  }
  return packed->apply_dynamic(rows, /*reduce_range=*/true);
}

}  // namespace

TORCH_LIBRARY(draftsmith_int8, m) {
  m.def("put(int key, __torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> ()", put);
  m.def("drop(int key) -> ()", drop);
  m.def("linear(Tensor rows, int key) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_int8, CPU, m) { m.impl("linear", linear); }
