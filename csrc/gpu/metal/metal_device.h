// The Metal backend of the device interface (Objective-C++ in metal_device.mm; this
// header is plain C++).
#pragma once

#include <memory>
#include <string>

#include "gpu/device.h"

namespace lily::metal {

// Opens the system default MTLDevice and loads the kernel library. metallib_path empty:
// $LILY_METALLIB if set, else lily.metallib beside the loaded _core module. On an
// apple10-family GPU under macOS 26 it also loads the lily_tensor_<family>.metallib files
// (the Metal 4 tensor-op kernels, one library per metal/<family>_tensor.metal) from beside
// it, or the colon-separated list $LILY_TENSOR_METALLIB (see supports_tensor_ops()).
// Throws lily::gpu::Error when there is no Metal device, the GPU is not an Apple-silicon
// GPU, or the library cannot be loaded.
std::unique_ptr<gpu::Device> make_metal_device(const std::string& metallib_path = "");

// "apple10", "apple9", "apple8" or "apple7" (for messages and benchmarks); the same as
// gpu::gpu_family_name(device.gpu_family()).
std::string gpu_family(const gpu::Device& device);

}  // namespace lily::metal
