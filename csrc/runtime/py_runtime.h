// Registers lily._core.DecodeRuntime (bindings only; logic in runtime/decode.*).
#pragma once
#include <nanobind/nanobind.h>

namespace lily::runtime {
void bind_runtime(nanobind::module_& m);
}
