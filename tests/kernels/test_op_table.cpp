// The op table (op_table.h) on the CPU backend: every case against its f64 reference, and
// every op of Backend, as include/shardlm/backend/backend.h declares them, covered by a case.
#include <fstream>
#include <regex>
#include <sstream>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/op_table.h"
#include "shardlm/backend/queued.h"
#include "test_util.h"

namespace shardlm::test::ops {
namespace {

std::vector<OpCase> cpu_cases() {
  std::vector<OpCase> out;
  for (OpCase& c : op_cases())
    if (c.cpu) out.push_back(std::move(c));
  return out;
}

class CpuOpTable : public ::testing::TestWithParam<OpCase> {};

TEST_P(CpuOpTable, MatchesTheF64Reference) {
  const OpCase& c = GetParam();
  cpu::CpuBackend be;
  OpRun run(be, c.dtype, c.tol);
  c.body(run);
}

INSTANTIATE_TEST_SUITE_P(Ops, CpuOpTable, ::testing::ValuesIn(cpu_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) {
                           return test_name(info.param, info.index);
                         });

// The same cases through the queued CPU backend (backend/queued.h): each op runs when the
// case's read-back copy waits for it, after the uploads and poisons queued before it.
class QueuedOpTable : public ::testing::TestWithParam<OpCase> {};

TEST_P(QueuedOpTable, MatchesTheF64Reference) {
  const OpCase& c = GetParam();
  QueuedBackend be(std::make_unique<cpu::CpuBackend>());
  OpRun run(be, c.dtype, c.tol);
  c.body(run);
}

INSTANTIATE_TEST_SUITE_P(Ops, QueuedOpTable, ::testing::ValuesIn(cpu_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) {
                           return test_name(info.param, info.index);
                         });

// The ops Backend declares, read from its header: every virtual method, with an implementation
// virtual do_<op> standing for its entry point <op> (which the header must declare too). A
// method added there without a case here (or an exclusion that names no method) fails.
std::set<std::string> declared_backend_methods() {
  const std::string header = source_dir() + "/include/shardlm/backend/backend.h";
  std::ifstream f(header);
  EXPECT_TRUE(f.good()) << "cannot read " << header;
  std::stringstream text;
  text << f.rdbuf();
  const std::string s = text.str();
  const size_t begin = s.find("class Backend : public Allocator");
  EXPECT_NE(begin, std::string::npos);
  const std::string body = s.substr(begin);
  std::set<std::string> names;
  const std::regex virtual_method(R"(virtual\s+[\w:<>,\s\*&]*?\b(\w+)\s*\()");
  for (auto it = std::sregex_iterator(body.begin(), body.end(), virtual_method);
       it != std::sregex_iterator(); ++it) {
    std::string name = (*it)[1];
    if (name.starts_with("do_")) {
      name = name.substr(3);
      const std::regex entry_point(R"([\w>&*]\s+)" + name + R"(\s*\()");
      EXPECT_TRUE(std::regex_search(body, entry_point))
          << "Backend::do_" << name << " has no entry point Backend::" << name;
    }
    names.insert(name);
  }
  names.erase("Backend");  // the destructor
  return names;
}

TEST(OpTable, CoversEveryBackendOp) {
  const std::set<std::string> declared = declared_backend_methods();
  ASSERT_GT(declared.size(), 30u);
  std::set<std::string> covered;
  for (const OpCase& c : op_cases()) covered.insert(c.method);
  for (const std::string& m : declared) {
    if (methods_without_cases().count(m)) continue;
    EXPECT_TRUE(covered.count(m)) << "Backend::" << m << " has no case in the op table";
  }
  for (const std::string& m : covered)
    EXPECT_TRUE(declared.count(m))
        << "the op table's case names '" << m << "', not a Backend method";
  for (const std::string& m : methods_without_cases())
    EXPECT_TRUE(declared.count(m)) << "methods_without_cases names '" << m << "', not a method";
}

}  // namespace
}  // namespace shardlm::test::ops
