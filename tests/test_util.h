// Shared helpers for tests: seeded random tensors in std::vector storage, max-error
// comparison, and central finite differences of an f64 function. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/core/tensor.h"

namespace shardlm::test {

inline std::vector<float> random_vec(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline std::vector<double> to_f64(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

inline Tensor view(std::vector<float>& v, Shape s) {
  EXPECT_EQ(static_cast<int64_t>(v.size()), s.numel());
  return Tensor(v.data(), DType::kF32, s);
}
inline Tensor view(std::vector<int32_t>& v, Shape s) {
  EXPECT_EQ(static_cast<int64_t>(v.size()), s.numel());
  return Tensor(v.data(), DType::kI32, s);
}

// Largest |a - b| / (atol + rtol * |b|) over all elements: <= 1 means "close".
template <typename A, typename B>
double max_scaled_error(const std::vector<A>& a, const std::vector<B>& b, double atol,
                        double rtol) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::abs(double(a[i]) - double(b[i]));
    const double s = d / (atol + rtol * std::abs(double(b[i])));
    if (!(s <= worst)) worst = s;  // NaN propagates as failure
  }
  return worst;
}

#define EXPECT_CLOSE(actual, expected, atol, rtol) \
  EXPECT_LE(::shardlm::test::max_scaled_error((actual), (expected), (atol), (rtol)), 1.0)

// d f / d x_i by central differences on an f64 function of x (x is restored).
inline std::vector<double> finite_difference(std::vector<double>& x,
                                             const std::function<double()>& f, double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f();
    x[i] = x0 - h;
    const double fm = f();
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// The whole content of a file ("" when it cannot be read).
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs the shell command `cmd` with its stdout into `out` and returns that output; stderr goes
// to `out` too when merge_stderr, else beside it (out + ".err"). A non-zero exit is a test
// failure showing the error output.
inline std::string run_command(const std::string& cmd, const std::filesystem::path& out,
                               bool merge_stderr = false) {
  const std::string err = merge_stderr ? out.string() : out.string() + ".err";
  const int rc =
      std::system((cmd + " > " + out.string() + (merge_stderr ? " 2>&1" : " 2> " + err)).c_str());
  EXPECT_EQ(rc, 0) << cmd << "\n" << slurp(err);
  return slurp(out);
}

// Runs f, which must throw Error(kConfig) whose message contains every string of `expect`.
inline void expect_config_error(const std::function<void()>& f,
                                const std::vector<std::string>& expect) {
  try {
    f();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
    for (const auto& s : expect)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << "message: " << e.what() << "\nmissing: " << s;
  }
}

// A directory of this test process's own under the system temp directory, created on first
// use and removed when the process exits (set SHARDLM_KEEP_TEST_FILES=1 to keep it). Test
// files go under it, so that test processes running at the same time (ctest -j, two build
// trees) never share a path.
inline const std::filesystem::path& scratch_root() {
  struct Root {
    pid_t owner = ::getpid();  // a forked child that exits normally must not remove it
    std::filesystem::path path;
    Root()
        : path(std::filesystem::temp_directory_path() / ("shardlm_test_" + std::to_string(owner))) {
      std::filesystem::create_directories(path);
    }
    ~Root() {
      std::error_code ec;
      if (::getpid() == owner && std::getenv("SHARDLM_KEEP_TEST_FILES") == nullptr)
        std::filesystem::remove_all(path, ec);
    }
  };
  static const Root root;
  return root.path;
}

// Where a test finds the repository's files (tests/data, configs), the shardlm binary and
// mpiexec: the paths CMake compiled in, unless SHARDLM_SOURCE_DIR / SHARDLM_BINARY name others,
// as scripts/gpu-check.sh does for the test binaries of a relocated dist (make dist). mpiexec is
// empty in a build without MPI.
inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}
#ifdef SHARDLM_SOURCE_DIR
inline std::string source_dir() { return env_or("SHARDLM_SOURCE_DIR", SHARDLM_SOURCE_DIR); }
inline std::string shardlm_binary() { return env_or("SHARDLM_BINARY", SHARDLM_BINARY); }
#endif

// mpiexec, with Open MPI's session directories of this test process's own (under scratch_root):
// by default every mpiexec of the machine creates its directory under one shared parent in the
// temp directory, which a job that just finished may be removing (ctest -j: "mkdir ... No such
// file or directory"). The variable is set in this process, so every command it runs inherits it.
#ifdef SHARDLM_MPIEXEC
inline std::string mpiexec() {
  static const bool session_dir_set = [] {
    return ::setenv("OMPI_MCA_orte_tmpdir_base", (scratch_root() / "ompi").c_str(), 1) == 0;
  }();
  (void)session_dir_set;
  return SHARDLM_MPIEXEC;
}
#endif

// The reference-implementation venv (scripts/setup-venv.sh): $SHARDLM_VENV, or
// ~/.cache/shardlm/venv.
inline std::filesystem::path venv_dir() {
  const char* env = std::getenv("SHARDLM_VENV");
  const char* home = std::getenv("HOME");
  return env != nullptr && *env != 0
             ? std::filesystem::path(env)
             : std::filesystem::path(home ? home : "") / ".cache/shardlm/venv";
}

// The venv's python when it has `modules` installed (one name, or several separated by commas),
// else "" (the test then skips, saying why). Found, not imported: importing peft (bitsandbytes,
// torch's compiler) takes seconds, and the reference script imports it again; an installed
// module that fails to import fails the test.
inline std::string venv_python(const std::string& modules) {
  const std::filesystem::path python = venv_dir() / "bin/python";
  if (!std::filesystem::exists(python)) return "";
  const std::string quoted = fmt::format("'{}'", python.string());
  const std::string cmd = fmt::format(
      "{} -c 'import importlib.util, sys; "
      "sys.exit(not all(importlib.util.find_spec(m.strip()) for m in \"{}\".split(\",\")))' "
      "> /dev/null 2>&1",
      quoted, modules);
  return std::system(cmd.c_str()) == 0 ? quoted : "";
}

inline std::string venv_skip_reason(const std::string& module) {
  return "the Python package '" + module + "' is not importable from the venv at " +
         venv_dir().string() + " (bash scripts/setup-venv.sh installs it)";
}

// SHARDLM_REQUIRE_REFERENCES=1 (CI sets it): a reference test whose reference is missing fails
// instead of skipping, so that CI can never pass without having compared.
inline bool references_required() {
  const char* env = std::getenv("SHARDLM_REQUIRE_REFERENCES");
  return env != nullptr && std::string(env) == "1";
}

}  // namespace shardlm::test

// Ends a reference test whose reference (a venv package, an asset) is missing: a skip that says
// `why`, or under SHARDLM_REQUIRE_REFERENCES=1 a failure.
#define SHARDLM_MISSING_REFERENCE(why)                                                    \
  do {                                                                                    \
    if (::shardlm::test::references_required())                                           \
      FAIL() << (why) << "; SHARDLM_REQUIRE_REFERENCES=1 makes a missing reference fail"; \
    GTEST_SKIP() << (why);                                                                \
  } while (0)

namespace shardlm::test {

// Every file of directory `a` has a byte-identical twin in `b`, and `b` has no other file.
inline void expect_same_files(const std::filesystem::path& a, const std::filesystem::path& b) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(a)) {
    ++n;
    const auto twin = b / e.path().filename();
    EXPECT_TRUE(std::filesystem::exists(twin)) << twin << " is missing";
    EXPECT_TRUE(slurp(e.path()) == slurp(twin)) << e.path() << " and " << twin << " differ";
  }
  EXPECT_EQ(size_t(std::distance(std::filesystem::directory_iterator(b), {})), n);
}

// The analytic and finite-difference directional derivatives of one parameter tensor.
struct DirectionalDerivative {
  std::string name;
  double analytic;           // g . u
  double finite_difference;  // (loss(w + h u) - loss(w - h u)) / 2h
};

// For each entry (anything with name, shape and offset into the arena `w` / gradient `g`), a
// seeded random direction u restricted to that tensor, the step h = step / rms(u), and both
// derivatives of `loss_at` along it; w is restored after each. Per-tensor directions catch a
// wrong gradient in any single tensor with far less f32 noise than per-element checks.
template <typename Entries>
std::vector<DirectionalDerivative> directional_derivatives(const Entries& entries, float* w,
                                                           const std::vector<float>& g,
                                                           const std::function<double()>& loss_at,
                                                           float step, uint64_t seed = 11) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01;
  std::vector<DirectionalDerivative> out;
  for (const auto& e : entries) {
    const int64_t n = e.shape.numel();
    std::vector<float> u(n);
    double gu = 0, unorm = 0;
    for (int64_t i = 0; i < n; ++i) {
      u[i] = n01(rng);
      gu += double(u[i]) * g[e.offset + i];
      unorm += double(u[i]) * u[i];
    }
    const float h = step / float(std::sqrt(unorm / n));
    std::vector<float> saved(w + e.offset, w + e.offset + n);
    for (int64_t i = 0; i < n; ++i) w[e.offset + i] = saved[i] + h * u[i];
    const double lp = loss_at();
    for (int64_t i = 0; i < n; ++i) w[e.offset + i] = saved[i] - h * u[i];
    const double lm = loss_at();
    std::copy(saved.begin(), saved.end(), w + e.offset);
    out.push_back({e.name, gu, (lp - lm) / (2.0 * h)});
  }
  return out;
}

}  // namespace shardlm::test
