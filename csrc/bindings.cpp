// lily._core: the native module. Bindings only; logic lives in csrc/runtime and csrc/gpu.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sstream>
#include <string>
#include <vector>

#include "gpu/py_device.h"
#include "runtime/py_families.h"
#include "runtime/py_runtime.h"

namespace nb = nanobind;

namespace {

std::vector<std::string> split_devices(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::string compiler_id() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "gcc " __VERSION__;
#else
  return "unknown";
#endif
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "Lily's native core (C++17; Objective-C++ for the Metal backend).";
  m.attr("__version__") = LILY_VERSION;
  m.def("compiled_devices", [] { return split_devices(LILY_DEVICES); },
        "Names of the native devices compiled into this build, e.g. ['sim'] or ['sim', 'metal'].");
  m.def("build_info", [] {
    nb::dict d;
    d["version"] = LILY_VERSION;
    d["compiler"] = compiler_id();
    d["cxx_standard"] = static_cast<long>(__cplusplus);
#if defined(__APPLE__)
    d["platform"] = "darwin";
#elif defined(__linux__)
    d["platform"] = "linux";
#else
    d["platform"] = "other";
#endif
#if defined(NDEBUG)
    d["debug"] = false;
#else
    d["debug"] = true;
#endif
    d["devices"] = split_devices(LILY_DEVICES);
    return d;
  }, "Build facts: version, compiler, platform, debug flag and compiled devices.");
  lily::gpu::bind_device(m);
  lily::runtime::bind_runtime(m);
  lily::runtime::bind_families(m);
}
