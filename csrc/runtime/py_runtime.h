// Registers lily._core.Runtime (bindings only; logic in runtime/runtime.h).
#pragma once
#include <nanobind/nanobind.h>

namespace lily::runtime {
void bind_runtime(nanobind::module_& m);
}
