// Python entry points of the fastcast_kernels operators: unboxed calls through the
// dispatcher, as torch's own bindings (torch.mm, ...) make them.
//
// torch.ops.fastcast_kernels.<op>(...) converts its Python arguments to a boxed stack by
// walking the schema: about 1.3 us per call, as much as quantizing a 16x16 tensor, and
// an fc.Linear forward+backward makes six such calls. These functions take the same
// arguments and call the same registered operator through a typed handle instead. They
// go through the dispatcher all the same, so dispatch modes (TorchDispatchMode,
// FakeTensorMode), tensor subclasses, the profiler's op events and the meta/fake kernels
// see exactly what torch.ops would have shown them. The GIL is released during the call
// as torch.ops does (the dispatcher takes it back where a Python kernel runs).

// The dispatcher and pybind11 with torch's type casters (at::Tensor, ScalarType,
// optionals), not torch/extension.h: that pulls in the whole C++ frontend, which made
// this file take ~40 s of the first-use build on two cores.
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>

namespace fastcast {
namespace {

using Tensor = at::Tensor;
using OptionalTensor = std::optional<at::Tensor>;
using Tensors2 = std::tuple<Tensor, Tensor>;
using Tensors3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensors5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// Binds `fastcast_kernels::<name>` whose C++ kernel has the signature Ret(Args...): the
// typed handle is looked up once, here (the library's static initialisers have
// registered the operators by the time Python initialises the module).
template <typename Signature>
struct Bind;

template <typename Ret, typename... Args>
struct Bind<Ret(Args...)> {
  static void on(pybind11::module_& m, const char* name) {
    const auto op = c10::Dispatcher::singleton()
                        .findSchemaOrThrow((std::string("fastcast_kernels::") + name).c_str(), "")
                        .typed<Ret(Args...)>();
    m.def(
        name, [op](Args... args) -> Ret { return op.call(args...); },
        pybind11::call_guard<pybind11::gil_scoped_release>());
  }
};

}  // namespace
}  // namespace fastcast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace fastcast;
  m.doc() = "Direct (unboxed) Python entry points of the fastcast_kernels operators";
  Bind<Tensors3(const Tensor&, const OptionalTensor&, at::ScalarType, bool, double, bool,
                bool)>::on(m, "quantize_tensorwise");
  Bind<void(const Tensor&, const Tensor&)>::on(m, "record_amax");
  Bind<Tensors2(const Tensor&, const Tensor&, const Tensor&, at::ScalarType)>::on(
      m, "quantize_recording");
  Bind<void(const Tensor&, const Tensor&, double, double, double, bool)>::on(m, "delayed_update");
  Bind<Tensors2(const Tensor&, int64_t, at::ScalarType, bool, double)>::on(m, "quantize_blocks");
  Bind<Tensors2(const Tensor&, at::ScalarType, bool, bool)>::on(m, "quantize_rows");
  Bind<Tensors2(const Tensor&, at::ScalarType, bool)>::on(m, "quantize_mxfp8");
  Bind<Tensors5(const Tensor&, bool, bool, bool, bool, const OptionalTensor&,
                const OptionalTensor&)>::on(m, "quantize_nvfp4");
  Bind<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
              at::ScalarType)>::on(m, "scaled_mm_tensorwise");
  Bind<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)>::on(m, "dequantize_blocks");
  Bind<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)>::on(m, "dequantize_nvfp4");
}
