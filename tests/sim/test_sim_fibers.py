"""The simulator's fibers (csrc/gpu/sim/fibers.cpp) with each of its context switches:
assembly (x86-64 Linux, the build's), _setjmp/_longjmp (the build's on macOS; forced here
with -DLILY_SIM_SJLJ) and ucontext (-DLILY_SIM_UCONTEXT). A small driver is compiled against
fibers.cpp alone and run on two OS threads at once, each with its own FiberHost: fibers
switched in turn keep their locals, floating-point and callee-saved state, recurse deeply,
throw and catch across switches, and their stacks are reused fiber after fiber, also after a
fiber was abandoned half-way. It prints the time of a switch (to the fiber and back), which
docs/device-layer.md quotes; the test does not judge it."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")

DRIVER = r"""
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>
#include "gpu/sim/fibers.h"
using namespace lily::sim;

struct Ctx { FiberHost* host; Fiber* self; int id; long rounds; long sum = 0; double acc = 0; bool ok = true; };

int depth(FiberHost& h, Fiber& f, int n) {  // ~64 KiB of frames, switching at the bottom
  volatile char pad[512];
  pad[0] = char(n);
  if (n == 0) { h.suspend(f); return pad[0]; }
  return depth(h, f, n - 1) + pad[0];
}

void body(void* p) {
  Ctx& c = *static_cast<Ctx*>(p);
  long local = 1000 * c.id;
  double x = 0.5 * c.id;
  for (long r = 0; r < c.rounds; ++r) {
    local += r;
    x = x * 1.0000001 + 1.0;
    c.host->suspend(*c.self);
    if (local != 1000 * c.id + r * (r + 1) / 2) c.ok = false;
  }
  try {
    c.host->suspend(*c.self);
    throw std::runtime_error("across a switch");
  } catch (const std::exception&) {
    c.host->suspend(*c.self);
  }
  depth(*c.host, *c.self, 128);
  c.sum = local;
  c.acc = x;
}

void suspend_once(void* p) { Ctx& c = *static_cast<Ctx*>(p); c.host->suspend(*c.self); c.ok = false; }

// One OS thread's work: generations of fibers on one host, returns 0 when all is well.
int run(int tid, long rounds, double* ns) {
  FiberHost host;
  const int k = 8;
  for (int gen = 0; gen < 3; ++gen) {
    std::vector<Fiber> fs(k);
    std::vector<Ctx> cs(k);
    for (int i = 0; i < k; ++i) {
      cs[i] = Ctx{&host, &fs[i], tid * 100 + i, rounds};
      host.start(fs[i], &body, &cs[i]);
    }
    auto t0 = std::chrono::steady_clock::now();
    for (long r = 0; r < rounds; ++r)
      for (int i = 0; i < k; ++i) host.resume(fs[i]);
    auto t1 = std::chrono::steady_clock::now();
    if (gen == 0) *ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / double(rounds * k);
    for (int i = 0; i < k; ++i)
      for (int extra = 0; extra < 4; ++extra) host.resume(fs[i]);  // exception, depth, end
    for (int i = 0; i < k; ++i) {
      double want = 0.5 * cs[i].id;
      for (long r = 0; r < rounds; ++r) want = want * 1.0000001 + 1.0;
      if (!cs[i].ok || cs[i].sum != 1000 * cs[i].id + rounds * (rounds - 1) / 2 || cs[i].acc != want) {
        std::printf("thread %d generation %d fiber %d: wrong state\n", tid, gen, i);
        return 1;
      }
      host.release(fs[i]);
    }
    Fiber half;  // started, suspended and released before it finished
    Ctx hc{&host, &half, -1, 0};
    host.start(half, &suspend_once, &hc);
    host.resume(half);
    host.release(half);
  }
  return 0;
}

int main() {
  const long rounds = 20000;
  double ns[2] = {0, 0};
  int rc[2] = {0, 0};
  std::thread other([&] { rc[1] = run(1, rounds, &ns[1]); });
  rc[0] = run(0, rounds, &ns[0]);
  other.join();
  if (rc[0] || rc[1]) return 1;
  std::printf("ok %.1f ns per switch to a fiber and back\n", ns[0] < ns[1] ? ns[0] : ns[1]);
  return 0;
}
"""

SWITCHES = {"asm": [], "sjlj": ["-DLILY_SIM_SJLJ"], "ucontext": ["-DLILY_SIM_UCONTEXT"]}


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_fiber_switch(tmp_path, switch):
    if switch == "asm" and not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("the assembly switch is x86-64 Linux's")
    (tmp_path / "main.cpp").write_text(DRIVER)
    exe = tmp_path / "fibers"
    c = subprocess.run([CXX, "-std=c++17", "-O2", *SWITCHES[switch], "-I", str(ROOT / "csrc"),
                        str(ROOT / "csrc" / "gpu" / "sim" / "fibers.cpp"), str(tmp_path / "main.cpp"),
                        "-o", str(exe), "-pthread"], capture_output=True, text=True, timeout=280)
    assert c.returncode == 0, c.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # not instrumented
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout + r.stderr
    print(f"{switch}: {r.stdout.strip()}")
