// Test support: a do-nothing device guard for CUDA, so that a CPU-only torch can run
// FakeTensorMode's CUDA tensors through operators whose C++ wrappers take a device guard
// (copies, contiguous, autograd's graph). A real CUDA build registers its own and never
// loads this file.
#include <c10/core/impl/DeviceGuardImplInterface.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
